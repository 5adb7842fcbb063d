"""Portable forward planner: problem description -> kernel variant, tiles, grid, Params. Pure Python.

Nothing here touches a GPU: the launchers (fwd.py) pass in the device's shared-memory limit,
so every decision can be tested on a machine without CUDA (tests/planner/).

The kernel is ``flash_fwd<E, D, BM, BN, NW, WINDOW, SCORE_MOD>`` in kernels_cu/portable/fwd.cu:

* E: element tag: ``f16_t``, ``bf16_t``, ``f32x3_t`` (float32 at float32 accuracy, 3xTF32
  split products) or ``tf32_t`` (float32 on plain TF32, when ``allow_tf32``).
* D: head-dim bucket covering both d (Q/K) and d_v (V), one of HEAD_DIM_BUCKETS.
* BM, BN, NW: query tile rows, key tile rows, warps; fixed per (E, D, shared-memory class).
* WINDOW: causal or sliding window (tiles outside skipped, boundary tiles masked).
* SCORE_MOD: softcap and/or ALiBi, or a scale <= 0 (scores moved to base-2 units before the max).

``variants(smem_optin)`` lists every instantiation the planner can select on a device with
that shared-memory limit; the compile harness compiles exactly that list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .params import sizes_and_scalars, varlen_params
from .variants import (ELEM_SIZE, ELEMS, HEAD_DIM_BUCKETS, SM90_SMEM_MAX, KernelVariant, cpp_bool,
                       elem_tag, head_dim_bucket, smem_class)


# (BM, BN, NW) per element size and bucket, for each shared-memory class.
# 16-bit: 128-row query tiles; up to D=128 each of 4 warps owns two 16-row slabs (MT=2) so each
# K / V fragment read from shared memory feeds two products (MT=1 is bound by shared-memory
# bandwidth: measured 238 vs 284 TFLOP/s at hd128, docs/kernels.md); larger D uses 8 warps with
# one slab each (registers). float32: one slab per warp, narrower key tiles as D grows (the O
# accumulator is D/2 registers per lane).
_TILES = {
    ("big", 2): {32: (128, 128, 4), 64: (128, 128, 4), 96: (128, 64, 4), 128: (128, 64, 4),
                 160: (128, 64, 8), 192: (128, 64, 8), 224: (128, 32, 8), 256: (128, 32, 8)},
    ("small", 2): {32: (128, 128, 4), 64: (128, 128, 4), 96: (128, 64, 4), 128: (128, 64, 4),
                   160: (128, 32, 8), 192: (128, 32, 8), 224: (64, 32, 4), 256: (64, 32, 4)},
    ("big", 4): {32: (64, 64, 4), 64: (64, 64, 4), 96: (64, 32, 4), 128: (64, 32, 4),
                 160: (64, 16, 4), 192: (64, 16, 4), 224: (64, 16, 4), 256: (64, 16, 4)},
    ("small", 4): {32: (64, 64, 4), 64: (64, 64, 4), 96: (64, 32, 4), 128: (64, 32, 4),
                   160: (64, 16, 4), 192: (64, 16, 4), 224: (64, 16, 4), 256: (64, 16, 4)},
    # float64: one slab per warp; the O accumulator is 2·D/8·4 registers per lane (128 at D = 128),
    # so the key tile shrinks as D grows and O keeps at most 128 columns (O_COLS_F64: a larger
    # d_v runs in 128-column launches). Q [BM, D + 8] dominates shared memory: BM 32 above
    # D = 192 on the big class (sm_80's 163 KB), 16 on the small one (99 KB).
    ("big", 8): {32: (64, 64, 4), 64: (64, 32, 4), 96: (64, 32, 4), 128: (64, 32, 4),
                 160: (64, 16, 4), 192: (64, 16, 4), 224: (32, 16, 2), 256: (32, 16, 2)},
    ("small", 8): {32: (64, 64, 4), 64: (64, 32, 4), 96: (64, 16, 4), 128: (32, 16, 2),
                   160: (32, 16, 2), 192: (32, 16, 2), 224: (16, 16, 1), 256: (16, 16, 1)},
}

#: float64: the O accumulator's columns per launch (Pitch<f64_t, D>::OCols in fwd.cu)
O_COLS_F64 = 128


#: GENERAL template bits of flash_fwd (common/params.cuh): varlen alone runs on the plain tiles; a bias
#: or mask takes GEN_VARLEN | GEN_BIAS_MASK on the ``general`` tiles.
GEN_VARLEN, GEN_BIAS_MASK = 1, 2
GEN_ALL = GEN_VARLEN | GEN_BIAS_MASK


@dataclass(frozen=True)
class Variant(KernelVariant):
    """One template instantiation of flash_fwd."""

    elem: str
    d: int
    bm: int
    bn: int
    nw: int
    window: bool
    score_mod: bool
    stages: int = 1      # K buffers (KSTAGES)
    general: int = 0     # GENERAL bits: GEN_VARLEN (1), GEN_BIAS_MASK (2); window, score_mod set

    template = "flash_fwd"
    file = "portable/fwd.cu"

    def template_args(self) -> tuple:
        b = cpp_bool
        gen = (str(int(self.general)),) if self.general else ()   # the template's default is 0
        return (self.elem, str(self.d), str(self.bm), str(self.bn), str(self.nw), str(self.stages),
                b(self.window), b(self.score_mod)) + gen

    @property
    def name(self) -> str:
        """Short human-readable name, returned by fwd.forward."""
        if self.general:
            flags = "_gen" if self.general & GEN_BIAS_MASK else "_varlen"
        else:
            flags = ("_window" if self.window else "") + ("_mod" if self.score_mod else "")
        st = "s2" if self.stages == 2 else ""
        return f"fwd_{self.elem[:-2]}_d{self.d}_{self.bm}x{self.bn}w{self.nw}{st}{flags}"

    @property
    def threads(self) -> int:
        return 32 * self.nw

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.elem, self.d, self.bm, self.bn, self.stages)


def smem_bytes(elem: str, d: int, bm: int, bn: int, stages: int = 1) -> int:
    """Dynamic shared memory of flash_fwd: Q [BM, D+pad], K [stages, BN, D+pad], V [BN, D+pad'].

    Mirrors Pitch<E, D> in portable/fwd.cu: 16-bit rows padded by 8 elements, float32 Q/K rows
    by 8 and V rows by 4 floats, float64 Q/K rows by 8 and V rows (at most O_COLS_F64 columns)
    by 2.
    """
    es = ELEM_SIZE[elem]
    pqk = d + 8
    pv = d + 8 if es == 2 else (min(d, O_COLS_F64) + 2 if es == 8 else d + 4)
    return (bm * pqk + stages * bn * pqk + bn * pv) * es


def tiles(elem: str, d_bucket: int, smem_optin: int,
          general: int = 0) -> Tuple[int, int, int, int]:
    """(BM, BN, warps, K stages): 16-bit types take two K buffers wherever they fit.

    ``general`` with GEN_BIAS_MASK (bias / mask): where the plain tile gives each warp two 16-row slabs
    (MT = 2, 255 registers), the GENERAL kernel takes twice the warps with one slab each: its bias
    and mask reads need registers, and MT = 2 spills 0.5-0.9 KB there (ptxas, docs/kernels.md).
    """
    bm, bn, nw = _TILES[(smem_class(smem_optin), ELEM_SIZE[elem])][d_bucket]
    if general & GEN_BIAS_MASK and bm // (16 * nw) == 2:
        nw *= 2
    # float32 keeps one K buffer: occupancy matters more there (measured 26.5 vs 21.6 TFLOP/s)
    stages = 2 if ELEM_SIZE[elem] == 2 and smem_bytes(elem, d_bucket, bm, bn, 2) <= smem_optin else 1
    return bm, bn, nw, stages


def variants(smem_optin: int = SM90_SMEM_MAX):
    """Every Variant the planner can select on a device with this shared-memory limit."""
    out = []
    for elem in ELEMS:
        for dbk in HEAD_DIM_BUCKETS:
            bm, bn, nw, st = tiles(elem, dbk, smem_optin)
            for window in (False, True):
                for mod in (False, True):
                    out.append(Variant(elem, dbk, bm, bn, nw, window, mod, st))
            out.append(Variant(elem, dbk, bm, bn, nw, True, True, st, GEN_VARLEN))
            bm, bn, nw, st = tiles(elem, dbk, smem_optin, general=GEN_ALL)
            out.append(Variant(elem, dbk, bm, bn, nw, True, True, st, GEN_ALL))
    return out


class Plan(NamedTuple):
    variant: Variant
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    smem: int
    params: np.ndarray   # 0-d PARAMS_DTYPE array: sizes and scalars filled, pointers/strides not
    #: Hopper forward SPLIT variants: the work items (sm90_work_items), else None
    split: Optional[np.ndarray] = None


def plan_forward(dtype_name: str, b: int, s_q: int, s_k: int, h: int, h_k: int, d: int,
                 d_v: int, *, scale: float, window_left: int = -1, window_right: int = -1,
                 bottom_right: bool = True, softcap: float = 0.0, has_alibi: bool = False,
                 allow_tf32: bool = False, smem_optin: int = SM90_SMEM_MAX,
                 variant: Optional[Variant] = None, has_bias: bool = False,
                 has_mask: bool = False, varlen: bool = False) -> Plan:
    """Choose the kernel variant and launch shape; fill the size/scalar fields of Params.

    A bias, a mask or varlen selects the GENERAL variant (bias / mask pointers and strides are the
    launcher's to fill, like the other pointers).
    """
    if h % h_k:
        raise ValueError(f"heads {h} is not a multiple of heads_k {h_k}")
    if min(b, s_q, s_k, h, h_k, d, d_v) < 1:
        raise ValueError("empty problem: the launcher handles zero sizes before planning")
    elem = elem_tag(dtype_name, allow_tf32)
    dbk = head_dim_bucket(d, d_v)
    general = GEN_ALL if has_bias or has_mask else (GEN_VARLEN if varlen else 0)
    window = window_left >= 0 or window_right >= 0 or general
    score_mod = softcap > 0 or has_alibi or not scale > 0 or general
    if variant is None:
        bm, bn, nw, st = tiles(elem, dbk, smem_optin, general)
        variant = Variant(elem, dbk, bm, bn, nw, window, score_mod, st, general)
    else:   # forced variant (benchmarks, tests): must still be able to compute this problem
        if (variant.elem != elem or variant.d < max(d, d_v) or (window and not variant.window)
                or (score_mod and not variant.score_mod)
                or (variant.general & general) != general):
            raise ValueError(f"kernel {variant.name} cannot compute this problem")
    if variant.smem_bytes > smem_optin:
        raise NotImplementedError(
            f"{variant.name} needs {variant.smem_bytes} bytes of shared memory; the device "
            f"allows {smem_optin}")
    prm, grid = sizes_and_scalars(variant.bm, b, s_q, s_k, h, h_k, d, d_v, scale, window_left,
                                   window_right, bottom_right, softcap)
    return Plan(variant, grid, (variant.threads, 1, 1), variant.smem_bytes, prm)


def plan_forward_varlen(dtype_name: str, batch: int, total_q: int, total_k: int,
                        max_seqlen_q: int, max_seqlen_k: int, h: int, h_k: int, d: int, d_v: int,
                        *, scale: float, window_left: int = -1, window_right: int = -1,
                        bottom_right: bool = True, softcap: float = 0.0, has_alibi: bool = False,
                        allow_tf32: bool = False, smem_optin: int = SM90_SMEM_MAX) -> Plan:
    """The GENERAL variant over ``batch`` packed sequences: grid (ceil(max_seqlen_q / BM), h,
    batch); blocks past their sequence's end exit at once. Params: b = 1, s_q / s_k = the packed
    totals (lse is [1, h, total_q]); each block reads its own lengths from cu_seqlens and aligns
    its causal / window diagonal to them (``varlen_bottom_right``). The launcher sets the
    cu_seqlens pointers and zero batch strides. Requires max_seqlen_q >= 1, total_k >= 1.
    """
    plan = plan_forward(dtype_name, 1, max(1, max_seqlen_q), max(1, max_seqlen_k), h, h_k, d,
                        d_v, scale=scale, window_left=window_left, window_right=window_right,
                        bottom_right=bottom_right, softcap=softcap, has_alibi=has_alibi,
                        allow_tf32=allow_tf32, smem_optin=smem_optin, varlen=True)
    v = plan.variant
    prm = plan.params
    varlen_params(prm, total_q, total_k, window_left, window_right, bottom_right)
    if batch > 65535:
        raise NotImplementedError(f"{batch} sequences exceed CUDA's grid limit (65535)")
    grid = (plan.grid[0], h, batch)
    return Plan(v, grid, plan.block, plan.smem, prm)


def flops(b: int, h: int, s_q: int, s_k: int, d: int, d_v: int, causal: bool = False) -> float:
    """FlashAttention's count: 2·b·h·s_q·s_k·(d + d_v), halved for causal."""
    f = 2.0 * b * h * s_q * s_k * (d + d_v)
    return f / 2 if causal else f
