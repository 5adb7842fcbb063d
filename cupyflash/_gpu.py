"""GPU forward launcher: CuPy arrays in, flash_fwd launched on the current device and stream.

The launch path is kept lean for small calls: everything that depends only on the "shape
signature" (dtypes, shapes, strides, options, device) is planned once and cached (variant,
compiled function, grid, Params with sizes/scalars filled); a call then copies that Params
record, writes six pointers and the alignment flag, and launches.
"""
from __future__ import annotations

import math
import threading

import cupy
import numpy as np

from . import _modules, _plan, _tma

try:  # ml_dtypes supplies bfloat16 for NumPy / CuPy
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BF16 = None

_DTYPE_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}
if _BF16 is not None:
    _DTYPE_NAMES[_BF16] = "bfloat16"

_device_info = {}   # device id -> (compute capability int, smem opt-in bytes)
_launch_cache = {}  # shape signature -> _Launch
_LAUNCH_CACHE_MAX = 4096
_record_lock = threading.Lock()
_VARIANTS_BY_NAME = None


# Word positions inside the Params record (see _plan.PARAMS_DTYPE): pointers are the first six
# uint64 words, alibi_stride_b the 19th; vec_ok an int32.
_PTR_WORDS = slice(0, 5)
_ALIBI_WORD = 5
_ALIBI_STRIDE_WORD = _plan.PARAMS_DTYPE.fields["alibi_stride_b"][1] // 8
_VEC_OK_INT = _plan.PARAMS_DTYPE.fields["vec_ok"][1] // 4


class _Launch:
    """Everything one shape signature needs at launch time.

    ``record`` is the Params record passed by value; ``words`` / ``ints`` are uint64 / int32
    views of its memory, so a call only writes its pointers in place (the driver copies kernel
    arguments at launch; writes and launch happen under _record_lock, so threads may share it).
    """

    __slots__ = ("fn", "grid", "block", "smem", "record", "words", "ints", "name", "strides_ok",
                 "sm90")

    def __init__(self, fn, plan, strides_ok, sm90=None):
        self.fn = fn
        self.grid = plan.grid
        self.block = plan.block
        self.smem = plan.smem
        arr = plan.params.reshape(1)
        self.record = arr[0]               # numpy.void viewing arr's memory
        self.words = arr.view(np.uint64)
        self.ints = arr.view(np.int32)
        self.name = plan.variant.name
        self.strides_ok = strides_ok
        self.sm90 = sm90      # _Sm90State for the Hopper kernel, else None


class _Sm90State:
    """Per-signature state of the Hopper kernel: the tensor-map geometry of q, k, v, and finished
    Params records (pointers and TMA descriptors written) per tuple of base pointers."""

    __slots__ = ("dtype_name", "maps", "records")

    def __init__(self, dtype_name, maps):
        self.dtype_name = dtype_name
        self.maps = maps       # ((dims, byte strides, box) of q, k, v)
        self.records = {}      # (q, k, v, out, lse pointers) -> Params record


def _info(dev_id):
    info = _device_info.get(dev_id)
    if info is None:
        dev = cupy.cuda.Device(dev_id)
        cc = int(dev.compute_capability)
        smem = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
        info = _device_info[dev_id] = (cc, smem)
    return info


def _variant_by_name(name, smem):
    for v in _plan.all_variants(smem):
        if v.name == name:
            return v
    raise ValueError(f"kernel={name!r}: no such forward variant (see _plan.all_variants())")


