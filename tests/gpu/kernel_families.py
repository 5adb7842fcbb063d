"""One small call per kernel family and per variant with its own code path, for the reliability
tests: compute-sanitizer runs this script (tests/gpu/test_sanitizer.py), and so does the
exact-size test (tests/gpu/test_exact_size.py) with ``--alloc guard``.

    python tests/gpu/kernel_families.py [--alloc pool|exact|guard] [--check] [--list] [NAME ...]

--alloc pool   CuPy's memory pool (allocations rounded up: reads past an array's end go unseen)
--alloc exact  no pool: every array is its own cudaMalloc of exactly its bytes, so memcheck and
               initcheck see a read past its end
--alloc guard  every input and output ends exactly at the end of mapped memory (driver virtual
               memory: the next page is reserved and unmapped), so a read past its end faults
--check        compare each result with the same call on pool-allocated arrays (NaN-poisoned
               outputs first); exit 1 on a mismatch

Each case prints the variant that ran, so a run shows which code paths it covered.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import sys

import numpy as np

import cupy as cp
import ml_dtypes

from cupyflash.gpu import bwd as _gpu_bwd, fwd as _gpu
from cupyflash._options import Options

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32),
          "float64": np.dtype(np.float64)}


def lse_dtype(dtype: str):
    """lse is float64 for float64 inputs, float32 otherwise."""
    return np.float64 if dtype == "float64" else np.float32


# ------------------------------------------------------------------------------------------
# Allocation: arrays that end exactly where their memory ends
# ------------------------------------------------------------------------------------------
class _Prop(ctypes.Structure):   # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class _Guarded:
    """Device memory of ``nbytes`` mapped at the end of a virtual range whose next page is
    reserved but unmapped: ``ptr`` + nbytes is the first address that faults."""

    _lib = None
    _kept = []   # (memory objects live until the process exits; the script is short)

    def __init__(self, nbytes: int, dev: int):
        lib = _Guarded._lib
        if lib is None:
            lib = _Guarded._lib = ctypes.CDLL("libcuda.so.1")
        prop = _Prop(type=1, requestedHandleTypes=0, loc_type=1, loc_id=dev)  # pinned, device
        gran = ctypes.c_size_t()
        self._ok(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0))
        g = gran.value
        mapped = max(g, -(-nbytes // g) * g)
        handle = ctypes.c_ulonglong()
        self._ok(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(mapped), ctypes.byref(prop),
                                 ctypes.c_ulonglong(0)))
        base = ctypes.c_ulonglong()
        self._ok(lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(mapped + g),
                                         ctypes.c_size_t(0), ctypes.c_ulonglong(0),
                                         ctypes.c_ulonglong(0)))
        self._ok(lib.cuMemMap(base, ctypes.c_size_t(mapped), ctypes.c_size_t(0), handle,
                              ctypes.c_ulonglong(0)))
        acc = _Access(loc_type=1, loc_id=dev, flags=3)   # read-write
        self._ok(lib.cuMemSetAccess(base, ctypes.c_size_t(mapped), ctypes.byref(acc),
                                    ctypes.c_size_t(1)))
        self.ptr = base.value + mapped - nbytes
        _Guarded._kept.append((handle, base, mapped))

    @staticmethod
    def _ok(rc):
        if rc != 0:
            raise RuntimeError(f"CUDA driver virtual-memory call failed: CUresult {rc}")


ALLOC = "pool"


def empty(shape, dtype):
    """An uninitialized C-contiguous array allocated the ``ALLOC`` way."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if ALLOC != "guard" or nbytes == 0:
        return cp.empty(shape, dtype)
    mem = _Guarded(nbytes, cp.cuda.runtime.getDevice())
    um = cp.cuda.UnownedMemory(mem.ptr, nbytes, owner=mem)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(um, 0))


def draw(rng, shape, dtype):
    x = empty(shape, dtype)
    x[...] = cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
    return x


