# Question: Is one kernels_cu/ tree's float32 Hopper backward faster than another's under the same launcher?
"""A/B timing of the float32 Hopper backward (kernels_cu/hopper/bwd_f32.cu) built from several
kernels_cu/ directories in one process (this tree's launcher), interleaved round by round so that
clock drift hits every tree alike; SDPA's memory-efficient float32 backward in the same rotation
(--memeff). Each cell first compares every tree's dq, dk, dv with the first tree's (norm-wise
relative difference: dQ is added with float atomics, so bits may differ between runs).

    python lab/ab_bwd_f32.py --trees /path/to/main/kernels_cu kernels_cu \\
        --seqlens 1024 4096 --causal both --memeff

Every tree's kernel is launched with the device's largest opt-in shared memory (the kernel checks
only that it got at least its Layout's bytes), so candidate trees whose layout differs from this
tree's Python mirror run too. Shapes as lab/bench_f32_bwd.py (16k tokens, hidden 2048,
hd 64 or --head-dim 128, bhsd storage). Prints per cell the median TFLOP/s of each tree over
--rounds rounds and each tree's ratio to the first.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
from cupyflash.gpu import compile as gpu_compile, plan_bwd_sm90_f32  # noqa: E402
from cupyflash._options import Options  # noqa: E402

from ab_fwd_kernels import kernels_tree  # noqa: E402
from ab_timing import interleaved_tflops, tflops_columns  # noqa: E402


def functions_from(tree: Path, variant, tag: int, smem: int):
    """(main, *helpers) of ``variant`` compiled from the sources in ``tree``."""
    with kernels_tree(tree):
        src, opts, names = gpu_compile.program([variant])
        mod = cp.RawModule(code=src, options=tuple(opts) + (f"-DCUPYFLASH_AB_TREE={tag}",),
                           name_expressions=names)
        main = mod.get_function(variant.name_expression)
        main.max_dynamic_shared_size_bytes = smem
        return (main,) + tuple(mod.get_function(n) for n in variant.helper_expressions)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", required=True, help="kernels_cu directories")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=10, help="timed calls per tree and round")
    ap.add_argument("--memeff", action="store_true", help="SDPA memory-efficient peer")
    ap.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    args = ap.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    dev_id = cp.cuda.Device().id
    smem = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    plan_bwd_sm90_f32.smem_bytes = lambda d: smem   # every tree's launch: the whole opt-in shared memory
    d = args.head_dim
    print(f"# {_bench.device_line()}; trees: " + ", ".join(f"[{i}] {t}" for i, t in enumerate(trees)))
    print(f"{'seqlen':>6} {'causal':>6} | " + " ".join(f"{f'[{i}]':>7}" for i in range(len(trees)))
          + f" {'memeff':>7} | " + " ".join(f"{f'[{i}]/[0]':>7}" for i in range(1, len(trees)))
          + f" {'last/me':>7}  max rel diff to [0]")
    for s in args.seqlens:
        for causal in causals:
            b, h = _bench.TOKENS // s, _bench.HIDDEN // d
            shape = (b, h, s, d)
            bshd = lambda x: x.transpose(0, 2, 1, 3)   # noqa: E731
            q, k, v, dout = (bshd(cp.random.standard_normal(shape, dtype=cp.float32)) for _ in range(4))
            out, lse = bshd(cp.empty(shape, cp.float32)), cp.empty((b, h, s), cp.float32)
            opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
            gpu_fwd.forward(q, k, v, out, lse, opts)
            variant = plan_bwd_sm90_f32.Sm90F32BwdVariant(d, causal)
            key = (dev_id, variant, ())   # compile.get_functions's cache key
            fns = [functions_from(t, variant, i, smem) for i, t in enumerate(trees)]
            g = [bshd(cp.empty(shape, cp.float32)) for _ in range(3)]
            call = lambda: gpu_bwd.backward(dout, q, k, v, out, lse, *g, opts, kernel="sm90")  # noqa: E731
            # ---- every tree's gradients against the first tree's
            ref, diff = None, []
            for fn in fns:
                gpu_compile._functions[key] = fn
                for x in g:
                    x.fill(math.nan)
                call()
                got = [x.copy() for x in g]
                if ref is None:
                    ref = got
                diff.append(max(float(cp.linalg.norm(a - r) / cp.linalg.norm(r)) for a, r in zip(got, ref)))
            # ---- interleaved timing
            me = None
            if args.memeff:
                from benchmarks import peers
                me = peers.try_peer("memeff", q, k, v, causal, "bwd")
            def with_tree(fn):   # the launch with tree fn's kernel in the function cache
                def run():
                    gpu_compile._functions[key] = fn
                    call()
                return run

            tf, tme = interleaved_tflops([with_tree(fn) for fn in fns], me,
                                         _bench.flops(b, h, s, s, d, causal, "bwd"),
                                         args.rounds, args.rep, _bench.time_ms)
            print(f"{s:>6} {'yes' if causal else 'no':>6} | " + tflops_columns(tf, tme)
                  + "  " + " ".join(f"{x:.1e}" for x in diff), flush=True)
            gpu_compile._functions.pop(key, None)
            del q, k, v, dout, out, lse, g, me
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
