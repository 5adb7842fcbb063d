"""Host overhead per call with warm caches: the public API and the launcher beneath it.

``PYTHONPATH=. python benchmarks/overhead.py [--parts] [--profile]``: many small calls, one
synchronize; the problem is tiny (1x128x4x64 bf16) so the host, not the GPU, sets the rate.
Each line is the median over REPS runs of N calls: "host" is the time to issue the calls,
"+sync" includes waiting for the GPU at the end (when both are close the GPU kept up, when
"+sync" is much larger the GPU was the limit). ``--parts`` also times the pieces of one call
(allocation, device query, key, pointer writes, bare launches); ``--profile`` prints where the
API's host time goes (cProfile, top 15 by own time).
"""
import argparse
import cProfile
import math
import pstats
import statistics
import time

import cupy as cp
import ml_dtypes
import numpy as np

import cupyflash as cf
from cupyflash import api
from cupyflash.gpu import fwd as gpu_fwd
from cupyflash._options import Options

N = 3000
REPS = 5
SHAPE = (1, 128, 4, 64)


def per_call_us(fn, n=N, reps=REPS):
    """Median (host, host + final sync) microseconds per call over ``reps`` runs of ``n`` calls."""
    for _ in range(100):
        fn()
    cp.cuda.Device().synchronize()
    host, total = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        cp.cuda.Device().synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / n * 1e6)
        total.append((t2 - t0) / n * 1e6)
    return statistics.median(host), statistics.median(total)


def line(label, fn):
    host, total = per_call_us(fn)
    print(f"  {label:<58} {host:6.1f} us   (+sync {total:6.1f})")
    return host


def parts(q, k, v, out, lse, opts):
    """The pieces of one fast-path call, each timed alone."""
    print("\npieces of one call (same problem):")
    entry = gpu_fwd.cached_launch(q, k, v, out, opts)
    f32 = np.dtype(np.float32)
    dt = q.dtype
    lse_shape = lse.shape
    nbytes = out.nbytes
    lse_at = -(-nbytes // 256) * 256
    lse_bytes = lse.nbytes

    def one_block():  # out and lse carved from one pool block
        mem = cp.cuda.alloc(lse_at + lse_bytes)
        return (cp.ndarray(SHAPE, dt, memptr=mem), cp.ndarray(lse_shape, f32, memptr=mem + lse_at))

    record_args = (entry.arr[0],)   # the Params record as a numpy.void (the previous argument)
    line("cupy.empty(out) + cupy.empty(lse)",
         lambda: (cp.empty(SHAPE, dt), cp.empty(lse_shape, cp.float32)))
    line("cupy.ndarray(out) + cupy.ndarray(lse) (the fast path's)",
         lambda: (cp.ndarray(SHAPE, dt), cp.ndarray(lse_shape, f32)))
    line("one pool block, two ndarray(memptr=...) views", one_block)
    line("cupy.cuda.runtime.getDevice()", cp.cuda.runtime.getDevice)
    line("api._fast_key(...) + _FAST.get",
         lambda: api._FAST.get(api._fast_key(q, k, v, False, "bottom_right", None, None, None,
                                             "bshd", "auto", False)))
    line("_Launch.launch: pointer writes + launch (the fast path's)",
         lambda: entry.launch(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr))
    line("bare Function launch, args = CPointer to the record",
         lambda: entry.fn(entry.grid, entry.block, entry.args, shared_mem=entry.smem))
    line("bare Function launch, args = numpy.void record",
         lambda: entry.fn(entry.grid, entry.block, record_args, shared_mem=entry.smem))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", action="store_true", help="also time the pieces of one call")
    ap.add_argument("--profile", action="store_true", help="cProfile of the public API's calls")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal(SHAPE, np.float32)).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    qt, kt, vt = (cp.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    out, lse = cp.empty_like(q), cp.empty((1, 4, 128), cp.float32)
    opts = Options(scale=1 / math.sqrt(64))
    api_plain = lambda: cf.attention(q, k, v)                                      # noqa: E731
    api_causal = lambda: cf.attention(q, k, v, causal=True, return_lse=True)     # noqa: E731
    api_bhsd = lambda: cf.attention(qt, kt, vt, layout="bhsd")                    # noqa: E731
    launcher = lambda: gpu_fwd.forward(q, k, v, out, lse, opts)                     # noqa: E731
    print(f"host overhead per call (1x128x4x64 bf16, median of {REPS} x {N} calls, one sync each):")
    line("cupyflash.attention(q, k, v)", api_plain)
    line("cupyflash.attention(q, k, v, causal=True, return_lse=True)", api_causal)
    line("cupyflash.attention(q, k, v, layout='bhsd')", api_bhsd)
    line("gpu_fwd.forward (launcher, preallocated out / lse)", launcher)
    if hasattr(api, "_FAST"):  # (this script also runs against older trees, for "before")
        print(f"  fast-path entries: {len(api._FAST)}")
    if args.parts:
        parts(q, k, v, out, lse, opts)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(N):
            api_plain()
        cp.cuda.Device().synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