def poisoned(shape, dtype):
    x = empty(shape, dtype)
    x[...] = cp.asarray(np.full((), np.nan, np.float32)).astype(dtype)
    return x


# ------------------------------------------------------------------------------------------
# Cases: dense, bias / mask and varlen calls, forward then backward
# ------------------------------------------------------------------------------------------
def _opts(d, causal=False, window=None, softcap=0.0, alibi=None, bias=None, mask=None,
          deterministic=False, allow_tf32=False, bottom_right=True):
    wl, wr = (-1, -1) if window is None else window
    if causal:
        wr = 0
    return Options(scale=1.0 / math.sqrt(d), window_left=wl, window_right=wr,
                   bottom_right=bottom_right, softcap=softcap, alibi_slopes=alibi, bias=bias,
                   bias_shape=None if bias is None else bias.shape, mask=mask,
                   deterministic=deterministic, allow_tf32=allow_tf32)


def dense(rng, dtype, b, s_q, s_k, h, h_k, d, *, fwd="auto", bwd=None, bias=None, mask=False,
          alibi=False, backward=True, **kw):
    """Forward (kernel ``fwd``) then backward (kernel ``bwd``) of one dense call; returns the
    results (out, lse[, dq, dk, dv[, dbias]]) as NumPy float64 and the variants' names."""
    dt = DTYPES[dtype]
    q, k, v = draw(rng, (b, s_q, h, d), dt), draw(rng, (b, s_k, h_k, d), dt), draw(rng, (b, s_k, h_k, d), dt)
    bias_arr = None if bias is None else draw(rng, bias, DTYPES[kw.pop("bias_dtype", dtype)])
    mask_arr = None
    if mask:
        mask_arr = empty((1, h, s_q, s_k), np.bool_)
        mask_arr[...] = cp.asarray(rng.random((1, h, s_q, s_k)) < 0.8)
    slopes = None
    if alibi:
        slopes = empty((b, h), np.float32)
        slopes[...] = cp.asarray(rng.uniform(0.01, 0.5, (b, h)).astype(np.float32))
    opts = _opts(d, bias=bias_arr, mask=mask_arr, alibi=slopes, **kw)
    out, lse = poisoned((b, s_q, h, d), dt), poisoned((b, h, s_q), lse_dtype(dtype))
    names = [_gpu.forward(q, k, v, out, lse, opts, kernel=fwd)]
    res = [out, lse]
    if backward:
        dout = draw(rng, (b, s_q, h, d), dt)
        grads = [poisoned(x.shape, dt) for x in (q, k, v)]
        dbias = None if bias_arr is None else poisoned(bias_arr.shape, bias_arr.dtype)
        names.append(_gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, kernel=bwd,
                                       dbias=dbias))
        res += grads + ([] if dbias is None else [dbias])
    return [cp.asnumpy(x).astype(np.float64) for x in res], names, dtype


