"""Host overhead per call with warm caches: the public API and the launcher beneath it.

``PYTHONPATH=. python benchmarks/overhead.py [--profile]``: many small calls, one synchronize;
the problem is tiny so the GPU never limits the rate. ``--profile`` prints where the API's host
time goes (cProfile, top 15 by own time).
"""
import argparse
import cProfile
import math
import pstats
import time

import cupy as cp
import ml_dtypes
import numpy as np

import cupyflash as cf
from cupyflash import _gpu
from cupyflash._options import Options

N = 3000


def per_call_us(fn, n=N):
    for _ in range(50):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((1, 128, 4, 64), np.float32)).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    out, lse = cp.empty_like(q), cp.empty((1, 4, 128), cp.float32)
    opts = Options(scale=1 / math.sqrt(64))
    api = lambda: cf.attention(q, k, v)                                    # noqa: E731
    api_causal = lambda: cf.attention(q, k, v, causal=True, return_lse=True)  # noqa: E731
    launcher = lambda: _gpu.forward(q, k, v, out, lse, opts)              # noqa: E731
    print(f"host overhead per call (1x128x4x64 bf16, {N} calls, one sync):")
    print(f"  cupyflash.attention(q, k, v)                         {per_call_us(api):6.1f} us")
    print(f"  cupyflash.attention(q, k, v, causal, return_lse)     {per_call_us(api_causal):6.1f} us")
    print(f"  _gpu.forward (launcher, preallocated out / lse)      {per_call_us(launcher):6.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(N):
            api()
        cp.cuda.Device().synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
