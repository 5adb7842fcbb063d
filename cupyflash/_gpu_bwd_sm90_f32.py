"""Hopper (sm_90a) float32 backward (kernels_cu/bwd_sm90_f32.cu): variants, shared-memory size,
coverage, compilation and launch. _gpu_bwd's planner runs it for float32 calls it covers on
compute capability 9.0 (docs/f32-backward-design.md).

``flash_bwd_sm90_f32<f32x3_t, D, WINDOW>``: dK, dV and dQ at float32 accuracy, 3xTF32 on wgmma;
steps of 32 query rows; dQ is added into the float32 dq output itself. D = 64 (design S): work
tiles of 128 keys (two 64-key consumers). D = 128 (design T, docs/f32-backward-design.md section
15): work tiles of 64 keys, the two consumers own column halves of dK, dV, dQ and split the roles
of Sᵀ / Pᵀ and dPᵀ / dS. One helper kernel before it: ``flash_bwd_pre_sm90_f32<D>`` (D =
rowsum(dO ∘ O), dq zeroed); no dQ accumulator, no conversion kernel.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from . import _plan

BM = 32            # query rows per step
THREADS = 384
HEAD_DIMS = (64, 128)
#: keys per work tile, per head dim (sm90bf::Shape in bwd_sm90_f32.cu)
BN_OF = {64: 128, 128: 64}
BN = BN_OF[64]     # the hd 64 kernel's (kept for callers that predate hd 128)
TILE_RING = 2
N_BARRIERS = 15


class Sm90F32BwdVariant(NamedTuple):
    """One template instantiation of flash_bwd_sm90_f32 (plus its helper kernels)."""

    d: int
    window: bool
    elem: str = "f32x3_t"

    file = "bwd_sm90_f32.cu"
    arch_options = ("-arch=sm_90a",)
    bm = BM
    threads = THREADS

    @property
    def bn(self) -> int:
        return BN_OF[self.d]

    @property
    def name_expression(self) -> str:
        return f"flash_bwd_sm90_f32<{self.elem}, {self.d}, {_plan.cpp_bool(self.window)}>"

    @property
    def pre_expression(self) -> str:
        return f"flash_bwd_pre_sm90_f32<{self.d}>"

    @property
    def helper_expressions(self):
        return (self.pre_expression,)

    @property
    def name(self) -> str:
        return f"bwd90_f32_d{self.d}_{BM}x{self.bn}" + ("_window" if self.window else "")

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.d)


def smem_bytes(d: int) -> int:
    """Mirrors sm90bf::Layout / LayoutT in bwd_sm90_f32.cu. d = 64: k_big, k_small, v_big
    [128, d]; q / dO big and small, their transposes big and small, two landing stages of raw q
    and dO (twelve [32, d] tiles); dS big and small [32, 64] per consumer; lse / D rows [2, 32].
    d = 128: k, v raw [64, d]; q / dO big (landing) and small, raw copies of q and dO (six [32, d]
    tiles); Pᵀ, dSᵀ and dS big and small (six [64, 32] tiles); lse / D rows [2 steps][2, 32].
    Both: the work-tile ring (16 bytes); 15 mbarrier slots; 1024 bytes to align the swizzled
    panels."""
    f = 4
    if d == 128:
        body = 2 * 64 * d * f + 6 * BM * d * f + 6 * 64 * BM * f + 2 * 2 * BM * f
    else:
        body = 3 * BN * d * f + 12 * BM * d * f + 2 * 2 * BM * 64 * f + 2 * BM * f
    return body + 16 + 8 * N_BARRIERS + 1024


def variants():
    """Every Sm90F32BwdVariant (compiled by the harness for sm_90a)."""
    return [Sm90F32BwdVariant(d, w) for d in HEAD_DIMS for w in (False, True)]


def program(variants_):
    """(source, options, name expressions) of ``variants_`` and their helper kernels."""
    from . import _gpu_bwd
    return _gpu_bwd.program(variants_)


def get_functions(variant: Sm90F32BwdVariant, device_id: int):
    """(main, pre) kernels of ``variant`` on ``device_id`` (lazy)."""
    from . import _gpu_bwd
    return _gpu_bwd.get_functions(variant, device_id)


def unsupported(dtype_name: str, d: int, d_v: int, *, allow_tf32: bool, scale: float,
                softcap: float, has_alibi: bool, has_bias: bool, has_mask: bool,
                deterministic: bool, window_left: int, window_right: int, cc: int,
                smem_optin: int, tensors=()) -> Optional[str]:
    """None when bwd_sm90_f32.cu covers the call, else the reason (the planner then runs the
    portable backward; kernel="sm90" raises it)."""
    if allow_tf32:
        return "allow_tf32 (this kernel computes 3xTF32 only; the portable one has the one-pass mode)"
    if softcap or has_alibi or has_bias or has_mask:
        return "softcap / ALiBi / bias / mask (not in the float32 Hopper backward)"
    if deterministic:
        return "deterministic mode (this kernel adds dQ with float atomics)"
    if not scale > 0:
        return f"scale {scale} (this kernel needs scale > 0)"
    return _plan.sm90_common_unsupported(dtype_name, d, d_v, HEAD_DIMS, cc=cc,
                                         smem_need=smem_bytes(d), smem_optin=smem_optin,
                                         tensors=tensors, dtypes=("float32",))


def launch(variant: Sm90F32BwdVariant, prm, q, k, v, dout, dev_id,
           num_sms: int) -> Optional[str]:
    """Run the pre kernel (D, dq zeroed) and the main kernel (dQ added into dq) with the Params
    record ``prm`` (filled by _gpu_bwd.backward). None, launching nothing, when a base address is
    not 16-byte aligned or dq / dk / dv rows are not 8-byte pairs."""
    from . import _gpu, _tma

    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr)
    if any(p_ % _plan.TMA_ALIGN for p_ in ptrs):
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
        dims, byte_strides, box = _plan.tma_tensor(a.shape, _gpu._elem_strides(a, field), 4, rows)
        prm[field] = _tma.encode("float32", a.data.ptr, dims, byte_strides, box)
    prm["sched"] = _gpu._sched_counter(dev_id, _gpu._current_stream().ptr)
    main, pre = get_functions(variant, dev_id)
    rec = prm.reshape(1)[0]
    num_work = -(-s_k // bn) * h_k * b
    pre((-(-s_q // (256 // (variant.d // 4))), h, b), (256, 1, 1), (rec,))
    main((min(num_sms, num_work), 1, 1), (THREADS, 1, 1), (rec,), shared_mem=variant.smem_bytes)
    return variant.name


def launcher(plan, name, dout, q, k, v, opts, dev_id, smem, num_sms, forced):
    """``hopper(prm)`` for _gpu_bwd._fill_and_launch with bwd_sm90_f32.cu where it covers the
    float32 call, else None; ``forced`` (kernel="sm90") turns every refusal into a ValueError
    naming the reason. ``hopper(prm)`` returns None (nothing launched: the portable kernel runs)
    where a base address or dq / dk / dv row is misaligned, unless forced."""
    from . import _gpu

    cc = _gpu._info(dev_id)[0]
    why = unsupported(
        name, q.shape[3], v.shape[3], allow_tf32=bool(opts.allow_tf32), scale=float(opts.scale),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        has_bias=opts.bias is not None, has_mask=opts.mask is not None,
        deterministic=bool(opts.deterministic), window_left=int(opts.window_left),
        window_right=int(opts.window_right), cc=cc, smem_optin=smem,
        tensors=[(a.shape, _gpu._elem_strides(a, t))
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


__all__ = ["Sm90F32BwdVariant", "variants", "smem_bytes", "program", "get_functions",
           "unsupported", "launch", "launcher", "BN", "BM", "THREADS"]
