"""Hopper (sm_90a) float32 backward, PROTOTYPE (kernels_cu/bwd_sm90_f32.cu): variants, shared-memory
size and compilation. Never run on a GPU; nothing routes to it (docs/f32-backward-design.md).

``flash_bwd_sm90_f32<f32x3_t, 64, WINDOW>``: dK, dV and (through the float32 accumulator) dQ at
float32 accuracy, 3xTF32 on wgmma; work tiles of 128 keys (two 64-key consumers), steps of 32 query
rows. Helper kernels: bwd.cu's ``flash_bwd_pre<f32x3_t>`` (D = rowsum(dO ∘ O), zeroed accumulator)
and ``flash_bwd_dq_sm90_f32<64>`` (dq = the accumulator, rows chunk-swizzled).
"""
from __future__ import annotations

from typing import NamedTuple

BN = 128           # keys per work tile
BM = 32            # query rows per step
THREADS = 384
HEAD_DIMS = (64,)
TILE_RING = 2
N_BARRIERS = 11


class Sm90F32BwdVariant(NamedTuple):
    """One template instantiation of flash_bwd_sm90_f32 (plus its helper kernels)."""

    d: int
    window: bool
    elem: str = "f32x3_t"

    file = "bwd_sm90_f32.cu"
    arch_options = ("-arch=sm_90a",)
    bn = BN
    bm = BM
    threads = THREADS

    @property
    def name_expression(self) -> str:
        return f"flash_bwd_sm90_f32<{self.elem}, {self.d}, {'true' if self.window else 'false'}>"

    @property
    def pre_expression(self) -> str:
        return f"flash_bwd_pre<{self.elem}>"

    @property
    def dq_expression(self) -> str:
        return f"flash_bwd_dq_sm90_f32<{self.d}>"

    @property
    def helper_expressions(self):
        return (self.pre_expression, self.dq_expression)

    @property
    def name(self) -> str:
        return f"bwd90_f32_d{self.d}_{BM}x{BN}" + ("_window" if self.window else "")

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.d)


def smem_bytes(d: int) -> int:
    """Mirrors sm90bf::Layout in bwd_sm90_f32.cu: k_big, k_small, v_big [128, d]; q / dO big and
    small, their transposes big and small, two raw landing buffers (ten [32, d] tiles); dS big and
    small [32, 64] per consumer; a dQ tile [32, d] per consumer; lse / D rows [2, 32]; the
    work-tile ring (16 bytes); 11 mbarriers; 1024 bytes to align the swizzled panels."""
    f = 4
    return (3 * BN * d * f + 10 * BM * d * f + 2 * 2 * BM * 64 * f + 2 * BM * d * f
            + 2 * BM * f + 16 + 8 * N_BARRIERS + 1024)


def variants():
    """Every Sm90F32BwdVariant of the prototype (compiled by the harness for sm_90a)."""
    return [Sm90F32BwdVariant(d, w) for d in HEAD_DIMS for w in (False, True)]


def program(variants_):
    """(source, options, name expressions) of ``variants_`` and their helper kernels."""
    from . import _gpu_bwd
    return _gpu_bwd.program(variants_)


__all__ = ["Sm90F32BwdVariant", "variants", "smem_bytes", "program", "BN", "BM", "THREADS"]
