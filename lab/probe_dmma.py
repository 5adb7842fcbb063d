# Question: do four DMMA m8n8k4 products on the float32 kernels' m16n8k8 fragments give A Bᵀ?
"""Checks the layout claim behind the float64 kernels (common.cuh mma_k8<f64_t>): an m16n8k8
product in double is four mma.sync m8n8k4 .f64 products on the same per-lane registers as the
tf32 m16n8k8 fragments. Integer inputs (every product and sum exact in float64) must give
A Bᵀ bit for bit; random normal inputs must be within a few float64 ulps of A Bᵀ computed in
numpy.longdouble. Both k orders (lab/probe_dmma.cu). Prints one line per case and exits 1 on a
mismatch.

    python lab/probe_dmma.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash.gpu import compile as gpu_compile  # noqa: E402


def include_dirs():
    """-I for every kernels_cu/ folder holding common.cuh (flat or split into parts)."""
    root = gpu_compile.kernels_dir()
    return tuple(f"-I{p.parent}" for p in sorted(root.rglob("common.cuh")))


def main() -> int:
    src = (Path(__file__).resolve().parent / "probe_dmma.cu").read_text()
    names = ["probe_dmma<0>", "probe_dmma<1>"]
    mod = cp.RawModule(code=src, options=gpu_compile.base_options() + include_dirs(),
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
    print("probe_dmma:", "OK" if bad == 0 else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