def varlen(rng, dtype, seqs_q, seqs_k, h, h_k, d, *, kernel="auto", backward=True, **kw):
    """Forward then backward of one packed call over sequences of lengths seqs_q / seqs_k."""
    dt = DTYPES[dtype]
    cq = np.concatenate([[0], np.cumsum(seqs_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(seqs_k)]).astype(np.int32)
    tq, tk = int(cq[-1]), int(ck[-1])
    q, k, v = draw(rng, (1, tq, h, d), dt), draw(rng, (1, tk, h_k, d), dt), draw(rng, (1, tk, h_k, d), dt)
    cq_d, ck_d = empty(cq.shape, np.int32), empty(ck.shape, np.int32)
    cq_d[...], ck_d[...] = cp.asarray(cq), cp.asarray(ck)
    opts = _opts(d, **kw)
    out, lse = poisoned((1, tq, h, d), dt), poisoned((h, tq), lse_dtype(dtype))
    mq, mk = max(seqs_q), max(seqs_k)
    names = [_gpu.forward_varlen(q, k, v, cq_d, ck_d, mq, mk, out, lse, opts, kernel=kernel)]
    res = [out, lse]
    if backward:
        dout = draw(rng, (1, tq, h, d), dt)
        grads = [poisoned(x.shape, dt) for x in (q, k, v)]
        names.append(_gpu_bwd.backward_varlen(dout, q, k, v, out, lse, cq_d, ck_d, mq, mk, *grads,
                                              opts, kernel=kernel))
        res += grads
    return [cp.asnumpy(x).astype(np.float64) for x in res], names, dtype


def kvcache(rng, dtype, b, s_q, h, h_k, d, cache_len, new, *, page=None, rotary_dim=0,
            num_splits=0, **kw):
    """attention_with_kvcache (portable/decode.cu: the append / rotary, split-KV and combine
    kernels): ``new`` rows appended at random cache lengths, a paged cache (pages of ``page``
    rows in shuffled order) or a contiguous one; returns (out, lse, k_cache, v_cache)."""
    from cupyflash import attention_with_kvcache
    dt = DTYPES[dtype]
    q = draw(rng, (b, s_q, h, d), dt)
    if page is None:
        kc, vc, table = draw(rng, (b, cache_len, h_k, d), dt), draw(rng, (b, cache_len, h_k, d), dt), None
    else:
        pages = cache_len // page
        kc, vc = draw(rng, (b * pages, page, h_k, d), dt), draw(rng, (b * pages, page, h_k, d), dt)
        table = empty((b, pages), np.int32)
        table[...] = cp.asarray(rng.permutation(b * pages).reshape(b, pages).astype(np.int32))
    kn, vn = draw(rng, (b, new, h_k, d), dt), draw(rng, (b, new, h_k, d), dt)
    lens = empty((b,), np.int32)
    lens[...] = cp.asarray(rng.integers(0, cache_len - new + 1, b).astype(np.int32))
    cos = sin = None
    if rotary_dim:
        ang = np.outer(np.arange(cache_len), 1e-2 * np.arange(1, rotary_dim // 2 + 1))
        cos, sin = empty(ang.shape, np.float32), empty(ang.shape, np.float32)
        cos[...], sin[...] = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    out, lse = attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                      rotary_cos=cos, rotary_sin=sin, return_lse=True,
                                      num_splits=num_splits, **kw)
    name = f"attention_with_kvcache({'paged' if page else 'contiguous'}, splits {num_splits or 'auto'})"
    return [cp.asnumpy(x).astype(np.float64) for x in (out, lse, kc, vc)], [name], dtype


def smem99(fn, *args, **kw):
    """``fn(*args, **kw)`` planned for a 99 KB GPU (sm_86 / 89 / 120: their tiles, e.g. the
    backward's one-buffer flash_bwd_2d tile at hd 64)."""
    from cupyflash.gpu.device import limit_shared_memory
    with limit_shared_memory(99 * 1024):
        return fn(*args, **kw)


CASES = {
    # Hopper forward and backward (hopper/fwd.cu / hopper/bwd.cu), 16-bit
    "sm90_bf16_d128_causal": lambda r: dense(r, "bfloat16", 2, 200, 333, 4, 2, 128, fwd="sm90", bwd="sm90", causal=True),
    "sm90_f16_d64": lambda r: dense(r, "float16", 2, 200, 333, 4, 4, 64, fwd="sm90", bwd="sm90"),
    "sm90_bf16_d64_window": lambda r: dense(r, "bfloat16", 1, 333, 200, 2, 1, 64, fwd="sm90", bwd="sm90", window=(40, 17)),
    "sm90_f16_d128_topleft": lambda r: dense(r, "float16", 1, 333, 200, 2, 2, 128, fwd="sm90", bwd="sm90", causal=True, bottom_right=False),
    "sm90_bf16_d256_fwd": lambda r: dense(r, "bfloat16", 1, 200, 333, 2, 1, 256, fwd="sm90", backward=False),
    "sm90_f16_d256_causal": lambda r: dense(r, "float16", 1, 200, 333, 4, 2, 256, fwd="sm90", bwd="sm90", causal=True),
    "sm90_bf16_d128_softcap_fwd": lambda r: dense(r, "bfloat16", 1, 200, 333, 2, 1, 128, fwd="sm90", backward=False, softcap=30.0),
    "sm90_bf16_d128_maxfree_fwd": lambda r: dense(r, "bfloat16", 1, 300, 1100, 2, 2, 128, backward=False),
    "sm90_bf16_d128_split_fwd": lambda r: dense(r, "bfloat16", 1, 256, 4000, 2, 2, 128, backward=False),
    "sm90_bf16_d128_bias16": lambda r: dense(r, "bfloat16", 2, 200, 334, 2, 2, 128, fwd="sm90", bwd="sm90", bias=(2, 2, 200, 334)),
    "sm90_f16_d64_bias32_bcast": lambda r: dense(r, "float16", 2, 200, 334, 2, 1, 64, fwd="sm90", bwd="sm90", bias=(1, 2, 1, 334), bias_dtype="float32"),
    "sm90_bf16_d64_bias_dbiaskernel": lambda r: dense(r, "bfloat16", 2, 200, 334, 4, 2, 64, bias=(1, 1, 200, 334), causal=True),
    "sm90_bf16_d128_deterministic": lambda r: dense(r, "bfloat16", 2, 200, 333, 4, 2, 128, fwd="sm90", bwd="sm90", causal=True, deterministic=True),
    # Hopper float32 (hopper/fwd_f32.cu / hopper/bwd_f32.cu)
    "sm90_f32_d64_causal": lambda r: dense(r, "float32", 1, 200, 333, 2, 1, 64, fwd="sm90", bwd="sm90", causal=True),
    "sm90_f32_d128_window": lambda r: dense(r, "float32", 1, 333, 200, 2, 2, 128, fwd="sm90", bwd="sm90", window=(50, 20)),
    # Portable (portable/fwd.cu / portable/bwd.cu), forced
    "portable_bf16_d128_causal": lambda r: dense(r, "bfloat16", 2, 200, 333, 4, 2, 128, fwd="portable", bwd="portable", causal=True),
    "portable_f16_d40_window": lambda r: dense(r, "float16", 1, 333, 200, 2, 1, 40, fwd="portable", bwd="portable", window=(30, 9)),
    "portable_bf16_d256": lambda r: dense(r, "bfloat16", 1, 129, 77, 2, 2, 256, fwd="portable", bwd="portable", causal=True),
    "portable_f16_d96_softcap_alibi": lambda r: dense(r, "float16", 2, 97, 150, 2, 1, 96, fwd="portable", bwd="portable", softcap=20.0, alibi=True),
    "portable_bf16_d64_deterministic": lambda r: dense(r, "bfloat16", 2, 200, 333, 2, 2, 64, fwd="portable", bwd="portable", deterministic=True, causal=True),
    "portable_f32_d64": lambda r: dense(r, "float32", 1, 200, 333, 2, 1, 64, fwd="portable", bwd="portable"),
    "portable_f32_d32_tf32": lambda r: dense(r, "float32", 1, 131, 77, 2, 2, 32, fwd="portable", bwd="portable", allow_tf32=True, causal=True),
    "portable_bf16_d64_mask_bias": lambda r: dense(r, "bfloat16", 1, 97, 150, 2, 2, 64, fwd="portable", bwd="portable", mask=True, bias=(1, 2, 97, 150)),
    "portable_f16_d128_bias_dbiaskernel": lambda r: dense(r, "float16", 2, 97, 150, 2, 2, 128, fwd="portable", bwd="portable", bias=(1, 1, 97, 150), deterministic=True),
    # The 99 KB class's tiles (flash_bwd_2d: hd 64 BM 64 x BN 128 one buffer, hd 96 64 x 64)
    "smem99_bf16_d64_causal": lambda r: smem99(dense, r, "bfloat16", 2, 200, 333, 4, 2, 64, causal=True),
    "smem99_f16_d96_window": lambda r: smem99(dense, r, "float16", 1, 333, 200, 2, 1, 96, window=(40, 17)),
    # float64 (portable/fwd.cu / portable/bwd.cu with f64_t: DMMA); d 160: O in two column pieces
    "portable_f64_d64_causal": lambda r: dense(r, "float64", 2, 200, 333, 4, 2, 64, causal=True),
    "portable_f64_d160_bias_window": lambda r: dense(r, "float64", 1, 97, 150, 2, 2, 160, bias=(1, 2, 97, 150), window=(30, 9)),
    # Varlen (Hopper VARLEN variants, portable GENERAL)
    "varlen_sm90_bf16_d128_causal": lambda r: varlen(r, "bfloat16", [200, 1, 77], [333, 50, 77], 2, 1, 128, kernel="sm90", causal=True),
    "varlen_sm90_f16_d64_window": lambda r: varlen(r, "float16", [130, 7], [90, 200], 2, 2, 64, kernel="sm90", window=(20, 5)),
    "varlen_sm90_bf16_d256_window": lambda r: varlen(r, "bfloat16", [130, 7], [90, 200], 2, 1, 256, kernel="sm90", window=(20, 5)),
    "varlen_portable_bf16_d64_softcap": lambda r: varlen(r, "bfloat16", [200, 1, 77], [333, 50, 0], 2, 1, 64, kernel="portable", causal=True, softcap=15.0),
    "varlen_portable_f64_d32": lambda r: varlen(r, "float64", [200, 1, 77], [333, 50, 0], 2, 1, 32, causal=True),
    # KV cache (portable/decode.cu): append + rotary, split-KV, combine
    "kvcache_bf16_d128_paged_gqa_rotary": lambda r: kvcache(r, "bfloat16", 2, 3, 8, 2, 128, 320, 5, page=16, rotary_dim=64, num_splits=3, causal=True, rotary_interleaved=True),
    "kvcache_f16_d64_mqa": lambda r: kvcache(r, "float16", 3, 1, 4, 1, 64, 203, 1),
}


def run(names, check: bool, seed: int = 0) -> int:
    """Run the named cases; with ``check``, compare each with a pool-allocated rerun."""
    global ALLOC
    failures = 0
    for name in names:
        alloc = ALLOC
        got, variants, dtype = CASES[name](np.random.default_rng(seed))
        cp.cuda.Device().synchronize()
        line = f"{name}: {' / '.join(variants)}"
        if check:
            ALLOC = "pool"
            try:
                want, _, _ = CASES[name](np.random.default_rng(seed))
            finally:
                ALLOC = alloc
            worst = 0.0
            for g, w in zip(got, want):
                fin = np.isfinite(w)
                if not np.array_equal(fin, np.isfinite(g)) or not np.array_equal(g[~fin], w[~fin]):
                    worst = math.inf
                    break
                if fin.any():
                    tol = {"float64": 1e-10, "float32": 1e-4}.get(dtype, 2e-2) * max(1.0, np.abs(w[fin]).max())
                    worst = max(worst, float(np.abs(g[fin] - w[fin]).max()) / tol)
            ok = worst <= 1.0
            failures += not ok
            line += f"  {'ok' if ok else 'MISMATCH'} (max diff / tolerance {worst:.3g})"
        print(line, flush=True)
    return failures


def main(argv=None) -> int:
    global ALLOC
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="cases to run (default: all)")
    ap.add_argument("--alloc", choices=("pool", "exact", "guard"), default="pool")
    ap.add_argument("--check", action="store_true", help="compare with a pool-allocated rerun")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(CASES))
        return 0
    unknown = [n for n in a.names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; --list shows them")
    ALLOC = a.alloc
    if a.alloc in ("exact", "guard"):
        cp.cuda.set_allocator(None)   # no pool: exact-size cudaMalloc for everything else too
    return 1 if run(a.names or list(CASES), a.check, a.seed) else 0


if __name__ == "__main__":
    sys.exit(main())
