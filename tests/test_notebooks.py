"""Every notebook runs top to bottom, so none rots.

The notebooks are executed cell by cell in one namespace (plain Python: no Jupyter kernel needed).
Notebooks whose metadata says ``"cupyflash": {"needs_gpu": true}`` run only where a GPU is (and say
so in their first cell); the others run where matplotlib (the notebooks extra) is installed.
Outputs must be stripped in git; every cell has an id (nbformat 4.5); only the public API is used.
"""
import json
import re
from pathlib import Path

import pytest

from cupyflash._interop import gpu_available

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _load(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nb = _load(path)
    if nb["metadata"].get("cupyflash", {}).get("needs_gpu") and not gpu_available():
        pytest.skip("notebook needs a GPU")
    pytest.importorskip("matplotlib", reason="the notebooks extra: pip install -e '.[notebooks]'")
    monkeypatch.chdir(path.parent)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_outputs_are_stripped(path):
    for cell in _load(path)["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs", []) == [] and cell.get("execution_count") is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_cells_have_ids(path):
    nb = _load(path)
    assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5)
    ids = [cell.get("id") for cell in nb["cells"]]
    assert all(isinstance(i, str) and re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", i) for i in ids), ids
    assert len(set(ids)) == len(ids), ids


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_uses_the_public_api_only(path):
    for cell in _load(path)["cells"]:
        source = "".join(cell["source"])
        assert not re.search(r"cupyflash\._|from cupyflash import _|cf\._", source), source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_gpu_notebook_says_so_at_the_top(path):
    nb = _load(path)
    if nb["metadata"].get("cupyflash", {}).get("needs_gpu"):
        assert "Needs a CUDA GPU" in "".join(nb["cells"][0]["source"])


def test_notebooks_validate_against_nbformat():
    nbformat = pytest.importorskip("nbformat")
    for path in NOTEBOOKS:
        nbformat.validate(nbformat.read(str(path), as_version=4))
