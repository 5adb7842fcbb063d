"""GPU backward dispatcher and the portable backward's launch (CuPy).

``backward(dout, q, k, v, out, lse, dq, dk, dv, opts, dbias=None) -> str`` is the launcher the
API calls: plan_bwd.py plans the portable kernels (kernels_cu/portable/bwd.cu); on compute capability 9.0
the Hopper main kernel (bwd_sm90.py; float32: bwd_sm90_f32.py) replaces flash_bwd where it covers
the call. With a bias or mask it runs the GENERAL variant (``flash_bwd<..., true, true, true>``)
and writes dbias (``dbias_plan`` says how dS is reduced to the bias's shape), except that on
compute capability 9.0 a bias without a mask runs the Hopper main kernel's BIAS variant where it
covers the call; dbias may come from a dbias kernel instead (flash_bwd_dbias, or on Hopper
dbias_sm90.py). ``backward_varlen`` runs packed sequences in one launch set
(``plan_backward_varlen``).
"""
from __future__ import annotations

import cupy
import numpy as np

from . import (bwd_sm90, bwd_sm90_f32, compile, dbias_sm90, device, operands, params, plan_bwd_sm90,
               plan_dbias_sm90, tma, variants)
from .plan_bwd import (BwdVariant, dbias_by_kernel, dbias_plan, dbias_variant, hopper_dbias_mode,
                       plan_backward, plan_backward_varlen, use_dbias_kernel, with_dq_slabs)
from .tuning import TUNING


# ------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------
_NUM_SMS = {}   # device id -> multiprocessor count
_RESIDENT = {}  # (device id, variant) -> flash_bwd blocks resident at once on the device


def _resident_blocks(variant, dev_id: int, num_sms: int) -> int:
    """SMs × flash_bwd blocks per SM of ``variant`` (the driver's occupancy query; at least 1)."""
    key = (dev_id, variant)
    n = _RESIDENT.get(key)
    if n is None:
        from cupy_backends.cuda.api import driver
        main = compile.get_functions(variant, dev_id)[0]    # a RawKernel; .kernel: its CUfunction
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(main.kernel.ptr, variant.threads,
                                                                   variant.smem_bytes)
        n = _RESIDENT[key] = num_sms * max(1, per_sm)
    return n


def _elem_strides(a, what):
    """(batch, seq, head) strides in elements of a 4-D bshd array with a unit last stride."""
    if a.ndim != 4:
        raise ValueError(f"{what}: expected a 4-D bshd array, got shape {a.shape}")
    return params.elem_strides(a, what)[:3]


