"""Hopper (sm_90a) float32 backward (flash_bwd_sm90_f32, kernels_cu/hopper/bwd_f32.cu): launch.
Variants, coverage and shared memory: plan_bwd_sm90_f32.py.
"""
from __future__ import annotations

from typing import Optional

from . import compile, device, params, tma
from .plan_bwd_sm90_f32 import BM, THREADS, Sm90F32BwdVariant, why_unsupported


def launch(variant: Sm90F32BwdVariant, prm, q, k, v, dout, dev_id,
           num_sms: int) -> Optional[str]:
    """Run the pre kernel (D, dq zeroed) and the main kernel (dQ added into dq) with the Params
    record ``prm`` (filled by bwd.backward). None, launching nothing, when a base address is
    not 16-byte aligned or dq / dk / dv rows are not 8-byte pairs."""
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr)
    if any(p_ % tma.TMA_ALIGN for p_ in ptrs):
        return None
    for t in ("dq", "dk", "dv"):   # red.add.v2 into dq, float2 stores of dK, dV
        if int(prm[t]) % 8 or any(int(prm[f"{t}_stride_{a}"]) % 2 for a in "bsh"):
            return None
    b, s_q, h, _ = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    if h > 65535 or b > 65535:   # the pre kernel's grid.y, grid.z
        return None
    bn = variant.bn
    for field, a, rows in (("tma_q", q, BM), ("tma_k", k, bn), ("tma_v", v, bn),
                           ("tma_do", dout, BM)):
        dims, byte_strides, box = tma.tma_tensor(a.shape, params.elem_strides(a, field), 4, rows)
        prm[field] = tma.encode("float32", a.data.ptr, dims, byte_strides, box)
    prm["sched"] = device.sched_counter(dev_id, device.current_stream().ptr)
    main, pre = compile.get_functions(variant, dev_id)
    rec = prm.reshape(1)[0]
    num_work = -(-s_k // bn) * h_k * b
    pre((-(-s_q // (256 // (variant.d // 4))), h, b), (256, 1, 1), (rec,))
    main((min(num_sms, num_work), 1, 1), (THREADS, 1, 1), (rec,), shared_mem=variant.smem_bytes)
    return variant.name


def launcher(plan, name, dout, q, k, v, opts, dev_id, smem, num_sms, forced):
    """``hopper(prm)`` for bwd._fill_and_launch with hopper/bwd_f32.cu where it covers the
    float32 call, else None; ``forced`` (kernel="sm90") turns every refusal into a ValueError
    naming the reason. ``hopper(prm)`` returns None (nothing launched: the portable kernel runs)
    where a base address or dq / dk / dv row is misaligned, unless forced."""
    cc = device.info(dev_id)[0]
    why = why_unsupported(
        name, q.shape[3], v.shape[3], allow_tf32=bool(opts.allow_tf32), scale=float(opts.scale),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        has_bias=opts.bias is not None, has_mask=opts.mask is not None,
        deterministic=bool(opts.deterministic), window_left=int(opts.window_left),
        window_right=int(opts.window_right), cc=cc, smem_optin=smem,
        tensors=[(a.shape, params.elem_strides(a, t))
                 for a, t in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"))])
    if why is not None:
        if forced:
            raise ValueError(f"kernel='sm90': the float32 Hopper backward cannot run this call: "
                             f"{why}")
        return None
    window = int(opts.window_left) >= 0 or int(opts.window_right) >= 0
    variant = Sm90F32BwdVariant(q.shape[3], window)

    def hopper(prm):
        ran = launch(variant, prm, q, k, v, dout, dev_id, num_sms)
        if ran is None and forced:
            raise ValueError("kernel='sm90': a base address is not 16-byte aligned, or dq / dk / "
                             "dv rows are not 8-byte aligned pairs")
        return ran

    return hopper