def _elem_strides(a, what):
    isz = a.dtype.itemsize
    st = a.strides
    if a.shape[-1] > 1 and st[-1] != isz:
        raise ValueError(f"{what}: the last dimension must be contiguous (strides {st})")
    if any(s % isz for s in st):
        raise ValueError(f"{what}: strides {st} are not multiples of the item size {isz}")
    return tuple(s // isz for s in st)


def _want_sm90(kernel) -> bool:
    return kernel in ("auto", "sm90") or isinstance(kernel, _plan.Sm90Variant) or (
        isinstance(kernel, str) and kernel.startswith("fwd90_"))


def _sm90_variant_by_name(name):
    for v in _plan.sm90_variants():
        if v.name == name:
            return v
    raise ValueError(f"kernel={name!r}: no such Hopper variant (see _plan.sm90_variants())")


def _build(key, q, k, v, out, lse, opts, kernel, dev_id):
    cc, smem = _info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU forward needs compute capability 8.0 or newer (mma.sync bf16/tf32); device "
            f"{dev_id} is sm_{cc}")
    if opts.bias is not None or opts.mask is not None:
        raise NotImplementedError("GPU forward: bias / mask are not supported yet")
    name = _DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise NotImplementedError(f"GPU forward: dtype {q.dtype} (float16, bfloat16, float32)")
    for a, w in ((k, "k"), (v, "v"), (out, "out")):
        if a.dtype != q.dtype:
            raise ValueError(f"{w} has dtype {a.dtype}, q has {q.dtype}")
    if lse.dtype != np.float32 or not lse.flags.c_contiguous:
        raise ValueError("lse must be a contiguous float32 array [b, h, s_q]")
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    d_v = v.shape[3]
    has_alibi = opts.alibi_slopes is not None
    extra = ()
    elem_strides = [_elem_strides(a, t) for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o"))]
    if _want_sm90(kernel):
        reason = _plan.sm90_unsupported(
            name, d, d_v, scale=float(opts.scale), softcap=float(opts.softcap or 0.0),
            has_alibi=has_alibi, cc=cc, smem_optin=smem,
            tensors=[(a.shape, st) for a, st in zip((q, k, v, out), elem_strides)])
        if reason is None:
            return _build_sm90(q, k, v, opts, kernel, dev_id, name, elem_strides)
        if kernel != "auto":
            raise ValueError(f"kernel={kernel!r}: the Hopper kernel cannot run this call: {reason}")
    if isinstance(kernel, tuple) and len(kernel) == 2 and isinstance(kernel[0], _plan.Variant):
        kernel, extra = kernel                 # (Variant, extra NVRTC options): tuning only
    if isinstance(kernel, _plan.Variant):      # an explicit instantiation (tuning, benchmarks)
        forced = kernel
    else:
        forced = None if kernel in ("auto", "portable") else _variant_by_name(kernel, smem)
    plan = _plan.plan_forward(
        name, b, s_q, s_k, h, h_k, d, d_v, scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=has_alibi, allow_tf32=bool(opts.allow_tf32), smem_optin=smem,
        variant=forced)
    strides = _write_strides(plan.params, elem_strides)
    strides_ok = _plan.vec_ok((), strides, q.dtype.itemsize)
    fn = _modules.get_function(plan.variant, dev_id, extra)
    return _Launch(fn, plan, strides_ok)


def _write_strides(prm, elem_strides):
    """Batch / sequence / head strides of q, k, v, out into the Params record; returns them."""
    flat = []
    for t, (sb, ss, sh, _) in zip("qkvo", elem_strides):
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        flat += [sb, ss, sh]
    return flat


def _build_sm90(q, k, v, opts, kernel, dev_id, dtype_name, elem_strides):
    """The Hopper kernel's launch entry (the planner accepted the call)."""
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    forced = None
    if isinstance(kernel, _plan.Sm90Variant):
        forced = kernel
    elif isinstance(kernel, str) and kernel.startswith("fwd90_"):
        forced = _sm90_variant_by_name(kernel)
    plan = _plan.plan_forward_sm90(
        dtype_name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        variant=forced)
    _write_strides(plan.params, elem_strides)
    bn = plan.variant.bn
    maps = tuple(_plan.tma_tensor(a.shape, st, 2, rows)
                 for a, st, rows in ((q, elem_strides[0], _plan.SM90_BM),
                                     (k, elem_strides[1], bn), (v, elem_strides[2], bn)))
    fn = _modules.get_function(plan.variant, dev_id)
    return _Launch(fn, plan, True, _Sm90State(dtype_name, maps))


def _launch_sm90(ent, q, k, v, out, lse):
    """Launch the Hopper kernel; None when a base pointer is not aligned for TMA / the paired
    output stores (the caller then runs the portable kernel)."""
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
    st = ent.sm90
    rec = st.records.get(ptrs)
    if rec is None:
        if (ptrs[0] | ptrs[1] | ptrs[2]) % _plan.TMA_ALIGN or ptrs[3] % 4:
            return None
        arr = np.empty(1, _plan.PARAMS_DTYPE)
        arr[0] = ent.record                   # a copy: sizes, scalars, strides of this signature
        arr.view(np.uint64)[_PTR_WORDS] = ptrs
        for field, ptr, (dims, byte_strides, box) in zip(_plan.PARAMS_TMA_FIELDS, ptrs, st.maps):
            arr[field][0] = _tma.encode(st.dtype_name, ptr, dims, byte_strides, box)
        rec = arr[0]
        if len(st.records) >= 64:   # many different buffers: start over
            st.records.clear()
        st.records[ptrs] = rec      # finished records are never written again: no lock needed
    ent.fn(ent.grid, ent.block, (rec,), shared_mem=ent.smem)
    return ent.name


_get_device = cupy.cuda.runtime.getDevice


def forward(q, k, v, out, lse, opts, *, kernel="auto") -> str:
    """out[...] = attention(q, k, v), lse[...] = its log-sum-exp; returns the variant's name.

    q [b, s_q, h, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v], out [b, s_q, h, d_v] CuPy arrays
    of one dtype with a contiguous last dimension; lse float32 [b, h, s_q] contiguous.
    ``kernel``: "auto" (the planner's choice: the Hopper kernel on compute capability 9.0 where
    it covers the call, else the portable one), "portable" (the planner's portable choice),
    "sm90" (the Hopper kernel; ValueError when it cannot run the call), a variant name from
    _plan.all_variants() / _plan.sm90_variants(), or a _plan.Variant / _plan.Sm90Variant (any
    instantiation, for tuning). Runs on the current device and stream.
    Raises NotImplementedError for bias / mask, head dims > 256, other dtypes, pre-sm_80 GPUs.
    """
    alibi = opts.alibi_slopes
    key = (q.dtype, q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, out.strides,
           opts.scale, opts.window_left, opts.window_right, opts.bottom_right, opts.softcap,
           None if alibi is None else alibi.shape, opts.allow_tf32,
           opts.bias is not None or opts.mask is not None, kernel, _get_device())
    ent = _launch_cache.get(key)
    if ent is None:
        if q.size == 0 or out.size == 0:
            return "empty"
        if k.shape[1] == 0:   # no keys: every row attends to nothing
            out.fill(0)
            lse.fill(-math.inf)
            return "empty"
        ent = _build(key, q, k, v, out, lse, opts, kernel, key[-1])
        if len(_launch_cache) >= _LAUNCH_CACHE_MAX:  # e.g. varlen: one signature per length
            _launch_cache.clear()
        _launch_cache[key] = ent
    if ent.sm90 is not None:
        name = _launch_sm90(ent, q, k, v, out, lse)
        if name is not None:
            return name
        # a base address TMA cannot take (e.g. a view at an odd offset): the portable kernel
        return forward(q, k, v, out, lse, opts, kernel="portable")
    qp, kp, vp, op = q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr
    if alibi is not None and (alibi.dtype != np.float32 or (alibi.shape[1] > 1 and alibi.strides[1] != 4)):
        alibi = cupy.ascontiguousarray(alibi, dtype=np.float32)
    # The record is shared by every call of this signature: write it and launch under a lock
    # (the launch copies the argument, so the next call may rewrite it right after).
    with _record_lock:
        words = ent.words
        words[_PTR_WORDS] = (qp, kp, vp, op, lse.data.ptr)
        if alibi is not None:
            words[_ALIBI_WORD] = alibi.data.ptr
            words[_ALIBI_STRIDE_WORD] = alibi.strides[0] // 4 if alibi.shape[0] > 1 else 0
        ent.ints[_VEC_OK_INT] = ent.strides_ok and ((qp | kp | vp | op) & 15) == 0
        ent.fn(ent.grid, ent.block, (ent.record,), shared_mem=ent.smem)
    return ent.name
