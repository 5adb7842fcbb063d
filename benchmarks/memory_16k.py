"""Device memory of one attention call at seqlen 16k: cupyflash vs the plain CuPy recipe.

``PYTHONPATH=. python benchmarks/memory_16k.py``. Measured as the growth of CuPy's memory pool
(bytes it holds, freed blocks included, so the peak of the call) after emptying it first.
"""
import cupy as cp
import ml_dtypes
import numpy as np

import cupyflash as cf
from cupyflash import _bench

pool = cp.get_default_memory_pool()
b, s, h, d = 1, 16384, 16, 128
rng = np.random.default_rng(0)
q, k, v = (cp.asarray(rng.standard_normal((b, s, h, d), np.float32)).astype(ml_dtypes.bfloat16)
           for _ in range(3))
print(f"q, k, v ({b}, {s}, {h}, {d}) bf16, {q.nbytes / 2**20:.0f} MiB each")
for name, make in (("cupyflash", lambda: (lambda: cf.attention(q, k, v))),
                   ("plain CuPy (fp16 copies)", lambda: _bench.cupy_peer(q, k, v, False, "fwd", max_bytes=1e12))):
    fn = make()
    fn()                                  # warm-up: compile, cuBLAS handles
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    out = fn()
    cp.cuda.Device().synchronize()
    extra = pool.total_bytes() - before
    del out
    ms = _bench.time_ms(fn, warmup=1, rep=5)
    print(f"{name:26s} peak extra {extra / 2**20:9.0f} MiB, {ms:8.2f} ms, "
          f"{_bench.flops(b, h, s, s, d, False, 'fwd') / ms / 1e9:6.1f} TFLOP/s")
    pool.free_all_blocks()
