"""Probe of the Hopper forward's fixed cost per work tile (docs/hopper.md, "Where it stands":
the non-causal cells fit peak · n / (n + x) with x ≈ 2 key-tile steps for us, ≈ 1 for cuDNN).

Writes kernels_cu trees that each take one part of a work tile's fixed cost away, for timing
only (their results are wrong on purpose), then (with --run) times them against an unchanged
copy with benchmarks/ab_fwd_kernels.py in one process, cuDNN in the rotation:

    python benchmarks/fwd_tile_probe.py --out /tmp/probe            # the trees, and the command
    python benchmarks/fwd_tile_probe.py --out /tmp/probe --run -- --seqlens 512 1024 16384

Probes (each a textual patch of fwd_sm90.cu; a patch whose anchor is gone stops the script):
- ``nostore``: the epilogue's O and lse stores never execute (guarded by a condition that is
  false at run time, so O is still computed): what the stores cost.
- ``static``: the producer takes work tiles i, i + grid, ... instead of drawing each from the
  global counter (an atomicAdd, an L2 round trip, between releasing one Q and loading the next):
  what drawing costs on the tile boundary (the same tiles, the same results, another order).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: probe name -> [(anchor, replacement)] in kernels_cu/fwd_sm90.cu
PROBES = {
    "nostore": [(
        "        store_rows<E, NO, VARLEN>(p, wt, o_acc, m_run, l_run, sl2, wt.m0 + cw * WG_ROWS + row_in_wg,\n",
        "        if (p.b < 0)   // probe: never at run time\n"
        "        store_rows<E, NO, VARLEN>(p, wt, o_acc, m_run, l_run, sl2, wt.m0 + cw * WG_ROWS + row_in_wg,\n",
    )],
    "static": [(
        "w = p.sched ? (int)atomicAdd(p.sched, 1u) : blockIdx.x + drawn * gridDim.x;",
        "w = blockIdx.x + drawn * gridDim.x;   // probe: static order",
    )],
}


def patched(source: str, patches) -> str:
    """``source`` with each (anchor, replacement) applied once; ValueError if an anchor is not
    there exactly once (the kernel changed: the probe must be redone, not silently skipped)."""
    for anchor, replacement in patches:
        if source.count(anchor) != 1:
            raise ValueError(f"anchor found {source.count(anchor)} times, expected once: {anchor!r}")
        source = source.replace(anchor, replacement)
    return source


def make_trees(out: Path, kernels: Path = ROOT / "kernels_cu") -> list:
    """Writes out/base/kernels_cu (a copy) and out/<probe>/kernels_cu for every probe; returns
    the kernels_cu paths, base first."""
    trees = []
    for name in ["base", *PROBES]:
        tree = out / name / "kernels_cu"
        if tree.exists():
            shutil.rmtree(tree)
        shutil.copytree(kernels, tree)
        if name != "base":
            f = tree / "fwd_sm90.cu"
            f.write_text(patched(f.read_text(), PROBES[name]))
        trees.append(tree)
    return trees


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the trees")
    ap.add_argument("--run", action="store_true", help="time them (needs the GPU)")
    args = ap.parse_args(argv)
    trees = make_trees(args.out)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ab_fwd_kernels.py"), "--trees",
           *map(str, trees), "--dtype", "bfloat16", "--peer", "cudnn", *rest]
    print("# trees: " + ", ".join(f"[{i}] {t.parent.name}" for i, t in enumerate(trees)))
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd) if args.run else 0


if __name__ == "__main__":
    sys.exit(main())
