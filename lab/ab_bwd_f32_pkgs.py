# Question: Is one whole package tree's float32 Hopper backward (launch sequence included) faster than another's?
"""A/B timing of the whole float32 Hopper backward (launch sequence included: helper kernels,
allocations) of several cupyflash package trees in one process, interleaved round by round, with
SDPA's memory-efficient float32 backward in the same rotation (--memeff). Unlike ab_bwd_f32.py,
which swaps only kernels_cu/ sources under this tree's launcher, each tree here runs its own
Python (cupyflash/ loaded under an alias, with its own kernels_cu/, caches and work-tile counter),
so changes to the launch sequence are measured too.

    python lab/ab_bwd_f32_pkgs.py --pkgs /path/to/main .carry/f32bwd-short \\
        --seqlens 1024 2048 4096 --causal both --memeff --rounds 3

Shapes as ab_bwd_f32.py (16k tokens, 32 heads of 64, bhsd storage as bshd views); inputs, out and
lse from the first tree's forward, shared by every tree. Per cell, before timing: each tree's dq,
dk, dv against the first tree's (NaN-poisoned outputs; "bits" = dk and dv bit-identical, then the
largest |difference| / max |first tree's| of dq, dk, dv: dQ is added with float atomics, so its
bits may differ between runs). Timing: CUDA events, warm-up, the median of --rep calls per tree and
round, then the median over rounds (TFLOP/s, counted FLOPs).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))   # benchmarks.peers (--memeff)

import cupy as cp  # noqa: E402

from ab_timing import interleaved_tflops, tflops_columns  # noqa: E402


def load_package(root: Path, alias: str):
    """The cupyflash package under ``root`` imported as ``alias`` (its submodules as alias.*)."""
    pkg = root / "cupyflash"
    spec = importlib.util.spec_from_file_location(alias, pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    sub = {n: importlib.import_module(f"{alias}.{n}") for n in ("_bench", "_gpu", "_gpu_bwd",
                                                                "_modules", "_options")}
    assert Path(sub["_modules"].kernels_dir()).resolve().parent == root.resolve(), root
    return sub


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pkgs", nargs="+", required=True,
                    help="tree roots, each holding cupyflash/ and kernels_cu/")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=10, help="timed calls per tree and round")
    ap.add_argument("--memeff", action="store_true", help="SDPA memory-efficient peer")
    args = ap.parse_args(argv)
    roots = [Path(p).resolve() for p in args.pkgs]
    pkgs = [load_package(r, f"cupyflash_ab{i}") for i, r in enumerate(roots)]
    bench0 = pkgs[0]["_bench"]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    d = 64
    print(f"# {bench0.device_line()}; trees: " + ", ".join(f"[{i}] {r}" for i, r in enumerate(roots)))
    print(f"{'seqlen':>6} {'causal':>6} | " + " ".join(f"{f'[{i}]':>7}" for i in range(len(pkgs)))
          + f" {'memeff':>7} | " + " ".join(f"{f'[{i}]/[0]':>7}" for i in range(1, len(pkgs)))
          + f" {'last/me':>7}  per tree: bits, max |diff| / max |ref| of dq, dk, dv vs [0]")
    cp.random.seed(0)
    for s in args.seqlens:
        for causal in causals:
            b, h = bench0.TOKENS // s, bench0.HIDDEN // d
            shape = (b, h, s, d)
            bshd = lambda x: x.transpose(0, 2, 1, 3)   # noqa: E731
            q, k, v, dout = (bshd(cp.random.standard_normal(shape, dtype=cp.float32)) for _ in range(4))
            out, lse = bshd(cp.empty(shape, cp.float32)), cp.empty((b, h, s), cp.float32)
            mk_opts = lambda P: P["_options"].Options(scale=1 / math.sqrt(d),  # noqa: E731
                                                      window_right=0 if causal else -1)
            pkgs[0]["_gpu"].forward(q, k, v, out, lse, mk_opts(pkgs[0]))
            g = [bshd(cp.empty(shape, cp.float32)) for _ in range(3)]
            calls = []
            for P in pkgs:
                opts = mk_opts(P)
                calls.append(lambda P=P, opts=opts: P["_gpu_bwd"].backward(
                    dout, q, k, v, out, lse, *g, opts, kernel="sm90"))
            # ---- every tree's gradients against the first tree's
            ref, notes, names = None, [], []
            for call in calls:
                for x in g:
                    x.fill(math.nan)
                names.append(call())
                got = [x.copy() for x in g]
                if ref is None:
                    ref = got
                bits = all(bool(cp.array_equal(a, r)) for a, r in zip(got[1:], ref[1:]))
                rel = [float(cp.abs(a - r).max() / cp.abs(r).max()) for a, r in zip(got, ref)]
                notes.append(("yes" if bits else "NO") + " " + "/".join(f"{x:.1e}" for x in rel))
            me = None
            if args.memeff:
                from benchmarks import peers
                me = peers.try_peer("memeff", q, k, v, causal, "bwd")
            # ---- interleaved timing
            tf, tme = interleaved_tflops(calls, me, bench0.flops(b, h, s, s, d, causal, "bwd"),
                                         args.rounds, args.rep, bench0.time_ms)
            print(f"{s:>6} {'yes' if causal else 'no':>6} | " + tflops_columns(tf, tme)
                  + "  " + "; ".join(notes)
                  + ("" if len(set(names)) == 1 else f"  kernels {names}"), flush=True)
            del q, k, v, dout, out, lse, g, me, calls, ref
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
