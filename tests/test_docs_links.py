"""Every relative link and every repository path named in README.md, docs/*.md and lab/README.md
resolves to a file or folder of the checkout (CPU only, no GPU, no network).

Checked: markdown links ``[text](target)`` (relative to the page; web links and pure anchors
skipped, a ``#section`` suffix ignored) and repository paths written in the text, backticked or
not, that start with one of the top-level folders (``docs/x.md``, ``benchmarks/memory.py``,
``lab/sm90_tune.py``, ``tests/test_api.py::test_x``; relative to the repository root).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = ("docs", "benchmarks", "lab", "tools", "tests", "kernels_cu", "cupyflash", "notebooks")

MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REPO_PATH = re.compile(r"(?<![\w/.\-])((?:%s)/[\w.\-/]*\w)" % "|".join(TOP))


def pages() -> list:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if (ROOT / "lab" / "README.md").is_file():
        found.append(ROOT / "lab" / "README.md")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list:
    """(kind, target) of every link or repository path in ``page`` that does not resolve."""
    text = page.read_text(encoding="utf-8")
    bad = []
    for target in MD_LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.\-]*:", target) or target.startswith("#"):
            continue                      # http(s):, mailto:, ... and anchors within the page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            bad.append(("link", target))
    for path in REPO_PATH.findall(text):
        if not (root / path).exists():
            bad.append(("path", path))
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_resolves(page):
    bad = broken_links(page)
    assert not bad, f"{page.relative_to(ROOT)}: " + ", ".join(f"{k} {t}" for k, t in bad)


def test_the_pages_exist():
    names = {str(p.relative_to(ROOT)) for p in pages()}
    assert {"README.md", "docs/semantics.md", "docs/hopper.md"} <= names


def test_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "lab").mkdir()
    (tmp_path / "docs" / "there.md").write_text("x")
    (tmp_path / "lab" / "probe.py").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](there.md#a) [web](https://example.com) [anchor](#top) [gone](missing.md)\n"
        "`lab/probe.py` is here, `lab/gone.py` is not; see docs/there.md and docs/nope.md.\n"
        "A test id: `lab/probe.py::test_x`.\n")
    assert broken_links(page, root=tmp_path) == [
        ("link", "missing.md"), ("path", "lab/gone.py"), ("path", "docs/nope.md")]
