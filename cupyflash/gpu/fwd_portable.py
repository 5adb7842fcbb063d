"""Portable forward kernel (flash_fwd in kernels_cu/portable/fwd.cu, mma.sync, sm_80+): launch entries.

``Launch`` holds everything one shape signature needs at launch time; the dispatcher (fwd.py)
caches it per signature and the API keeps it for repeated calls. ``launch_plan`` runs a plan made
per call (bias / mask / varlen).
"""
from __future__ import annotations

import struct
import threading

import numpy as np

from . import compile, plan_fwd
from .params import PARAMS_DTYPE


_record_lock = threading.Lock()


# Byte offsets inside the Params record (see PARAMS_DTYPE): the six pointers q, k, v, o,
# lse, alibi are its first six uint64 words; alibi_stride_b an int64, vec_ok an int32.
_F = PARAMS_DTYPE.fields
assert [_F[n][1] for n in ("q", "k", "v", "o", "lse", "alibi")] == [0, 8, 16, 24, 32, 40]
PUT_PTRS = struct.Struct("<6Q").pack_into                  # q, k, v, o, lse, alibi
_PUT_I64 = struct.Struct("<q").pack_into
_PUT_I32 = struct.Struct("<i").pack_into
_ALIBI_STRIDE_AT = _F["alibi_stride_b"][1]
_VEC_OK_AT = _F["vec_ok"][1]

try:  # a raw host pointer as a kernel argument: the launch reads the Params bytes from there
    from cupy.cuda.function import CPointer
except ImportError:  # pragma: no cover - other CuPy versions: pass the numpy.void record
    CPointer = None


class Launch:
    """Everything one shape signature needs at launch time.

    ``arr`` is the 1-element Params array passed by value (sizes, scalars and strides filled at
    build time); ``mem`` a writable byte view of it and ``args`` the kernel's argument tuple: a
    CuPy ``CPointer`` to its bytes (or the numpy.void record). A call writes its pointers into
    ``arr`` and launches under _record_lock, so threads may share one entry (the driver copies
    the argument bytes at launch, the next call may rewrite them right after).
    """

    __slots__ = ("fn", "grid", "block", "smem", "arr", "mem", "args", "name", "strides_ok")

    def __init__(self, fn, plan, strides_ok):
        self.fn = getattr(fn, "kernel", fn)  # RawKernel -> its Function on the current device
        self.grid = plan.grid
        self.block = plan.block
        self.smem = plan.smem
        self.arr = plan.params.reshape(1)   # view of plan.params (kept alive here)
        self.mem = memoryview(self.arr.view(np.uint8))
        self.args = (CPointer(self.arr.ctypes.data) if CPointer is not None else self.arr[0],)
        self.name = plan.variant.name
        self.strides_ok = strides_ok

    def launch(self, qp, kp, vp, op, lp, alibi_ptr=0, alibi_stride_b=0) -> str:
        """Write this call's pointers (device addresses, ints) into Params and launch on the
        current stream: q [b, s_q, h, d], k / v [b, s_k, h_k, d(_v)], out [b, s_q, h, d_v],
        lse [b, h, s_q], alibi [b or 1, h] (0 when none). Returns the kernel's name."""
        with _record_lock:
            mem = self.mem
            PUT_PTRS(mem, 0, qp, kp, vp, op, lp, alibi_ptr)
            if alibi_ptr:
                _PUT_I64(mem, _ALIBI_STRIDE_AT, alibi_stride_b)
            _PUT_I32(mem, _VEC_OK_AT, self.strides_ok and ((qp | kp | vp | op) & 15) == 0)
            self.fn(self.grid, self.block, self.args, shared_mem=self.smem)
        return self.name


def variant_by_name(name, smem):
    for v in plan_fwd.variants(smem):
        if v.name == name:
            return v
    raise ValueError(f"kernel={name!r}: no such forward variant (see plan_fwd.variants())")


def forced_variant(kernel, smem):
    if isinstance(kernel, plan_fwd.Variant):
        return kernel
    return None if kernel in ("auto", "portable") else variant_by_name(kernel, smem)


def launch_plan(plan, prm, dev_id):
    fn = compile.get_function(plan.variant, dev_id)
    fn(plan.grid, plan.block, (prm.reshape(1)[0],), shared_mem=plan.smem)
    return plan.variant.name
