# Question: Does every Hopper forward variant compile, and agree with the portable kernel, on a cc 9.0 GPU?
"""Quick check of the Hopper forward kernel on a cc 9.0 GPU: compile every variant (timed), then
one FA-shape problem per head dim through the Hopper and the portable kernel: their max difference
and TFLOP/s (CUDA events, median of 10 after warm-up). Exit status 1 on a mismatch or NaN.

    PYTHONPATH=. python lab/sm90_smoke.py [--no-compile]
"""
import math
import sys
import time

import cupy as cp
import ml_dtypes
import numpy as np

from cupyflash.gpu import compile as gpu_compile, fwd as gpu_fwd, plan_fwd_sm90
from cupyflash._bench import time_ms
from cupyflash._options import Options


def main():
    if "--no-compile" not in sys.argv:
        t0 = time.perf_counter()
        gpu_compile.precompile(plan_fwd_sm90.variants(), 16)
        print(f"compiled {len(plan_fwd_sm90.variants())} Hopper variants in "
              f"{time.perf_counter() - t0:.1f} s (16 processes)", flush=True)
    ok = True
    for d, causal in ((128, False), (128, True), (64, False), (256, False)):
        s = 4096
        b, h = 16384 // s, 2048 // d
        q, k, v = (cp.random.standard_normal((b, s, h, d), dtype=cp.float32).astype(ml_dtypes.bfloat16)
                   for _ in range(3))
        opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
        res = {}
        for kernel in ("sm90", "portable"):
            out = cp.full(q.shape, cp.nan, cp.float32).astype(q.dtype)
            lse = cp.full((b, h, s), cp.nan, cp.float32)
            t0 = time.perf_counter()
            name = gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kernel)
            cp.cuda.Device().synchronize()
            first = time.perf_counter() - t0
            ms = time_ms(lambda: gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kernel), rep=10)
            tf = 4 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9
            res[kernel] = (out.astype(cp.float32), lse)
            print(f"d{d} causal={causal} {kernel:8s} {name:40s} {tf:7.1f} TFLOP/s "
                  f"(first call {first:.2f} s)", flush=True)
        diff = float(cp.abs(res["sm90"][0] - res["portable"][0]).max())
        dl = float(cp.abs(res["sm90"][1] - res["portable"][1]).max())
        nan = bool(cp.isnan(res["sm90"][0]).any() or cp.isnan(res["sm90"][1]).any())
        good = diff < 2e-2 and dl < 1e-3 and not nan
        ok &= good
        print(f"   max |sm90 - portable|: out {diff:.2e}, lse {dl:.2e}, NaN {nan} -> "
              f"{'ok' if good else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
