# Question: Which portable backward kernel and tile (flash_bwd's 16-key slabs, flash_bwd_2d's 2-D warp tiles) is fastest per FA shape, beside FlashAttention-2 (SDPA flash)?
"""A/B timing of the portable 16-bit backward (kernels_cu/portable/bwd.cu) forced through the
launcher (gpu.bwd.backward(kernel=variant): pre, main and dq kernels and the pool allocations, as
cupyflash._bench.portable_peer times it), candidates interleaved round by round with PyTorch
SDPA's flash backend (FlashAttention-2) so clock drift hits each alike (lab/ab_timing.py).
FA benchmark shapes: bf16, batch·seqlen = 16k tokens, hidden 2048. Each cell first checks every
candidate's dq, dk, dv against the first candidate's (norm-wise relative difference; dQ is added
with float atomics, so bits differ between runs).

    python lab/ab_bwd_portable.py [--hd 64 128] [--seqlens 1024 4096 16384] [--causal both]
        [--cands64 "slab;128,8,4,4,4,2;..."] [--cands128 ...] [--rounds 3] [--rep 5]
    python lab/ab_bwd_portable.py --precompile [--tests]   # fill CuPy's disk cache, 16 processes
    python lab/ab_bwd_portable.py --once 128 4096 0        # one launch per candidate (under ncu)

A candidate is "slab" (flash_bwd, the planner's slab tile), "2d" (the planner's flash_bwd_2d
tile) or "BM,NW,WMS,WNKV,WMQ,NBUF[,PAIR]" (a flash_bwd_2d tile: plan_bwd.BwdVariant's fields;
PAIR 1: S with dP and dV with dK in one k loop each).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cupyflash.gpu import plan_bwd  # noqa: E402
from cupyflash.gpu.tuning import tuning  # noqa: E402

# the next comparison: flash_bwd, the planner's flash_bwd_2d, and its PAIR forms (the first A/B,
# docs/backward.md "Speed", timed 64,8,2,4,2,2 / 64,4,2,2,2,2 / 128,8,4,4,4,1 at hd 64 and
# 32,4,2,2,2,2 / 64,4,2,2,2,1 / 64,8,2,4,2,1 at hd 128 beside the defaults)
CANDS = {
    64: "slab;2d;128,8,4,4,4,2,1;64,8,2,4,2,2,1",
    128: "slab;2d;64,8,2,4,2,2,1",
}
# tests/gpu/test_gpu_backward.py::test_flash_bwd_2d_other_tiles's forced tiles
OTHER_TILES = ((64, "128,8,4,4,4,2,1"), (128, "64,8,2,4,2,2,1"), (64, "64,4,2,2,2,2,0"),
               (128, "64,8,2,4,2,1,0"), (128, "32,4,2,2,2,2,0"))


def variant_for(spec: str, d: int, causal: bool, smem: int = 227 * 1024):
    """The BwdVariant of candidate ``spec`` for bf16 at head dim ``d``."""
    with tuning(portable_bwd_2d=spec != "slab"):
        auto = plan_bwd.plan_backward("bfloat16", 1, 1024, 1024, 8, 8, d, d, scale=1.0,
                                      window_right=0 if causal else -1, smem_optin=smem).variant
    if spec in ("slab", "2d"):
        return auto
    bm, nw, wms, wnkv, wmq, nbuf, *pair = (int(x) for x in spec.split(","))
    v = auto.replace(bm=bm, nw=nw, wd=1, nbuf=nbuf, wms=wms, wnkv=wnkv, wmq=wmq,
                     pair=bool(pair and pair[0]))
    v.check_2d()
    return v


def label(v) -> str:
    return (f"{v.bm}x{v.bn}t{v.wms}{v.wnkv}{v.wmq}{'p' if v.pair else ''}b{v.nbuf}" if v.wms
            else f"slab{v.bm}x{v.bn}")


def test_variants(smem: int):
    """What the GPU backward tests of the device run compile (tests/gpu/test_gpu_backward.py
    without head dims above 128, float32 long sums and TF32): the portable backward's variants
    of float16 / bfloat16 / float32 at buckets <= 128, the forced flash_bwd_2d tiles and the
    forwards those tests call."""
    from cupyflash.gpu import plan_fwd, plan_fwd_sm90
    small = lambda v: v.d <= 128 and not getattr(v, "general", False)   # noqa: E731
    out = [v for v in plan_bwd.variants(smem)
           if small(v) and (v.wms or v.elem == "f32x3_t")]
    out += [v for v in plan_fwd.variants(smem)
            if small(v) and v.elem in ("f16_t", "bf16_t", "f32x3_t")]
    out += [v for v in plan_fwd_sm90.variants() if v.elem in ("f16_t", "bf16_t") and v.d <= 128
            and "varlen" not in v.name and "bias" not in v.name]
    out += [v for v in plan_fwd_sm90.f32_variants() if v.elem == "f32x3_t"]
    for d, spec in OTHER_TILES:
        for elem in ("f16_t", "bf16_t"):
            v = variant_for(spec, d, True, smem).replace(elem=elem)
            out += [v, v.replace(score_mod=True)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hd", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--cands64", default=CANDS[64])
    ap.add_argument("--cands128", default=CANDS[128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=5, help="timed calls per candidate and round")
    ap.add_argument("--no-peer", action="store_true", help="without SDPA's flash backend")
    ap.add_argument("--precompile", action="store_true", help="compile the candidates and exit")
    ap.add_argument("--tests", action="store_true", help="--precompile: the test variants too")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--once", nargs=3, type=int, metavar=("HD", "SEQLEN", "CAUSAL"),
                    help="one warm-up and one call per candidate of this cell (for ncu)")
    args = ap.parse_args(argv)
    cands = {64: args.cands64.split(";"), 128: args.cands128.split(";")}
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]

    import cupy as cp
    smem = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    if args.precompile:
        from cupyflash.gpu import compile as gpu_compile
        vs = {variant_for(c, d, causal, smem) for d in args.hd for c in cands[d] for causal in (False, True)}
        if args.tests:
            vs |= set(test_variants(smem))
        done = gpu_compile.precompile(sorted(vs, key=lambda v: v.name), args.workers)
        print(f"precompiled {len(done)} variants")
        return 0

    import ml_dtypes
    import numpy as np
    from cupyflash import _bench
    from cupyflash._options import Options
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    from ab_timing import interleaved_tflops
    peer_factory = None
    if not args.no_peer:
        try:
            from benchmarks.peers import PEERS, _torch
            if _torch() is not None:
                peer_factory = PEERS["flash"]
        except ImportError:
            pass

    cells = [(d, s, c) for d in args.hd for s in args.seqlens for c in causals]
    if args.once:
        cells = [(args.once[0], args.once[1], bool(args.once[2]))]
    print(f"# {_bench.device_line()}; bf16 backward, {_bench.TOKENS} tokens, hidden {_bench.HIDDEN}; "
          f"TFLOP/s (2.5 x 4·b·h·s²·d, /2 causal); medians of {args.rounds} rounds x {args.rep} calls")
    rng = np.random.default_rng(0)
    last_d = None
    for d, s, causal in cells:
        b, h = max(1, _bench.TOKENS // s), max(1, _bench.HIDDEN // d)
        q, k, v, dout = (cp.asarray(rng.standard_normal((b, s, h, d), np.float32)).astype(ml_dtypes.bfloat16)
                         for _ in range(4))
        out, lse = cp.empty_like(q), cp.empty((b, h, s), cp.float32)
        opts = Options(scale=1.0 / math.sqrt(d), window_right=0 if causal else -1)
        gpu_fwd.forward(q, k, v, out, lse, opts)
        vs = [variant_for(c, d, causal, smem) for c in cands[d]]
        grads = [[cp.empty_like(x) for x in (q, k, v)] for _ in vs]
        calls = [(lambda vv=vv, gr=gr: gpu_bwd.backward(dout, q, k, v, out, lse, *gr, opts, kernel=vv))
                 for vv, gr in zip(vs, grads)]
        if args.once:   # one launch per candidate, in order (ncu --launch-count = candidates)
            for c in calls:
                c()
            cp.cuda.Device().synchronize()
            print("ran " + " ".join(label(vv) for vv in vs))
            return 0
        for c in calls:
            c()
        cp.cuda.Device().synchronize()
        ref = [x.astype(cp.float32) for x in grads[0]]
        diffs = []
        for gr in grads[1:]:
            diffs.append(max(float(cp.linalg.norm(x.astype(cp.float32) - r) / max(float(cp.linalg.norm(r)), 1e-30))
                             for x, r in zip(gr, ref)))
        peer = None
        if peer_factory is not None:
            try:
                peer = peer_factory(q, k, v, causal, "bwd")
            except Exception as e:  # noqa: BLE001
                print(f"  flash peer refused: {type(e).__name__}: {str(e)[:80]}")
        fl = _bench.flops(b, h, s, s, d, causal, "bwd")
        tf, tpeer = interleaved_tflops(calls, peer, fl, args.rounds, args.rep, _bench.time_ms)
        if d != last_d:
            last_d = d
            print(f"{'hd':>3} {'seqlen':>6} {'causal':>6} | " + " ".join(f"{label(vv):>15}" for vv in vs)
                  + f" {'FA2':>6} | " + " ".join(f"{'c' + str(i) + '/FA2':>7}" for i in range(len(vs)))
                  + " | max rel diff to c0")
        print(f"{d:3d} {s:6d} {str(causal):>6} | " + " ".join(f"{x:15.1f}" for x in tf)
              + f" {tpeer:6.1f} | " + " ".join(f"{x / tpeer:7.3f}" for x in tf)
              + " | " + " ".join(f"{x:.1e}" for x in diffs), flush=True)
        del q, k, v, dout, out, lse, grads, calls, peer
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
