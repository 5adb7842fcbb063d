"""GPU forward dispatcher: CuPy arrays in, the kernel that covers the call launched on the current
device and stream (the Hopper kernels, fwd_sm90.py, where they cover it; else the portable one,
fwd_portable.py).

The launch path is kept lean for small calls: everything that depends only on the "shape
signature" (dtypes, shapes, strides, options, device) is planned once and cached (variant,
compiled function, grid, Params with sizes/scalars filled); a call then writes its pointers and
the alignment flag into that cached Params record (struct.pack_into, under a lock) and launches.
The public API keeps the ``_Launch`` of a repeated call itself (api._FAST) and calls
``_Launch.launch`` directly, skipping this module's signature key.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import (compile, decode, device, fwd_portable, fwd_sm90, operands, params, plan_fwd,
               plan_fwd_sm90, tma)
from .tuning import TUNING
from .variants import DTYPE_NAMES


_launch_cache = {}  # shape signature -> _Launch
device.when_limit_changes(_launch_cache.clear)   # planned for the old smem limit
_LAUNCH_CACHE_MAX = 4096


def _build(key, q, k, v, out, lse, opts, kernel, dev_id):
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    d_v = v.shape[3]
    has_alibi = opts.alibi_slopes is not None
    extra = ()
    elem_strides, sm90_reason = fwd_sm90.check(q, k, v, out, opts, name, dev_id, smem)
    if kernel == "auto" and name == "float32" and not TUNING.sm90_float32_auto:
        sm90_reason = "float32 runs the portable kernel under kernel='auto' (TUNING.sm90_float32_auto)"
    if fwd_sm90.want_sm90(kernel):
        if sm90_reason is not None and kernel != "auto":
            raise ValueError(f"kernel={kernel!r}: the Hopper kernel cannot run this call: "
                             f"{sm90_reason}")
    if isinstance(kernel, tuple) and len(kernel) == 2 and (
            isinstance(kernel[0], plan_fwd.Variant) or kernel[0] == "portable"):
        kernel, extra = kernel[0], tuple(kernel[1])   # (kernel, extra NVRTC options): tuning only
    if isinstance(kernel, plan_fwd.Variant):      # an explicit instantiation (tuning, benchmarks)
        forced = kernel
    elif kernel in ("auto", "portable") or fwd_sm90.want_sm90(kernel):
        forced = None
    else:
        forced = fwd_portable.variant_by_name(kernel, smem)
    plan = plan_fwd.plan_forward(
        name, b, s_q, s_k, h, h_k, d, d_v, scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=has_alibi, allow_tf32=bool(opts.allow_tf32), smem_optin=smem,
        variant=forced)
    strides = params.write_strides(plan.params, elem_strides)
    strides_ok = params.vec_ok((), strides, q.dtype.itemsize)
    if fwd_sm90.want_sm90(kernel) and sm90_reason is None:
        return fwd_sm90.build(q, k, v, out, opts, kernel, dev_id, name, elem_strides, plan, strides_ok)
    fn = compile.get_function(plan.variant, dev_id, extra)
    return fwd_portable.Launch(fn, plan, strides_ok)


def _key(q, k, v, out, opts, kernel):
    """The shape signature of one launch (the device is the current one)."""
    alibi = opts.alibi_slopes
    return (q.dtype, q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, out.strides,
            opts.scale, opts.window_left, opts.window_right, opts.bottom_right, opts.softcap,
            None if alibi is None else alibi.shape, opts.allow_tf32,
            opts.bias is not None or opts.mask is not None, kernel, device.get_device())


def _empty(q, k, out, lse) -> bool:
    """True when there is nothing to launch: no output, or no keys (every row attends to
    nothing: out = 0, lse = -inf, written here)."""
    if q.size == 0 or out.size == 0:
        return True
    if k.shape[1] == 0:
        out.fill(0)
        lse.fill(-math.inf)
        return True
    return False


def forward(q, k, v, out, lse, opts, *, kernel="auto") -> str:
    """out[...] = attention(q, k, v), lse[...] = its log-sum-exp; returns the variant's name.

    q [b, s_q, h, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v], out [b, s_q, h, d_v] CuPy arrays
    of one dtype with a contiguous last dimension; lse [b, h, s_q] contiguous, float32 (float64
    for float64 inputs).
    ``kernel``: "auto" (the planner's choice: the Hopper kernel on compute capability 9.0 where
    it covers the call, else the portable one), "portable" (the planner's portable choice),
    "sm90" (the Hopper kernel; ValueError when it cannot run the call), a variant name from
    plan_fwd.variants() / plan_fwd_sm90.variants() / plan_fwd_sm90.f32_variants(), or a
    plan_fwd.Variant / plan_fwd_sm90.Sm90Variant / plan_fwd_sm90.Sm90F32Variant (any instantiation, for
    tuning), or a pair (a plan_fwd.Variant or "portable", extra NVRTC options) for tuning
    experiments.
    float32 takes the Hopper float32 kernel under "auto" where it covers the call
    (TUNING.sm90_float32_auto). Runs on the current device and stream.
    A bias or mask goes to ``_forward_general`` (planned per call): the Hopper BIAS variant for a
    bias it covers, else the portable GENERAL variant.
    float64 runs the portable kernel (f64_t, DMMA); lse is then float64, and a d_v above
    plan_fwd.O_COLS_F64 runs as one launch per 128 columns of v / out (``_f64_pieces``).
    Few query rows against many keys (plan_decode.route_attention) run the split-KV decode
    kernel under "auto".
    Raises NotImplementedError for head dims > 256, other dtypes, pre-sm_80 GPUs.
    """
    pieces = _f64_pieces(q, v, out)
    if pieces is not None:
        for v_c, out_c in pieces:
            name = forward(q, k, v_c, out_c, lse, opts, kernel=kernel)
        return name
    if opts.bias is not None or opts.mask is not None:
        return _forward_general(q, k, v, out, lse, opts, kernel)
    if (kernel == "auto" and k.shape[1] >= 512
            and q.shape[1] * (q.shape[2] // max(k.shape[2], 1)) <= 32):
        # few query rows per kv head, many keys: the split-KV decode path where
        # plan_decode.route_attention takes the call (docs/kvcache.md)
        name = decode.forward_few_rows(q, k, v, out, lse, opts)
        if name is not None:
            return name
    alibi = opts.alibi_slopes
    key = _key(q, k, v, out, opts, kernel)
    ent = _launch_cache.get(key)
    if ent is None:
        if _empty(q, k, out, lse):
            return "empty"
        ent = _build(key, q, k, v, out, lse, opts, kernel, key[-1])
        if len(_launch_cache) >= _LAUNCH_CACHE_MAX:  # e.g. varlen: one signature per length
            _launch_cache.clear()
        _launch_cache[key] = ent
    if alibi is None:
        return ent.launch(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
    alibi, stride_b = operands.alibi_operand(alibi, q.dtype)
    return ent.launch(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
                      alibi.data.ptr, stride_b)


def _f64_pieces(q, v, out):
    """float64 with d_v > plan_fwd.O_COLS_F64: [(v columns, out columns)] of 128 each, else None.
    (The float64 O accumulator holds 128 columns per lane group; each piece recomputes the
    scores and writes the same lse.)"""
    n = plan_fwd.O_COLS_F64
    if q.dtype != np.float64 or v.shape[3] <= n:
        return None
    return [(v[..., c:c + n], out[..., c:c + n]) for c in range(0, v.shape[3], n)]


def cached_launch(q, k, v, out, opts):
    """The cached ``_Launch`` that ``forward(q, k, v, out, lse, opts)`` just used, or None.

    For the API's repeated-call cache: an entry whose launch needs nothing but the five pointers
    (no ALiBi slopes, nothing empty). Call on the device ``forward`` ran on.
    """
    if opts.alibi_slopes is not None:
        return None
    return _launch_cache.get(_key(q, k, v, out, opts, "auto"))


# ------------------------------------------------------------------------------------------
# GENERAL variant: bias / mask (dense) and varlen. Planned per call (no launch cache): these
# calls carry arrays whose pointers and strides change from call to call anyway.
# ------------------------------------------------------------------------------------------
def _check_launchable(q, k, v, out, lse, dev_id):
    """(dtype name, smem opt-in): the checks _build makes, for the GENERAL launchers."""
    cc, smem, _ = device.info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU forward needs compute capability 8.0 or newer (mma.sync bf16/tf32); device "
            f"{dev_id} is sm_{cc}")
    name = DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise NotImplementedError(f"GPU forward: dtype {q.dtype} (float16, bfloat16, float32, "
                                  "float64)")
    for a, w in ((k, "k"), (v, "v"), (out, "out")):
        if a.dtype != q.dtype:
            raise ValueError(f"{w} has dtype {a.dtype}, q has {q.dtype}")
    lse_dtype = np.float64 if name == "float64" else np.float32
    if lse.dtype != lse_dtype or not lse.flags.c_contiguous:
        raise ValueError(f"lse must be a contiguous {np.dtype(lse_dtype)} array [b, h, s_q]")
    return name, smem


def _forward_general(q, k, v, out, lse, opts, kernel="auto") -> str:
    """forward() with a bias and / or a mask: the Hopper kernel's BIAS variant on compute
    capability 9.0 for a bias alone where it covers the call (head dims SM90_BIAS_HEAD_DIMS,
    pair loads: bias_pair_ok), else the GENERAL variant of the portable kernel."""
    if _empty(q, k, out, lse):
        return "empty"
    dev_id = device.get_device()
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    operand = None   # operands.bias_operand(opts.bias, q.dtype), once made
    if fwd_sm90.want_sm90(kernel):
        elem_strides, reason = fwd_sm90.check(q, k, v, out, opts, name, dev_id, smem)
        if reason is None and name == "float32":
            reason = "float32 with a bias or mask (not in the float32 Hopper kernel)"
        if reason is None and opts.mask is not None:
            reason = "a boolean mask (not in the Hopper kernel yet)"
        if reason is None and d not in plan_fwd_sm90.SM90_BIAS_HEAD_DIMS:
            reason = f"head dim {d} with a bias (the Hopper kernel takes {plan_fwd_sm90.SM90_BIAS_HEAD_DIMS})"
        if reason is None:
            operand = operands.bias_operand(opts.bias, q.dtype)
            if not operands.bias_pair_ok(operand[0], s_k):
                reason = "bias layout (needs a unit key stride, even s_k and even strides)"
            elif (out.data.ptr | q.data.ptr | k.data.ptr | v.data.ptr) % tma.TMA_ALIGN:
                # (q, k, v for TMA; out: the bias variants stage O for a TMA store, o_smem)
                reason = "base addresses not 16-byte aligned"
        if reason is None:
            return fwd_sm90.forward_bias(q, k, v, out, lse, opts, name, elem_strides, operand, dev_id)
        if kernel != "auto":
            raise ValueError(f"kernel={kernel!r}: the Hopper kernel cannot run this call: {reason}")
    plan = plan_fwd.plan_forward(
        name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=opts.alibi_slopes is not None, allow_tf32=bool(opts.allow_tf32),
        smem_optin=smem, variant=fwd_portable.forced_variant(kernel, smem), has_bias=opts.bias is not None,
        has_mask=opts.mask is not None)
    prm = plan.params
    keep = operands.set_common(prm, q, k, v, out, lse, opts) + operands.set_bias_mask(prm, opts, q.dtype, operand)
    name = fwd_portable.launch_plan(plan, prm, dev_id)
    del keep   # (CuPy's pool reuses freed memory only in stream order: safe after the launch)
    return name


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                   opts, *, kernel="auto") -> str:
    """Packed (varlen) forward in one launch: the Hopper kernel's VARLEN variant on compute
    capability 9.0 where it covers the call (``kernel="auto"`` or ``"sm90"``), else the GENERAL
    variant of the portable kernel (``kernel="portable"`` forces it).

    q [1, total_q, h, d], k [1, total_k, h_k, d], v [1, total_k, h_k, d_v], out [1, total_q, h,
    d_v]: CuPy bshd views of the packed tokens (contiguous last dimension); lse [h, total_q]
    contiguous, float32 (float64 for float64); cu_seqlens_q / _k int32 [batch + 1] CuPy arrays (validated by the
    caller); max_seqlen_q / _k: the longest sequences (ints). Sequence z is q rows
    cu_seqlens_q[z]:cu_seqlens_q[z + 1] against k / v rows cu_seqlens_k[z]:cu_seqlens_k[z + 1];
    causal / window are aligned per sequence; ALiBi slopes (batch, h) are per sequence.
    A sequence without keys gives out = 0, lse = -inf. Returns the variant's name.
    """
    if kernel not in ("auto", "sm90", "portable"):
        raise ValueError(f"kernel={kernel!r}: accepted 'auto', 'sm90', 'portable'")
    total_q, total_k = q.shape[1], k.shape[1]
    nseq = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or nseq == 0 or q.shape[2] == 0 or max_seqlen_q == 0:
        return "empty"
    if total_k == 0:
        out.fill(0)
        lse.fill(-math.inf)
        return "empty"
    pieces = _f64_pieces(q, v, out)
    if pieces is not None:
        for v_c, out_c in pieces:
            name = forward_varlen(q, k, v_c, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, out_c, lse, opts, kernel=kernel)
        return name
    dev_id = device.get_device()
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    _, _, h, d = q.shape
    h_k = k.shape[2]
    cq = cupy.ascontiguousarray(cu_seqlens_q, dtype=np.int32)
    ck = cupy.ascontiguousarray(cu_seqlens_k, dtype=np.int32)
    if kernel != "portable":
        elem_strides, reason = fwd_sm90.check(q, k, v, out, opts, name, dev_id, smem)
        if reason is None and (opts.bias is not None or opts.mask is not None):
            reason = "a bias or mask with varlen (the GENERAL kernel's)"
        if reason is None and name == "float32":
            reason = "float32 varlen (not in the float32 Hopper kernel)"
        if reason is None and (q.data.ptr | k.data.ptr | v.data.ptr) % tma.TMA_ALIGN == 0 \
                and out.data.ptr % 4 == 0:
            return fwd_sm90.forward_varlen(q, k, v, cq, ck, int(max_seqlen_q), int(max_seqlen_k),
                                        out, lse, opts, name, elem_strides, dev_id)
        if kernel == "sm90":
            raise ValueError(f"kernel='sm90': the Hopper kernel cannot run this call: "
                             f"{reason or 'base addresses not 16-byte aligned'}")
    plan = plan_fwd.plan_forward_varlen(
        name, nseq, total_q, total_k, int(max_seqlen_q), int(max_seqlen_k), h, h_k, d,
        v.shape[3], scale=float(opts.scale), window_left=int(opts.window_left),
        window_right=int(opts.window_right), bottom_right=bool(opts.bottom_right),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        allow_tf32=bool(opts.allow_tf32), smem_optin=smem)
    prm = plan.params
    keep = operands.set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=True)
    prm["cu_seqlens_q"], prm["cu_seqlens_k"] = cq.data.ptr, ck.data.ptr
    name = fwd_portable.launch_plan(plan, prm, dev_id)
    del keep, cq, ck
    return name
