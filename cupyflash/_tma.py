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

import numpy as np

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
    ``box`` the tile copied per TMA instruction (see _plan.tma_tensor)."""
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
