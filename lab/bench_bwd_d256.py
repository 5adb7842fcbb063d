# Question: How fast is the Hopper head-dim-256 backward (split-head-dim consumers, TUNING.bwd_sm90_d256) beside cuDNN, FlashAttention-2 and the portable kernel, and does it agree with the portable kernel?
"""Head dim 256 backward: the Hopper kernel (flash_bwd_sm90<E, 256, ...>, switched on for the
run with TUNING.bwd_sm90_d256) beside PyTorch SDPA's cuDNN and flash backends and cupyflash's
portable kernel, on FlashAttention's benchmark shapes (bf16, batch x seqlen = 16k tokens,
hidden 2048: 8 heads), through cupyflash._bench (CUDA events, warm-up, medians; TFLOP/s with the
backward counted as 2.5 x the forward's FLOPs). Before timing, one call per (seqlen, causal)
compares the Hopper kernel's dq, dk, dv with the portable kernel's (max |difference| / max |value|).

    python lab/bench_bwd_d256.py [--seqlens 512 1024 ...] [--rep 20] [--rounds 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash._options import Options  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd  # noqa: E402
from cupyflash.gpu.tuning import tuning  # noqa: E402


def agreement(s: int, causal: bool) -> str:
    """Hopper vs portable gradients of one small-batch call at seqlen s."""
    rng = np.random.default_rng(s)
    q, k, v, do = (cp.asarray(rng.standard_normal((1, s, 2, 256), np.float32)).astype(_bench.DTYPES["bf16"])
                   for _ in range(4))
    opts = Options(scale=256 ** -0.5, window_left=-1, window_right=0 if causal else -1,
                   bottom_right=True)
    out, lse = cp.empty_like(q), cp.empty((1, 2, s), cp.float32)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    grads = {}
    for kernel in ("sm90", "portable"):
        g = [cp.full_like(x, np.nan) for x in (q, k, v)]
        grads[kernel] = (gpu_bwd.backward(do, q, k, v, out, lse, *g, opts, kernel=kernel), g)
    errs = []
    for a, b in zip(grads["sm90"][1], grads["portable"][1]):
        a, b = a.astype(cp.float32), b.astype(cp.float32)
        errs.append(float(cp.abs(a - b).max() / cp.abs(b).max()))
    return f"{grads['sm90'][0]} vs {grads['portable'][0]}: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"# {_bench.device_line()}")
    for s in args.seqlens[:3]:
        for causal in (False, True):
            print(f"# s {s} causal {causal}: {agreement(s, causal)}", flush=True)
    peers = _bench.load_peers(["benchmarks.peers"], skip=["cupy", "memeff"])
    with tuning(bwd_sm90_d256=True):
        for r in range(args.rounds):
            rows = _bench.sweep(["bf16"], [256], args.seqlens, [False, True], ["bwd"], peers,
                                rep=args.rep, progress=lambda m: print(m, file=sys.stderr, flush=True))
            print(f"# round {r + 1}")
            print(_bench.table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
