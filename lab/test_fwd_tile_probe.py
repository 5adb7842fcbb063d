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
    base = (trees[0] / "fwd_sm90.cu").read_text()
    assert base == (fwd_tile_probe.ROOT / "kernels_cu" / "fwd_sm90.cu").read_text()
    for tree, name in zip(trees[1:], fwd_tile_probe.PROBES):
        got = (tree / "fwd_sm90.cu").read_text()
        assert got != base and got == fwd_tile_probe.patched(base, fwd_tile_probe.PROBES[name])
        others = sorted(p.name for p in tree.iterdir() if p.name != "fwd_sm90.cu")
        assert all((tree / o).read_bytes() == (trees[0] / o).read_bytes() for o in others)


def test_a_missing_anchor_stops_the_probe():
    with pytest.raises(ValueError, match="expected once"):
        fwd_tile_probe.patched("no such code", [("store_rows<", "x")])
