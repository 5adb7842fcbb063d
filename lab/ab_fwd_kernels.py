# Question: Is one kernels_cu/ tree's Hopper forward faster than another's, with bit-identical results, in the same process?
"""A/B timing of the Hopper forward (float32 or bfloat16: --dtype) built from several kernels_cu/
directories (one planner and launcher, this tree's), interleaved round by round in one process so
that clock drift hits every tree alike; a PyTorch SDPA peer in the same rotation (--peer memeff,
cudnn or flash; --memeff is --peer memeff). Each cell
first checks every tree's out and lse against the first tree's, bit for bit (kernel changes
that only skip masked work or reorder work tiles must give identical results).

    python lab/ab_fwd_kernels.py --trees /path/to/main/kernels_cu kernels_cu \\
        --head-dims 128 --seqlens 1024 2048 4096 --causal both --memeff
    python lab/ab_fwd_kernels.py --trees A B --dtype bfloat16 --bias --causal no

--bias adds an additive bias (1, h, s, s) in q's dtype (issue 6's benchmark bias; no peer then:
lab/bench_bias_varlen.py has SDPA memeff with the same bias).

Shapes as lab/bench_f32.py (16k tokens, hidden 2048, bhsd storage). Prints per cell the
median TFLOP/s of each tree over --rounds rounds and each tree's ratio to the first.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import compile as gpu_compile, fwd as gpu_fwd, fwd_portable, fwd_sm90
from cupyflash._options import Options  # noqa: E402

from ab_timing import interleaved_tflops, tflops_columns  # noqa: E402


@contextlib.contextmanager
def kernels_tree(tree: Path):
    """Within the block, gpu.compile reads kernel sources (and their hash) from ``tree``."""
    saved = gpu_compile.kernels_dir
    gpu_compile.kernels_dir = lambda: tree
    gpu_compile._source.cache_clear()
    gpu_compile.source_hash.cache_clear()
    try:
        yield
    finally:
        gpu_compile.kernels_dir = saved
        gpu_compile._source.cache_clear()
        gpu_compile.source_hash.cache_clear()


def compile_from(tree: Path, variant, dev_id: int, tag: int):
    """``variant`` compiled from the sources in ``tree`` (a kernels_cu/ directory)."""
    with kernels_tree(tree):
        fn = gpu_compile.get_function(variant, dev_id, (f"-DCUPYFLASH_AB_TREE={tag}",))
    return getattr(fn, "kernel", fn)


_REAL_LAUNCH = fwd_portable.launch_plan


class _Planned:
    """A bias call is planned per call (gpu_fwd._forward_general, no cached _Launch): its launches
    go through fwd_portable.launch_plan, which this stands in for with ``fn`` (set like _Launch.fn)."""

    def __init__(self, fn):
        self.fn = fn

        def launch(plan, prm, dev_id):
            self.fn(plan.grid, plan.block, (prm.reshape(1)[0],), shared_mem=plan.smem)
            return plan.variant.name
        fwd_portable.launch_plan = launch


def using(fn, q, k, v, out, opts):
    """The object whose ``fn`` the next forward(q, k, v, out, lse, opts, kernel="sm90") launches:
    the cached _Launch entry, or for a bias call the stand-in for fwd_portable.launch_plan."""
    if opts.bias is not None:
        return _Planned(fn)
    ent = gpu_fwd._launch_cache[gpu_fwd._key(q, k, v, out, opts, "sm90")]
    ent.fn = fn
    return ent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", required=True, help="kernels_cu directories")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=20, help="timed calls per tree and round")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--peer", choices=["memeff", "cudnn", "flash"], help="SDPA peer in the rotation")
    ap.add_argument("--memeff", action="store_true", help="the same as --peer memeff")
    ap.add_argument("--bias", action="store_true", help="a bias (1, h, s, s) in q's dtype")
    args = ap.parse_args(argv)
    peer = "memeff" if args.memeff else args.peer
    dtype = cp.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    trees = [Path(t).resolve() for t in args.trees]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    dev_id = cp.cuda.Device().id
    print(f"# {_bench.device_line()}; trees: " + ", ".join(f"[{i}] {t}" for i, t in enumerate(trees)))
    print(f"{'hd':>3} {'seqlen':>6} {'causal':>6} | " + " ".join(f"{f'[{i}]':>7}" for i in range(len(trees)))
          + f" {peer or 'peer':>7} | " + " ".join(f"{f'[{i}]/[0]':>7}" for i in range(1, len(trees)))
          + f" {'last/pr':>7}  identical  kernel")
    for d in args.head_dims:
        for s in args.seqlens:
            for causal in causals:
                b, h = _bench.TOKENS // s, _bench.HIDDEN // d
                q, k, v = (cp.random.standard_normal((b, h, s, d), dtype=cp.float32).astype(dtype)
                           .transpose(0, 2, 1, 3) for _ in range(3))
                out = cp.empty((b, h, s, d), dtype).transpose(0, 2, 1, 3)
                lse = cp.empty((b, h, s), cp.float32)
                bias = None
                if args.bias:
                    bias = cp.random.standard_normal((1, h, s, s), dtype=cp.float32).astype(dtype)
                opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1, bias=bias,
                               bias_shape=None if bias is None else bias.shape)
                fwd_portable.launch_plan = _REAL_LAUNCH     # this cell's own variant, from this tree
                name = gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
                variant = fwd_sm90.variant_by_name(name)
                fns = [compile_from(t, variant, dev_id, i) for i, t in enumerate(trees)]
                ent = using(fns[0], q, k, v, out, opts)
                # ---- results of every tree against the first's, bit for bit
                ref = None
                same = []
                for fn in fns:
                    ent.fn = fn
                    out.fill(math.nan)
                    lse.fill(math.nan)
                    gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
                    got = (out.copy(), lse.copy())
                    if ref is None:
                        ref = got
                    same.append(bool(cp.array_equal(got[0], ref[0]) and cp.array_equal(got[1], ref[1])))
                    if not same[-1]:
                        print(f"  differs: max |out diff| {float(cp.abs(got[0] - ref[0]).max()):.3e}, "
                              f"max |lse diff| {float(cp.abs(got[1] - ref[1]).max()):.3e}")
                # ---- interleaved timing
                me = None
                if peer and bias is None:
                    from benchmarks import peers
                    me = peers.try_peer(peer, q, k, v, causal, "fwd")   # bshd views
                def with_tree(fn):   # the launch with tree fn's kernel in the cached entry
                    def call():
                        ent.fn = fn
                        gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
                    return call

                tf, tme = interleaved_tflops([with_tree(fn) for fn in fns], me,
                                             _bench.flops(b, h, s, s, d, causal, "fwd"),
                                             args.rounds, args.rep, _bench.time_ms)
                ent.fn = fns[-1]
                print(f"{d:>3} {s:>6} {'yes' if causal else 'no':>6} | " + tflops_columns(tf, tme)
                      + f"  {'yes' if all(same) else 'NO':>9}  {name}", flush=True)
                del q, k, v, out, lse, me, bias
                cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
