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

from . import _modules, _plan

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

    __slots__ = ("fn", "grid", "block", "smem", "record", "words", "ints", "name", "strides_ok")

    def __init__(self, fn, plan, strides_ok):
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


def _build(key, q, k, v, out, lse, opts, kernel, dev_id):
    cc, smem = _info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU forward needs compute capability 8.0 or newer (mma.sync bf16/tf32); device "
            f"{dev_id} is sm_{cc}")
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
    if isinstance(kernel, tuple) and len(kernel) == 2 and isinstance(kernel[0], _plan.Variant):
        kernel, extra = kernel                 # (Variant, extra NVRTC options): tuning only
    if isinstance(kernel, _plan.Variant):      # an explicit instantiation (tuning, benchmarks)
        forced = kernel
    else:
        forced = None if kernel == "auto" else _variant_by_name(kernel, smem)
    plan = _plan.plan_forward(
        name, b, s_q, s_k, h, h_k, d, d_v, scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=has_alibi, allow_tf32=bool(opts.allow_tf32), smem_optin=smem,
        variant=forced)
    prm = plan.params
    strides = []
    for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o")):
        sb, ss, sh, _ = _elem_strides(a, t)
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        strides += [sb, ss, sh]
    strides_ok = _plan.vec_ok((), strides, q.dtype.itemsize)
    fn = _modules.get_function(plan.variant, dev_id, extra)
    return _Launch(fn, plan, strides_ok)


_get_device = cupy.cuda.runtime.getDevice


def forward(q, k, v, out, lse, opts, *, kernel="auto") -> str:
    """out[...] = attention(q, k, v), lse[...] = its log-sum-exp; returns the variant's name.

    q [b, s_q, h, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v], out [b, s_q, h, d_v] CuPy arrays
    of one dtype with a contiguous last dimension; lse float32 [b, h, s_q] contiguous.
    ``kernel``: "auto" (the planner's choice), a variant name from _plan.all_variants(), or a
    _plan.Variant (any instantiation, for tuning). Runs on the current device and stream.
    A bias or mask runs the GENERAL variant (``_forward_general``: planned per call).
    Raises NotImplementedError for head dims > 256, other dtypes, pre-sm_80 GPUs.
    """
    if opts.bias is not None or opts.mask is not None:
        return _forward_general(q, k, v, out, lse, opts, kernel)
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


# ------------------------------------------------------------------------------------------
# GENERAL variant: bias / mask (dense) and varlen. Planned per call (no launch cache): these
# calls carry arrays whose pointers and strides change from call to call anyway.
# ------------------------------------------------------------------------------------------
def _check_launchable(q, k, v, out, lse, dev_id):
    """(dtype name, smem opt-in): the checks _build makes, for the GENERAL launchers."""
    cc, smem = _info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU forward needs compute capability 8.0 or newer (mma.sync bf16/tf32); device "
            f"{dev_id} is sm_{cc}")
    name = _DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise NotImplementedError(f"GPU forward: dtype {q.dtype} (float16, bfloat16, float32)")
    for a, w in ((k, "k"), (v, "v"), (out, "out")):
        if a.dtype != q.dtype:
            raise ValueError(f"{w} has dtype {a.dtype}, q has {q.dtype}")
    if lse.dtype != np.float32 or not lse.flags.c_contiguous:
        raise ValueError("lse must be a contiguous float32 array")
    return name, smem


def _forced(kernel, smem):
    if isinstance(kernel, _plan.Variant):
        return kernel
    return None if kernel == "auto" else _variant_by_name(kernel, smem)


def bias_operand(bias, dtype):
    """(array, bias_f32) the kernels read for a 4-D ``bias``: the bias itself when its dtype is q's
    (``dtype``) or float32, else one float32 copy of the un-broadcast bias (documented:
    docs/choices.md). Element strides must be whole: otherwise a contiguous copy."""
    if bias.dtype == dtype or bias.dtype == np.float32:
        b = bias
    else:
        b = bias.astype(np.float32)
    if any(st % b.itemsize for st in b.strides):
        b = cupy.ascontiguousarray(b)
    return b, int(b.dtype == np.float32)