def _acc_dtype(dtype) -> np.dtype:
    """The kernels' accumulator dtype for inputs of ``dtype`` (lse, D, the dQ and dbias
    accumulators): float64 for float64, else float32 (Acc<E> in common.cuh)."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def _checks(dout, q, k, v, out, lse, dq, dk, dv):
    """dtype name of a launchable problem (same dtype everywhere, contiguous lse: float32, or
    float64 for float64)."""

    name = variants.DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise NotImplementedError(f"GPU backward: dtype {q.dtype} (float16, bfloat16, float32, "
                                  "float64)")
    for a, w in ((k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (dq, "dq"), (dk, "dk"),
                 (dv, "dv")):
        if a.dtype != q.dtype:
            raise ValueError(f"{w} has dtype {a.dtype}, q has {q.dtype}")
    if lse.dtype != _acc_dtype(q.dtype) or not lse.flags.c_contiguous:
        raise ValueError(f"lse must be a contiguous {_acc_dtype(q.dtype)} array")
    return name


def _device():
    """(device id, smem opt-in, SM count) of the current device; sm_80+ required."""

    dev_id = cupy.cuda.runtime.getDevice()
    cc, smem, _ = device.info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU backward needs compute capability 8.0 or newer; device {dev_id} is sm_{cc}")
    num_sms = _NUM_SMS.get(dev_id)
    if num_sms is None:   # Device.attributes queries every attribute: once per device
        num_sms = _NUM_SMS[dev_id] = cupy.cuda.Device(dev_id).attributes["MultiProcessorCount"]
    return dev_id, smem, num_sms


def _fill_and_launch(plan, dout, q, k, v, out, lse, dq, dk, dv, opts, dev_id, *,
                     zero_batch_strides=False, extra=None, hopper=None,
                     hopper_accum=True, after=None, replan=None, extra_options=()):
    """Strides, pointers, ALiBi slopes into the plan's Params; D and dQ accumulator allocated;
    ``extra(prm)`` writes the GENERAL fields; the three kernels launched in order, or
    ``hopper(prm)`` launches them with the Hopper main kernel (None: it could not).
    ``hopper_accum=False``: the Hopper kernels need no accumulator from here (hopper/bwd_f32.cu
    adds dQ into dq; a deterministic hopper/bwd.cu launch allocates its own with its
    semaphores), so it is allocated only if ``hopper`` falls back; ``replan(plan)`` then gives
    the portable kernels' plan (deterministic: its dQ slabs). ``after(prm)`` launches more
    kernels reading the same Params (the 0-d array; flash_bwd_dbias or flash_bwd_dbias_sm90)
    after the main kernels, while D is alive. ``extra_options``: NVRTC options of the portable
    kernels (tuning only)."""


    prm = plan.params.copy()
    strides = []
    for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o"), (dout, "do"), (dq, "dq"), (dk, "dk"),
                 (dv, "dv")):
        sb, ss, sh = _elem_strides(a, t)
        if zero_batch_strides:
            sb = 0
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        if t in ("q", "k", "v", "do"):
            strides += [sb, ss, sh]
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr)
    prm["vec_ok"] = int(params.vec_ok(ptrs, strides, q.dtype.itemsize))
    alibi = operands.set_alibi(prm, opts.alibi_slopes, q.dtype)
    rows = plan.params["dq_accum_slab"] // max(1, int(plan.params["d"]))
    acc_dtype = _acc_dtype(q.dtype)
    dsum = cupy.empty(rows, acc_dtype)
    for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse), ("dout", dout),
                 ("dq", dq), ("dk", dk), ("dv", dv), ("dsum", dsum)):
        prm[n] = a.data.ptr

    def accumulator(plan):   # the float32 (float64) dQ accumulator (all slabs), its address in prm
        # deterministic slabs are added into (zeroed here); atomic mode's is zeroed by flash_bwd_pre
        a = (cupy.zeros if prm["deterministic"] else cupy.empty)(plan.accum_elems, acc_dtype)
        prm["dq_accum"] = a.data.ptr
        return a

    accum = accumulator(plan) if hopper is None or hopper_accum else None
    keep = extra(prm) if extra is not None else ()
    ran = hopper(prm) if hopper is not None else None
    if ran is None:
        if replan is not None and hopper is not None:
            plan = replan(plan)
            prm["dq_slabs"] = plan.params["dq_slabs"]
        if accum is None:
            accum = accumulator(plan)
        main, pre, conv = compile.get_functions(plan.variant, dev_id, extra_options)
        rec = prm.reshape(1)[0]
        pre(plan.pre_grid, (256, 1, 1), (rec,))
        main(plan.grid, plan.block, (rec,), shared_mem=plan.smem)
        conv(plan.dq_grid, (256, 1, 1), (rec,))
        ran = plan.variant.name
    if after is not None:
        after(prm)
    del keep, alibi, accum, dsum
    return ran


def _hopper_launcher(plan, name, dout, q, k, v, opts, dev_id, smem, num_sms, forced,
                     varlen=None, bias_operand=None):
    """``hopper(prm)`` for _fill_and_launch when the Hopper main kernel covers the call (None
    otherwise); ``forced`` (kernel="sm90") turns every refusal into a ValueError. ``varlen``:
    (sequences, max_seqlen_k) of a packed call (the VARLEN variant). ``bias_operand``: (array,
    bias_f32) from operands.bias_operand for a call with a bias (no mask): the BIAS variant then runs
    where the bias layout allows it (bwd_sm90.bias_unsupported)."""

    if name == "float32":   # hopper/bwd_f32.cu: dense calls without a bias only
        if varlen is None and bias_operand is None:
            return bwd_sm90_f32.launcher(plan, name, dout, q, k, v, opts, dev_id, smem,
                                              num_sms, forced)
        if forced:
            raise ValueError("kernel='sm90': the Hopper backward cannot run this call: float32 "
                             "with a bias or packed sequences (hopper/bwd_f32.cu is dense only)")
        return None
    cc = device.info(dev_id)[0]
    why = plan_bwd_sm90.why_unsupported(
        name, q.shape[3], v.shape[3], scale=float(opts.scale),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        deterministic=bool(opts.deterministic), cc=cc, smem_optin=smem,
        tensors=[(a.shape, params.elem_strides(a, t))
                 for a, t in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"))],
        has_bias=bias_operand is not None)
    bias_kind = 0
    if why is None and opts.mask is not None:
        why = "a boolean mask (not in the Hopper backward)"
    if why is None and varlen is not None:   # the kernel's int work-tile count
        nseq, max_k = varlen
        if -(-int(max_k) // plan_bwd_sm90.bn_for(q.shape[3])) * k.shape[2] * int(nseq) > 2**31 - 1:
            why = (f"{nseq} sequences x {k.shape[2]} kv heads x the longest sequence's key tiles "
                   "exceed 2^31 - 1 work tiles")
    if why is None and bias_operand is not None:
        b_arr, f32 = bias_operand
        why = plan_bwd_sm90.bias_unsupported(params.broadcast_strides(b_arr), k.shape[1],
                                   b_arr.data.ptr, b_arr.itemsize)
        bias_kind = plan_bwd_sm90.BIAS_LD32 if f32 else plan_bwd_sm90.BIAS_LD16
        if (not f32 and plan_bwd_sm90.smem_bytes(q.shape[3], bias_tma=True) <= smem
                and tma.bias_tma_unsupported(b_arr.shape, params.broadcast_strides(b_arr), q.shape[1],
                                             b_arr.data.ptr, b_arr.itemsize) is None):
            bias_kind = plan_bwd_sm90.BIAS_TMA   # the bias tile staged by TMA (else the consumers load it)
    if why is not None:
        if forced:
            raise ValueError(f"kernel='sm90': the Hopper backward cannot run this call: {why}")
        return None
    if q.shape[3] == plan_bwd_sm90.SPLIT_D and not forced and not TUNING.bwd_sm90_d256:
        return None   # head dim 256 under "auto" with the switch off: the portable kernel
    # (a GENERAL plan always has window set: the Hopper variant only where a side is bounded)
    window = int(opts.window_left) >= 0 or int(opts.window_right) >= 0
    variant = plan_bwd_sm90.variant_for(plan.variant.elem, q.shape[3], window, bias_kind,
                              varlen=varlen is not None, det=bool(opts.deterministic))

    def hopper(prm):
        ran = bwd_sm90.launch(variant, prm, plan.pre_grid, q, k, v, dout, dev_id, num_sms, varlen,
                         bias=bias_operand[0] if bias_operand is not None else None)
        if ran is None and forced:
            raise ValueError("kernel='sm90': a base address is not 16-byte aligned")
        return ran

    return hopper


def _dbias_sm90_variant(name, q, k, v, dout, operand, opts, dplan, dev_id, smem):
    """The Hopper dbias kernel's variant for an eligible call (None: TUNING.dbias_sm90 off, a base
    address TMA cannot take, or plan_dbias_sm90.why_unsupported names a reason; the call then keeps
    the default of other devices, use_dbias_kernel)."""
    if not TUNING.dbias_sm90:
        return None
    b_arr = operand[0]
    if not plan_dbias_sm90.bases_aligned(q, k, v, dout, b_arr):
        return None
    shape = dplan.shape
    why = plan_dbias_sm90.why_unsupported(
        name, q.shape[3], v.shape[3], cc=device.info(dev_id)[0], smem_optin=smem,
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        has_mask=opts.mask is not None,
        tensors=[(a.shape, params.elem_strides(a, t))
                 for a, t in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"))],
        bias_shape=b_arr.shape, bias_strides=params.broadcast_strides(b_arr),
        bias_itemsize=b_arr.itemsize, s_q=q.shape[1], s_k=k.shape[1],
        planes=shape[0] * shape[1])
    if why is not None:
        return None
    window = int(opts.window_left) >= 0 or int(opts.window_right) >= 0
    return plan_dbias_sm90.variant_for(variants.elem_tag(name, False), q.shape[3], b_arr.itemsize == 4, window)


def backward(dout, q, k, v, out, lse, dq, dk, dv, opts, *, kernel=None, dbias=None) -> str:
    """dq, dk, dv [...] = gradients of attention(q, k, v) at dout; returns the variant's name.

    dout, out [b, s_q, h, d_v]; q [b, s_q, h, d]; k [b, s_k, h_k, d]; v [b, s_k, h_k, d_v]:
    CuPy bshd views of one dtype with a contiguous last dimension; lse float32 (float64 for
    float64 inputs: the f64_t kernels, double accumulators throughout) [b, h, s_q]
    contiguous (natural log, -inf for rows that see no key); dq, dk, dv preallocated with
    q, k, v's shapes and dtype (any strides). Current device and stream. ``kernel``: None or
    "auto" (the planner: the Hopper main kernel, bwd_sm90, on compute capability 9.0 where
    it covers the call, else the portable one), "portable", "sm90" (ValueError where it cannot
    run), or a BwdVariant to force (tuning, benchmarks); or a pair ("portable" or a BwdVariant,
    extra NVRTC options) for tuning experiments (e.g. ("portable", ("-DFLAG",))); anything else
    is a ValueError. On
    float32 the Hopper main kernel is hopper/bwd_f32.cu (bwd_sm90_f32.py: 3xTF32, hd 64 / 128, dense,
    no softcap / ALiBi / bias / mask, not deterministic); other float32 calls run portable/bwd.cu.
    With ``opts.bias`` / ``opts.mask`` the GENERAL variant runs (a bias without a mask: the Hopper
    kernel's BIAS variant on compute capability 9.0 where it covers the call); ``dbias`` (a CuPy
    array of opts.bias's 4-D shape, any float dtype) then receives dS summed over the bias's
    broadcast dimensions (float32 accumulation; ``dbias_plan`` says how, plus
    ``hopper_dbias_mode`` on the Hopper kernel; or a dbias kernel where ``dbias_by_kernel``
    allows and ``use_dbias_kernel`` takes it). Raises NotImplementedError for
    head dims > 256, other dtypes, pre-sm_80 GPUs.
    """

    nvrtc_extra = ()
    if isinstance(kernel, tuple) and len(kernel) == 2 and (
            kernel[0] == "portable" or isinstance(kernel[0], BwdVariant)):
        kernel, nvrtc_extra = kernel[0], tuple(kernel[1])   # (kernel, extra options): tuning only
    if kernel == "auto":
        kernel = None
    if not (kernel is None or kernel in ("portable", "sm90") or isinstance(kernel, BwdVariant)):
        raise ValueError(f"kernel={kernel!r}: accepted None / 'auto', 'sm90', 'portable' or a "
                         "BwdVariant")
    name = _checks(dout, q, k, v, out, lse, dq, dk, dv)
    bias = opts.bias
    if bias is not None and dbias is None:
        raise ValueError("backward with a bias needs the dbias output array")
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    d_v = v.shape[3]
    if b == 0 or h == 0:
        return "empty"
    if s_q == 0 or s_k == 0 or d == 0 or d_v == 0:   # no products: the gradients are zero
        for a in (dq, dk, dv, dbias):
            if a is not None and a.size:
                a.fill(0)
        return "empty"
    dev_id, smem, num_sms = _device()
    plan = plan_backward(
        name, b, s_q, s_k, h, h_k, d, d_v, scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=opts.alibi_slopes is not None, allow_tf32=bool(opts.allow_tf32),
        deterministic=bool(opts.deterministic), smem_optin=smem, num_sms=num_sms,
        variant=kernel if isinstance(kernel, BwdVariant) else None, has_bias=bias is not None,
        has_mask=opts.mask is not None)
    if kernel == "sm90" and plan.variant.general and bias is None:   # a mask alone
        raise ValueError("kernel='sm90': the Hopper backward cannot run this call: a boolean "
                         "mask (not in the Hopper backward)")
    hopper = None
    operand = None   # operands.bias_operand(bias, q.dtype), once made
    if (kernel is None or kernel == "sm90") and (not plan.variant.general or bias is not None):
        if bias is not None:
            operand = operands.bias_operand(bias, q.dtype)
        hopper = _hopper_launcher(plan, name, dout, q, k, v, opts, dev_id, smem, num_sms,
                                  forced=kernel == "sm90", bias_operand=operand)
    # deterministic: the portable kernels' dQ slabs, where they run (the Hopper kernel orders dQ
    # itself and needs no slabs: the portable variant is then not compiled for its occupancy)
    replan = None
    if opts.deterministic:
        def replan(pl):
            return with_dq_slabs(pl, _resident_blocks(pl.variant, dev_id, num_sms))
        if hopper is None:
            plan = replan(plan)
    extra = after = None
    dplan = accum = by_kernel = dbias90 = None
    if plan.variant.general:

        if bias is not None:
            dplan = dbias_plan(bias.shape, b, h_k, bool(opts.deterministic))
            hopper_mode = hopper_dbias_mode(dplan, b, h)
            if operand is None:
                operand = operands.bias_operand(bias, q.dtype)
            acc_dtype = _acc_dtype(q.dtype)
            direct = (dplan.slabs == 1 and dbias.dtype == acc_dtype
                      and dbias.flags.c_contiguous and dbias.shape == dplan.shape
                      and dbias.data.ptr % 8 == 0)   # Hopper: 8-byte pairs
            eligible = (name != "float64"   # (float64: flash_bwd's double accumulator only)
                        and dbias.flags.c_contiguous and dbias.shape == dplan.shape
                        and dbias_by_kernel(dplan, dbias.dtype, operand[0].dtype, direct))
            if eligible:
                dbias90 = _dbias_sm90_variant(name, q, k, v, dout, operand, opts, dplan, dev_id,
                                              smem)
            if eligible and use_dbias_kernel(TUNING.dbias_kernel, bool(opts.deterministic),
                                             dbias90 is not None):
                by_kernel = dbias_variant(plan.variant.elem, plan.variant.d, smem)
            elif dplan.mode >= 0:
                if direct:   # the float32 (float64) output is its own accumulator
                    accum = dbias.reshape(-1)
                    accum.fill(0)
                else:
                    try:
                        accum = cupy.zeros(dplan.slabs * int(np.prod(dplan.shape)), acc_dtype)
                    except cupy.cuda.memory.OutOfMemoryError:   # no room: dbias without it
                        if not eligible or TUNING.dbias_kernel is False:
                            raise
                        by_kernel = dbias_variant(plan.variant.elem, plan.variant.d, smem)

        def extra(prm):
            keep = operands.set_bias_mask(prm, opts, q.dtype, operand)
            if by_kernel is not None:
                prm["dbias"] = dbias.data.ptr
                for a, st in zip("bhqk", dplan.strides):
                    prm[f"dbias_stride_{a}"] = st
            if accum is not None:
                prm["dbias_accum"] = accum.data.ptr
                prm["dbias_mode"] = hopper_mode if hopper is not None else dplan.mode
                prm["dbias_slab"] = int(np.prod(dplan.shape))
                for a, st in zip("bhqk", dplan.strides):
                    prm[f"dbias_stride_{a}"] = st
            return keep

        if by_kernel is not None:
            def after(prm):   # dbias tiles, after D = rowsum(dO ∘ O) exists
                if dbias90 is not None:
                    if dbias_sm90.launch(dbias90, prm, q, k, v, dout, operand[0], dev_id,
                                              num_sms) is not None:
                        return
                rec = prm.reshape(1)[0]
                fn = compile.get_functions(by_kernel, dev_id)[0]
                grid = (-(-s_k // by_kernel.bn), -(-s_q // by_kernel.bm),
                        (b if dplan.shape[0] > 1 else 1) * (h if dplan.shape[1] > 1 else 1))
                fn(grid, (by_kernel.threads, 1, 1), (rec,), shared_mem=by_kernel.smem_bytes)

    # float32: the Hopper kernel (hopper/bwd_f32.cu) adds dQ into dq, no accumulator; a
    # deterministic 16-bit one allocates its own (with its semaphores)
    res = _fill_and_launch(plan, dout, q, k, v, out, lse, dq, dk, dv, opts, dev_id, extra=extra,
                           hopper=hopper, after=after, replan=replan,
                           hopper_accum=name != "float32" and not opts.deterministic,
                           extra_options=nvrtc_extra)
    if dplan is not None:
        if dplan.mode < 0:     # bias constant along keys: exactly zero gradient
            dbias.fill(0)
        elif accum is not None and accum.data.ptr != dbias.data.ptr:
            acc = accum.reshape((dplan.slabs,) + dplan.shape)
            red = acc[0] if dplan.slabs == 1 else acc.sum(axis=0)   # slabs in a fixed order
            cupy.copyto(dbias, red.reshape(dbias.shape), casting="unsafe")   # one pass: cast + store
    return res


def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dq, dk, dv, opts, *, kernel="auto") -> str:
    """Gradients of fwd.forward_varlen in one launch set: the Hopper main kernel's VARLEN
    variant (bwd_sm90) on compute capability 9.0 where it covers the call (same rules as
    the dense backward), else the portable GENERAL variant. ``kernel``: "auto", "sm90"
    (ValueError naming the reason where the Hopper kernel cannot run the call) or "portable".

    dout, out [1, total_q, h, d_v]; q [1, total_q, h, d]; k [1, total_k, h_k, d]; v [1, total_k,
    h_k, d_v] (CuPy bshd views of the packed tokens); lse float32 (float64) [h, total_q] contiguous from
    the varlen forward; cu_seqlens_q / _k int32 CuPy [batch + 1]; dq, dk, dv preallocated like
    q, k, v (every element written). Returns the variant's name (``bwd90_…_varlen`` for Hopper).
    """

    if kernel not in ("auto", "sm90", "portable"):
        raise ValueError(f"kernel={kernel!r}: accepted 'auto', 'sm90', 'portable'")
    name = _checks(dout, q, k, v, out, lse, dq, dk, dv)
    total_q, total_k = q.shape[1], k.shape[1]
    _, _, h, d = q.shape
    h_k, d_v = k.shape[2], v.shape[3]
    nseq = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or total_k == 0 or h == 0 or nseq == 0 or max_seqlen_k == 0:
        for a in (dq, dk, dv):
            if a.size:
                a.fill(0)
        return "empty"
    dev_id, smem, num_sms = _device()
    plan = plan_backward_varlen(
        name, nseq, total_q, total_k, int(max_seqlen_q), int(max_seqlen_k), h, h_k, d, d_v,
        scale=float(opts.scale), window_left=int(opts.window_left),
        window_right=int(opts.window_right), bottom_right=bool(opts.bottom_right),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        allow_tf32=bool(opts.allow_tf32), deterministic=bool(opts.deterministic),
        smem_optin=smem, num_sms=num_sms)
    cq = cupy.ascontiguousarray(cu_seqlens_q, dtype=np.int32)
    ck = cupy.ascontiguousarray(cu_seqlens_k, dtype=np.int32)

    def extra(prm):
        prm["cu_seqlens_q"], prm["cu_seqlens_k"] = cq.data.ptr, ck.data.ptr
        return (cq, ck)

    hopper = None
    if kernel != "portable":
        hopper = _hopper_launcher(plan, name, dout, q, k, v, opts, dev_id, smem, num_sms,
                                  forced=kernel == "sm90", varlen=(nseq, int(max_seqlen_k)))
    replan = None
    if opts.deterministic:   # the portable kernel's dQ slabs, where it runs (as in backward)
        def replan(pl):
            return with_dq_slabs(pl, _resident_blocks(pl.variant, dev_id, num_sms))
        if hopper is None:
            plan = replan(plan)
    return _fill_and_launch(plan, dout, q, k, v, out, lse, dq, dk, dv, opts, dev_id,
                            zero_batch_strides=True, extra=extra, hopper=hopper, replan=replan,
                            hopper_accum=name != "float32" and not opts.deterministic)
