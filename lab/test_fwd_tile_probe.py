# Question: Do fwd_tile_probe.py's patches still apply to the current Hopper forward source?
"""lab/fwd_tile_probe.py: its patches still apply to the current forward kernel (a probe
whose anchor moved fails here, not on the device), and each probe tree differs from the base by
its patch alone."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fwd_tile_probe  # noqa: E402


def test_trees_are_the_base_plus_one_patch(tmp_path):
    trees = fwd_tile_probe.make_trees(tmp_path)
    assert [t.parent.name for t in trees] == ["base", *fwd_tile_probe.PROBES]
    src = fwd_tile_probe.ROOT / "kernels_cu"
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    base = {f: (trees[0] / f).read_text() for f in files}
    assert base == {f: (src / f).read_text() for f in files}
    for tree, name in zip(trees[1:], fwd_tile_probe.PROBES):
        got = {f: (tree / f).read_text() for f in files}
        assert got != base
        expect = dict(base)
        for anchor, replacement in fwd_tile_probe.PROBES[name]:
            (f,) = [f for f in fwd_tile_probe.FILES if anchor in expect[f]]
            expect[f] = fwd_tile_probe.patched(expect[f], [(anchor, replacement)])
        assert got == expect


def test_a_missing_anchor_stops_the_probe():
    with pytest.raises(ValueError, match="expected once"):
        fwd_tile_probe.patched("no such code", [("store_rows<", "x")])
