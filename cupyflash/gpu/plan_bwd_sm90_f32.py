"""Hopper (sm_90a) float32 backward (kernels_cu/hopper/bwd_f32.cu): planner side (pure Python):
variants, shared-memory size, coverage; bwd_sm90_f32.py launches it. The backward dispatcher
(bwd.py) runs it for float32 calls it covers on
compute capability 9.0 (docs/f32-backward-design.md).

``flash_bwd_sm90_f32<f32x3_t, D, WINDOW>``: dK, dV and dQ at float32 accuracy, 3xTF32 on wgmma;
steps of 32 query rows; dQ is added into the float32 dq output itself. D = 64 (design S): work
tiles of 128 keys (two 64-key consumers). D = 128 (design T, docs/f32-backward-design.md section
15): work tiles of 64 keys, the two consumers own column halves of dK, dV, dQ and split the roles
of Sᵀ / Pᵀ and dPᵀ / dS. One helper kernel before it: ``flash_bwd_pre_sm90_f32<D>`` (D =
rowsum(dO ∘ O), dq zeroed); no dQ accumulator, no conversion kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .variants import KernelVariant, cpp_bool, sm90_common_unsupported


BM = 32            # query rows per step
THREADS = 384
HEAD_DIMS = (64, 128)


#: keys per work tile, per head dim (sm90bf::Shape in hopper/bwd_f32.cu)
BN_OF = {64: 128, 128: 64}
BN = BN_OF[64]     # the hd 64 kernel's (kept for callers that predate hd 128)
TILE_RING = 2
#: mbarrier slots per head dim (Layout: 15; LayoutT: Layout's first 13 (one landing stage) and the
#: two of the Pᵀ handoff between its consumers)
N_BARRIERS = {64: 15, 128: 15}


@dataclass(frozen=True)
class Sm90F32BwdVariant(KernelVariant):
    """One template instantiation of flash_bwd_sm90_f32 (plus its helper kernels)."""

    d: int
    window: bool
    elem: str = "f32x3_t"

    file = "hopper/bwd_f32.cu"
    arch_options = ("-arch=sm_90a",)
    bm = BM
    threads = THREADS

    @property
    def bn(self) -> int:
        return BN_OF[self.d]

    template = "flash_bwd_sm90_f32"

    def template_args(self) -> tuple:
        return (self.elem, str(self.d), cpp_bool(self.window))

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
    """Mirrors sm90bf::Layout / LayoutT in hopper/bwd_f32.cu. d = 64: k_big, k_small, v_big
    [128, d]; q / dO big and small, their transposes big and small, two landing stages of raw q
    and dO (twelve [32, d] tiles); dS big and small [32, 64] per consumer; lse / D rows [2, 32].
    d = 128: k, v raw [64, d]; q / dO big (landing) and small, raw copies of q and dO (six [32, d]
    tiles); Pᵀ, dSᵀ and dS big and small (six [64, 32] tiles); lse / D rows [2 steps][2, 32].
    Both: the work-tile ring (16 bytes); N_BARRIERS mbarrier slots; 1024 bytes to align the
    swizzled panels."""
    f = 4
    if d == 128:
        body = 2 * 64 * d * f + 6 * BM * d * f + 6 * 64 * BM * f + 2 * 2 * BM * f
        bars = N_BARRIERS[128]
    else:
        body = 3 * BN * d * f + 12 * BM * d * f + 2 * 2 * BM * 64 * f + 2 * BM * f
        bars = N_BARRIERS[64]
    return body + 16 + 8 * bars + 1024


def variants():
    """Every Sm90F32BwdVariant (compiled by the harness for sm_90a)."""
    return [Sm90F32BwdVariant(d, w) for d in HEAD_DIMS for w in (False, True)]


def why_unsupported(dtype_name: str, d: int, d_v: int, *, allow_tf32: bool, scale: float,
                softcap: float, has_alibi: bool, has_bias: bool, has_mask: bool,
                deterministic: bool, window_left: int, window_right: int, cc: int,
                smem_optin: int, tensors=()) -> Optional[str]:
    """None when hopper/bwd_f32.cu covers the call, else the reason (the planner then runs the
    portable backward; kernel="sm90" raises it)."""
    if allow_tf32:
        return "allow_tf32 (this kernel computes 3xTF32 only; the portable one has the one-pass mode)"
    if softcap or has_alibi or has_bias or has_mask:
        return "softcap / ALiBi / bias / mask (not in the float32 Hopper backward)"
    if deterministic:
        return "deterministic mode (this kernel adds dQ with float atomics)"
    if not scale > 0:
        return f"scale {scale} (this kernel needs scale > 0)"
    return sm90_common_unsupported(dtype_name, d, d_v, HEAD_DIMS, cc=cc,
                                         smem_need=smem_bytes(d), smem_optin=smem_optin,
                                         tensors=tensors, dtypes=("float32",))
