# Question: Do four DMMA m8n8k4 products on the float32 kernels' m16n8k8 fragments give A Bᵀ, and how fast are m8n8k4 and sm_90's m16n8k8 .f64?
"""Checks the layout claim behind the float64 kernels (common.cuh mma_k8<f64_t>): an m16n8k8
product in double is four mma.sync m8n8k4 .f64 products on the same per-lane registers as the
tf32 m16n8k8 fragments. Integer inputs (every product and sum exact in float64) must give
A Bᵀ bit for bit; random normal inputs must be within a few float64 ulps of A Bᵀ computed in
numpy.longdouble. Both k orders (lab/probe_dmma.cu); on sm_90 also the single m16n8k8 .f64
instruction on the same fragments. Then the register-only DMMA rate of both forms (TFLOP/s).
Prints one line per case and exits 1 on a mismatch.

    python lab/probe_dmma.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash.gpu import compile as gpu_compile  # noqa: E402


def main() -> int:
    src = (Path(__file__).resolve().parent / "probe_dmma.cu").read_text()
    names = ["probe_dmma<0>", "probe_dmma<1>"]
    mod = cp.RawModule(code=src, options=gpu_compile.base_options(),
                       name_expressions=names)
    rng = np.random.default_rng()
    bad = 0
    for order, name in enumerate(names):
        fn = mod.get_function(name)
        for kind in ("integers", "normal"):
            for _ in range(20):
                if kind == "integers":
                    a = rng.integers(-1000, 1000, (16, 8)).astype(np.float64)
                    b = rng.integers(-1000, 1000, (8, 8)).astype(np.float64)
                else:
                    a = rng.standard_normal((16, 8))
                    b = rng.standard_normal((8, 8))
                c = cp.full((16, 8), cp.nan)
                fn((1,), (32,), (cp.asarray(a), cp.asarray(b), c))
                got = cp.asnumpy(c)
                exact = (a.astype(np.longdouble) @ b.T.astype(np.longdouble))
                err = float(np.abs(got - exact).max())
                scale = float((np.abs(a) @ np.abs(b).T).max())
                ok = err == 0.0 if kind == "integers" else err <= 8 * 2.0**-53 * scale
                if not ok:
                    bad += 1
                    print(f"MISMATCH order {order} {kind}: max err {err:.3e} (scale {scale:.3e})")
                    break
            else:
                print(f"order {order} ({'2t, 2t+1' if order else 't, t+4'}) {kind}: 20 / 20 match"
                      + ("" if kind == "integers" else f" (last max err {err:.2e} of {scale:.2e})"))
    cc = int(cp.cuda.Device().compute_capability)
    rate_names = ["dmma_rate<0>"] + (["dmma_rate<1>"] if cc >= 90 else [])
    mod2 = cp.RawModule(code=src, options=gpu_compile.base_options(),
                        name_expressions=["probe_m16n8k8"] + rate_names)
    if cc >= 90:   # sm_90's m16n8k8 .f64 on the same fragments (ORDER 1)
        fn = mod2.get_function("probe_m16n8k8")
        a, b = rng.standard_normal((16, 8)), rng.standard_normal((8, 8))
        c = cp.full((16, 8), cp.nan)
        fn((1,), (32,), (cp.asarray(a), cp.asarray(b), c))
        err = float(np.abs(cp.asnumpy(c) - a.astype(np.longdouble) @ b.T.astype(np.longdouble)).max())
        ok = err <= 8 * 2.0**-53 * float((np.abs(a) @ np.abs(b).T).max())
        bad += not ok
        print(f"m16n8k8 .f64 (sm_90) on the same fragments: {'match' if ok else 'MISMATCH'} "
              f"(max err {err:.2e})")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    iters, warps = 2000, 8
    for name in rate_names:
        fn = mod2.get_function(name)
        out = cp.empty(sms * 4 * warps * 32)
        args = (out, np.int32(iters))
        fn((sms * 4,), (warps * 32,), args)   # warm-up
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record()
        fn((sms * 4,), (warps * 32,), args)
        t1.record()
        t1.synchronize()
        ms = cp.cuda.get_elapsed_time(t0, t1)
        flop = sms * 4 * warps * iters * 8 * 2048.0
        what = "4 x m8n8k4" if name.endswith("<0>") else "1 x m16n8k8"
        print(f"{what:12s} register-only rate: {flop / ms / 1e9:6.1f} TFLOP/s "
              f"({sms} SMs, 4 blocks x {warps} warps each)")
    print("probe_dmma:", "OK" if bad == 0 else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
