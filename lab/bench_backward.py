# Question: How fast is the bf16 backward beside SDPA's flash and cuDNN backends, and with forced tiles?
"""Backward speed: cupyflash GPU backward beside PyTorch SDPA (flash and cuDNN backends).

FlashAttention's benchmark shapes: bf16, batch·seqlen = 16k tokens, hidden 2048, head dims 64
and 128 (32 / 16 heads), seqlen 512..16k, causal and not. FLOPs: backward = 2.5 x forward,
forward = 4·b·h·s_q·s_k·d (halved for causal). CUDA events around each call, warm-up first,
median of the repeats. PyTorch is a benchmark peer only (imported here, never by cupyflash).

    python lab/bench_backward.py [--seqlens 512,1024,...] [--hdims 64,128] [--reps 10]
        [--tiles BM,NW,WD,NBUF[;...]]  (tuning: force flash_bwd tiles, one extra column each)
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd, plan_bwd
from cupyflash._options import Options  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _time_ms(fn, warmup, reps):
    """Median milliseconds between CUDA events (cupyflash._bench.time_ms); PyTorch runs on the
    legacy default stream, CuPy's current stream here, so its peers are timed the same way."""
    return _bench.time_ms(fn, warmup, reps)


def bench_ours(b, s, h, d, causal, warmup, reps, deterministic=False, tiles=None):
    rnd = lambda: cp.random.standard_normal((b, s, h, d), dtype=cp.float32).astype(BF16)  # noqa: E731
    q, k, v, dout = rnd(), rnd(), rnd(), rnd()
    out = cp.empty_like(q)
    lse = cp.empty((b, h, s), cp.float32)
    opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1,
                   deterministic=deterministic)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
    kernel = None
    if tiles is not None:   # same element type / bucket / flags as the planner's, other tiles
        auto = plan_bwd.plan_backward("bfloat16", b, s, s, h, h, d, d, scale=1.0,
                                      window_right=0 if causal else -1).variant
        kernel = auto.replace(bm=tiles[0], nw=tiles[1], wd=tiles[2], nbuf=tiles[3])
    name = []
    fn = lambda: name.append(gpu_bwd.backward(dout, q, k, v, out, lse, dq, dk, dv, opts,  # noqa: E731
                                               kernel=kernel))
    ms = _time_ms(fn, warmup, reps)
    return ms, name[-1]


def bench_torch(torch, backend, b, s, h, d, causal, warmup, reps):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = (mk().requires_grad_() for _ in range(3))
    dout = mk()
    with sdpa_kernel(be):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        return _time_ms(fn, warmup, reps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--tiles", default="", help="extra flash_bwd tile sets BM,NW,WD,NBUF;...")
    args = ap.parse_args(argv)
    torch = None
    if not args.no_torch:
        try:
            import torch  # noqa: F811
        except ImportError:
            torch = None
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; "
          f"bf16 backward, 16k tokens, hidden 2048; TFLOP/s = 2.5 x 4·b·h·s²·d (/2 causal) / time")
    hdr = f"{'hd':>4} {'seqlen':>6} {'causal':>6} | {'ours ms':>8} {'TF/s':>6} | " \
          f"{'flash ms':>8} {'TF/s':>6} | {'cudnn ms':>8} {'TF/s':>6} | {'vs flash':>8} | variant"
    rows = []
    for d in map(int, args.hdims.split(",")):
        h = 2048 // d
        for s in map(int, args.seqlens.split(",")):
            b = max(1, 16384 // s)
            for causal in (False, True):
                fl = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                ms, name = bench_ours(b, s, h, d, causal, args.warmup, args.reps)
                tf = lambda t: fl / t / 1e9 if t == t else float("nan")  # noqa: E731
                fms = cms = float("nan")
                if torch is not None:
                    try:
                        fms = bench_torch(torch, "flash", b, s, h, d, causal, args.warmup, args.reps)
                    except Exception as e:  # noqa: BLE001
                        print(f"  flash backend failed: {e}")
                    try:
                        cms = bench_torch(torch, "cudnn", b, s, h, d, causal, args.warmup, args.reps)
                    except Exception as e:  # noqa: BLE001
                        print(f"  cudnn backend failed: {e}")
                    torch.cuda.empty_cache()
                line = (f"{d:4d} {s:6d} {str(causal):>6} | {ms:8.3f} {tf(ms):6.1f} | "
                        f"{fms:8.3f} {tf(fms):6.1f} | {cms:8.3f} {tf(cms):6.1f} | "
                        f"{fms / ms:7.2f}x | {name}")
                for ts in filter(None, args.tiles.split(";")):
                    t4 = tuple(int(x) for x in ts.split(","))
                    try:
                        tms, tname = bench_ours(b, s, h, d, causal, args.warmup, args.reps,
                                                tiles=t4)
                        line += f" | {tname} {tms:.3f} ms {tf(tms):.1f}"
                    except Exception as e:  # noqa: BLE001
                        line += f" | {ts}: {type(e).__name__}"
                rows.append(line)
                print(line, flush=True)
                cp.get_default_memory_pool().free_all_blocks()
    print("\n" + hdr)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