def broadcast_strides(a):
    """Element strides of a 4-D array over (b, h, s_q, s_k), 0 along its size-1 dimensions."""
    return tuple(0 if n == 1 else st // a.itemsize for n, st in zip(a.shape, a.strides))


def set_bias_mask(prm, opts, dtype):
    """Write the bias / mask pointers, strides, bias_f32 and bias_pair into Params ``prm``
    (its s_k already set); returns the arrays that must stay alive until the launch is queued."""
    keep = []
    if opts.bias is not None:
        b, f32 = bias_operand(opts.bias, dtype)
        prm["bias"], prm["bias_f32"] = b.data.ptr, f32
        st = broadcast_strides(b)
        for a, x in zip("bhqk", st):
            prm[f"bias_stride_{a}"] = x
        # pair loads: unit key stride, even s_k, every (row, even column) pair aligned
        prm["bias_pair"] = int(st[3] == 1 and int(prm["s_k"]) % 2 == 0
                               and all(x % 2 == 0 for x in st[:3])
                               and b.data.ptr % (2 * b.itemsize) == 0)
        keep.append(b)
    if opts.mask is not None:
        m = opts.mask
        if m.dtype != np.bool_:
            raise ValueError(f"mask has dtype {m.dtype}, bool expected")
        prm["mask"] = m.data.ptr
        for a, st in zip("bhqk", broadcast_strides(m)):
            prm[f"mask_stride_{a}"] = st
        keep.append(m)
    return keep


def _set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=False):
    """Strides, vec_ok, pointers and ALiBi slopes of the forward Params; returns arrays to keep."""
    strides = []
    for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o")):
        sb, ss, sh, _ = _elem_strides(a, t)
        if zero_batch_strides:
            sb = 0
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        strides += [sb, ss, sh]
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr)
    prm["vec_ok"] = int(_plan.vec_ok(ptrs, strides, q.dtype.itemsize))
    for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse)):
        prm[n] = a.data.ptr
    keep = []
    alibi = opts.alibi_slopes
    if alibi is not None:
        if alibi.dtype != np.float32 or (alibi.shape[1] > 1 and alibi.strides[1] != 4):
            alibi = cupy.ascontiguousarray(alibi, dtype=np.float32)
        prm["alibi"] = alibi.data.ptr
        prm["alibi_stride_b"] = alibi.strides[0] // 4 if alibi.shape[0] > 1 else 0
        keep.append(alibi)
    return keep


def _launch(plan, prm, dev_id):
    fn = _modules.get_function(plan.variant, dev_id)
    fn(plan.grid, plan.block, (prm.reshape(1)[0],), shared_mem=plan.smem)
    return plan.variant.name


def _forward_general(q, k, v, out, lse, opts, kernel="auto") -> str:
    """forward() with a bias and / or a mask: the GENERAL variant (see forward)."""
    if q.size == 0 or out.size == 0:
        return "empty"
    if k.shape[1] == 0:   # no keys: every row attends to nothing
        out.fill(0)
        lse.fill(-math.inf)
        return "empty"
    dev_id = _get_device()
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    plan = _plan.plan_forward(
        name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=opts.alibi_slopes is not None, allow_tf32=bool(opts.allow_tf32),
        smem_optin=smem, variant=_forced(kernel, smem), has_bias=opts.bias is not None,
        has_mask=opts.mask is not None)
    prm = plan.params
    keep = _set_common(prm, q, k, v, out, lse, opts) + set_bias_mask(prm, opts, q.dtype)
    name = _launch(plan, prm, dev_id)
    del keep   # (CuPy's pool reuses freed memory only in stream order: safe after the launch)
    return name


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                   opts) -> str:
    """Packed (varlen) forward in one launch of the GENERAL variant.

    q [1, total_q, h, d], k [1, total_k, h_k, d], v [1, total_k, h_k, d_v], out [1, total_q, h,
    d_v]: CuPy bshd views of the packed tokens (contiguous last dimension); lse float32
    [h, total_q] contiguous; cu_seqlens_q / _k int32 [batch + 1] CuPy arrays (validated by the
    caller); max_seqlen_q / _k: the longest sequences (ints). Sequence z is q rows
    cu_seqlens_q[z]:cu_seqlens_q[z + 1] against k / v rows cu_seqlens_k[z]:cu_seqlens_k[z + 1];
    causal / window are aligned per sequence; ALiBi slopes (batch, h) are per sequence.
    A sequence without keys gives out = 0, lse = -inf. Returns the variant's name.
    """
    total_q, total_k = q.shape[1], k.shape[1]
    nseq = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or nseq == 0 or q.shape[2] == 0 or max_seqlen_q == 0:
        return "empty"
    if total_k == 0:
        out.fill(0)
        lse.fill(-math.inf)
        return "empty"
    dev_id = _get_device()
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    _, _, h, d = q.shape
    h_k = k.shape[2]
    plan = _plan.plan_forward_varlen(
        name, nseq, total_q, total_k, int(max_seqlen_q), int(max_seqlen_k), h, h_k, d,
        v.shape[3], scale=float(opts.scale), window_left=int(opts.window_left),
        window_right=int(opts.window_right), bottom_right=bool(opts.bottom_right),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        allow_tf32=bool(opts.allow_tf32), smem_optin=smem)
    prm = plan.params
    cq = cupy.ascontiguousarray(cu_seqlens_q, dtype=np.int32)
    ck = cupy.ascontiguousarray(cu_seqlens_k, dtype=np.int32)
    keep = _set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=True)
    prm["cu_seqlens_q"], prm["cu_seqlens_k"] = cq.data.ptr, ck.data.ptr
    name = _launch(plan, prm, dev_id)
    del keep, cq, ck
    return name
