"""TMA descriptors (CUtensorMap) for the Hopper kernel, encoded by the CUDA driver.

CuPy does not wrap ``cuTensorMapEncodeTiled``; we call it through ctypes on the driver library
that every CUDA install has (``libcuda.so.1``; ``nvcuda.dll`` on Windows) rather than through
``cuda.bindings`` (cuda-python): no new dependency, and the call is one C function with plain
arrays. A descriptor bakes in the tensor's base address, so the launcher caches encoded
descriptors per (address, dims, strides, box): repeated calls on the same buffers (CuPy's pool
hands the same blocks back in a loop) pay nothing.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Optional

import numpy as np

from .params import broadcast_strides


# CUtensorMap enums (cuda.h)
_DTYPE = {"float16": 6, "bfloat16": 9, "float32": 7}   # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16 / _FLOAT32
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZEROS = 0                      # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros
_CUDA_ERROR_INVALID_CONTEXT = 201
_encode = None
_lock = threading.Lock()
_cache = {}
_CACHE_MAX = 4096
_u64x4 = ctypes.c_uint64 * 4
_u64x3 = ctypes.c_uint64 * 3
_u32x4 = ctypes.c_uint32 * 4


def _driver_encode():
    global _encode
    if _encode is None:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _encode = fn
    return _encode


def encode(dtype_name: str, ptr: int, dims, byte_strides, box) -> np.ndarray:
    """The 128-byte descriptor (16 uint64 words) of a rank-4 tiled tensor map with 128-byte
    swizzle and zero fill out of bounds: ``dims`` innermost first, ``byte_strides`` of dims 1..3,
    ``box`` the tile copied per TMA instruction (see tma_tensor)."""
    key = (dtype_name, ptr, dims, byte_strides, box)
    desc = _cache.get(key)
    if desc is not None:
        return desc
    buf = ctypes.create_string_buffer(128 + 64)      # CUtensorMap must be 64-byte aligned
    addr = (ctypes.addressof(buf) + 63) & ~63
    args = (addr, _DTYPE[dtype_name], 4, ptr, _u64x4(*dims), _u64x3(*byte_strides),
            _u32x4(*box), _u32x4(1, 1, 1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B,
            _L2_PROMOTION_128B, _OOB_FILL_ZEROS)
    with _lock:
        rc = _driver_encode()(*args)
        if rc == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread that has made no CUDA runtime call yet has no current context (CuPy's
            # pool can serve it without one); cudaSetDevice makes the device's primary context
            # current in this thread, then the driver call works.
            import cupy
            cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())
            rc = _driver_encode()(*args)
    if rc != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {dims}, strides "
            f"{byte_strides} bytes, box {box}, address {ptr:#x}")
    desc = np.frombuffer(ctypes.string_at(addr, 128), np.uint64).copy()
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[key] = desc
    return desc


#: Largest stride TMA takes (bytes, exclusive), and the alignment it needs of strides and bases.
TMA_MAX_STRIDE = 1 << 40
TMA_ALIGN = 16


def tma_strides_ok(shape, strides, itemsize: int) -> bool:
    """True when TMA can address a bshd tensor of ``shape`` with these element ``strides``:
    a contiguous last dimension, other strides positive 16-byte multiples below 2**40 (a
    dimension of size 1 has no stride that matters)."""
    if strides[3] != 1 and shape[3] > 1:
        return False
    for n, st in zip(shape[:3], strides[:3]):
        nbytes = st * itemsize
        if n > 1 and not (0 < nbytes < TMA_MAX_STRIDE and nbytes % TMA_ALIGN == 0):
            return False
    return True


def tma_tensor(shape, strides, itemsize: int, box_rows: int):
    """(dims, byte strides, box) of the rank-4 tensor map over a bshd tensor: dims innermost
    first (d, s, h, b); the box is 128 bytes of columns (the swizzle width: 64 16-bit or 32
    float32 columns) x box_rows rows of one head of one batch. Strides of size-1 dimensions
    (never stepped over) are replaced by a valid stand-in."""
    b, s, h, d = shape
    sb, ss, sh = (st * itemsize for st in strides[:3])
    stand_in = -(-d * itemsize // TMA_ALIGN) * TMA_ALIGN
    dims = (d, s, h, b)
    byte_strides = tuple(st if n > 1 else stand_in for n, st in ((s, ss), (h, sh), (b, sb)))
    return dims, byte_strides, (128 // itemsize, box_rows, 1, 1)


def bias_tma_unsupported(shape, strides, s_q: int, ptr: int, itemsize: int) -> Optional[str]:
    """Why a 16-bit bias operand (4-D ``shape``, element ``strides`` over (b, h, s_q, s_k), 0
    where broadcast) cannot be staged by TMA (BIAS_TMA; None when it can): the tile [64 queries,
    128 keys] needs a full query dimension (a query-broadcast bias keeps the consumers' loads)
    and a tensor map: unit key stride, other strides and the address 16-byte multiples."""
    if shape[2] != s_q:
        return f"bias broadcast over queries (shape {tuple(shape)})"
    bshd_shape = (shape[0], shape[2], shape[1], shape[3])
    bshd_strides = (strides[0], strides[2], strides[1], strides[3])
    if not tma_strides_ok(bshd_shape, bshd_strides, itemsize) or ptr % TMA_ALIGN:
        return f"bias strides {tuple(strides)} / address not in 16-byte multiples"
    return None


def bias_tma_desc(prm, bias, box_rows: int):
    """Fill Params ``prm["tma_bias"]``: the tensor map over ``bias`` [b', h', s_q, s_k] viewed as
    bshd (b', s_q, h', s_k), box [128 bytes of keys (64 16-bit, 32 float32), ``box_rows``
    queries] (bias_tma_unsupported has accepted it). The Hopper backward's box: 64 queries
    (plan_bwd_sm90.BM); the Hopper dbias kernel's: 128 (plan_dbias_sm90.BM)."""
    st = broadcast_strides(bias)
    dims, byte_strides, box = tma_tensor(
        (bias.shape[0], bias.shape[2], bias.shape[1], bias.shape[3]), (st[0], st[2], st[1], st[3]),
        bias.itemsize, box_rows)
    prm["tma_bias"] = encode(bias.dtype.name, bias.data.ptr, dims, byte_strides, box)
