"""Portable backward planner (pure Python): flash_bwd / flash_bwd_pre / flash_bwd_dq (kernels_cu/portable/bwd.cu)
variants, tiles and launch shapes; deterministic dQ slabs; varlen; how dS is reduced into dbias
(``dbias_plan``, ``hopper_dbias_mode``) and the flash_bwd_dbias kernel's variants.

The kernels, launched in order on the current stream by bwd.py:

1. ``flash_bwd_pre<E>``: D = rowsum(dO ∘ O) [b, h, s_q] float32; zeroes the float32 dQ
   accumulator [b, h, s_q, d] (atomic mode).
2. ``flash_bwd<E, D, BM, NW, WD, NBUF, WINDOW, SCORE_MOD>``: one block per (key tile of
   BN = 16·NW/WD keys, kv head, batch); dK, dV in registers over every query head of the group
   and every query tile that sees the key tile (GQA sums in a fixed order, no atomics);
   dQ += dS K into the accumulator with red.global.add.f32, or, when ``opts.deterministic``,
   added in program order into slab x of a zeroed [G, b, h, s_q, d] float32 buffer by block x,
   which takes key tiles x, x + G, ... (``with_dq_slabs``: G blocks per (kv head, batch)).
3. ``flash_bwd_dq<E>``: dq = dtype(accumulator); deterministic mode sums the G slabs in order.
4. (with a bias, where ``dbias_by_kernel`` allows and ``use_dbias_kernel`` takes it) the dbias
   kernel: each dbias tile summed over its broadcast (batch, head) pairs in registers, stored
   once; on compute capability 9.0 ``flash_bwd_dbias_sm90`` (plan_dbias_sm90) where it covers
   the call, else ``flash_bwd_dbias`` (``DbiasVariant``).

Extra device memory: D (4·b·h·s_q bytes) and the accumulator (4·b·h·s_q·d bytes), times
G = min(ceil(s_k / BN), resident blocks / (h_k · b)) in deterministic mode (see docs/backward.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import numpy as np

from . import plan_fwd
from .params import problem_params
from .tuning import TUNING
from .variants import (ACC_SIZE, ELEM_SIZE, ELEMS, HEAD_DIM_BUCKETS, SM90_SMEM_MAX, KernelVariant, cpp_bool,
                       elem_tag, head_dim_bucket, smem_class)


# (BM, NW, WD, NBUF) per (shared-memory class, element size) and head-dim bucket.
# BN = 16·NW/WD keys per block. Each warp holds dK and dV for 16 keys x D/WD columns in
# registers (D/WD floats per lane) plus Sᵀ and dPᵀ (BM/2 floats each); WD = 2 above 128 keeps
# that under the 255-register limit. Chosen from the ptxas reports (tests/compile/test_compile_bwd.py).
_TILES = {
    ("big", 2): {32: (64, 8, 1, 2), 64: (64, 8, 1, 2), 96: (64, 8, 1, 2), 128: (32, 8, 1, 2),
                 160: (64, 8, 2, 2), 192: (32, 8, 2, 2), 224: (64, 8, 2, 1), 256: (32, 8, 2, 2)},
    ("small", 2): {32: (64, 8, 1, 2), 64: (64, 8, 1, 1), 96: (64, 8, 1, 1), 128: (32, 8, 1, 1),
                   160: (64, 8, 2, 1), 192: (32, 8, 2, 1), 224: (64, 4, 2, 1), 256: (32, 4, 2, 1)},
    ("big", 4): {32: (32, 4, 1, 2), 64: (32, 4, 1, 2), 96: (32, 4, 2, 2), 128: (32, 4, 1, 1),
                 160: (32, 4, 2, 1), 192: (32, 4, 2, 1), 224: (16, 4, 2, 1), 256: (16, 4, 2, 1)},
    ("small", 4): {32: (32, 4, 1, 2), 64: (32, 4, 1, 1), 96: (32, 4, 2, 1), 128: (32, 4, 2, 1),
                   160: (32, 4, 2, 1), 192: (32, 4, 4, 1), 224: (16, 4, 2, 1), 256: (16, 4, 4, 1)},
    # float64: every accumulator is two registers, so dK + dV (D / WD doubles per lane) and
    # Sᵀ + dPᵀ (BM doubles) fit by a larger WD and BM 16 (the tiles without spills in the plain
    # variants, ptxas sm_80 / sm_90a); shared memory (8-byte elements) bounds BN · D. The small
    # class (99 KB) holds no float64 tile above D = 160: those calls raise NotImplementedError
    # (device="auto" with NumPy inputs: the CPU).
    ("big", 8): {32: (32, 4, 1, 2), 64: (16, 8, 2, 1), 96: (16, 4, 4, 1), 128: (16, 8, 4, 1),
                 160: (16, 4, 4, 1), 192: (16, 8, 8, 1), 224: (16, 7, 7, 1), 256: (16, 8, 8, 1)},
    ("small", 8): {32: (32, 4, 1, 1), 64: (16, 4, 2, 1), 96: (16, 4, 4, 1), 128: (16, 4, 4, 1),
                   160: (16, 4, 4, 1), 192: (16, 8, 8, 1), 224: (16, 7, 7, 1), 256: (16, 8, 8, 1)},
}


@dataclass(frozen=True)
class BwdVariant(KernelVariant):
    """One template instantiation of flash_bwd (16-key slabs per warp, ``wms`` = 0) or of
    flash_bwd_2d (16-bit types: FlashAttention-2's 2-D warp tiles, P and dS through shared
    memory; ``wd`` = 1, BN = 16·NW). ``wms`` / ``wnkv`` / ``wmq``: warps over the queries of
    S / dP, over the keys of dK / dV, over the queries of dQ (the rest of the NW warps split the
    other dimension)."""

    elem: str
    d: int
    bm: int
    nw: int
    wd: int
    nbuf: int
    window: bool
    score_mod: bool
    general: bool = False   # GENERAL: bias (+ dbias) / mask / varlen (window and score_mod set)
    wms: int = 0            # flash_bwd_2d's warp grids (0: flash_bwd)
    wnkv: int = 0
    wmq: int = 0
    pair: bool = False      # flash_bwd_2d: S with dP, dV with dK in one k loop each (not timed)

    @property
    def bn(self) -> int:
        return 16 * self.nw // self.wd

    file = "portable/bwd.cu"

    @property
    def template(self) -> str:
        return "flash_bwd_2d" if self.wms else "flash_bwd"

    def template_args(self) -> tuple:
        b = cpp_bool
        if self.wms:
            pair = ("true",) if self.pair else ()   # the template's default is false
            return (self.elem, str(self.d), str(self.bm), str(self.nw), str(self.wms),
                    str(self.wnkv), str(self.wmq), str(self.nbuf), b(self.window),
                    b(self.score_mod)) + pair
        gen = ("true",) if self.general else ()   # the template's default is false
        return (self.elem, str(self.d), str(self.bm), str(self.nw), str(self.wd), str(self.nbuf),
                b(self.window), b(self.score_mod)) + gen

    @property
    def pre_expression(self) -> str:
        return f"flash_bwd_pre<{self.elem}>"

    @property
    def dq_expression(self) -> str:
        return f"flash_bwd_dq<{self.elem}>"

    @property
    def helper_expressions(self):
        return (self.pre_expression, self.dq_expression)

    @property
    def name(self) -> str:
        if self.general:
            flags = "_gen"
        else:
            flags = ("_window" if self.window else "") + ("_mod" if self.score_mod else "")
        warps = (f"t{self.wms}{self.wnkv}{self.wmq}" + ("p" if self.pair else "")
                 if self.wms else f"s{self.wd}")
        return (f"bwd_{self.elem[:-2]}_d{self.d}_{self.bm}x{self.bn}w{self.nw}"
                f"{warps}b{self.nbuf}{flags}")

    @property
    def threads(self) -> int:
        return 32 * self.nw

    @property
    def smem_bytes(self) -> int:
        if self.wms:
            return smem_bytes_2d(self.d, self.bm, self.bn, self.nbuf)
        return smem_bytes(self.elem, self.d, self.bm, self.bn, self.nbuf)

    def check_2d(self) -> None:
        """flash_bwd_2d's static asserts (ValueError): 16-bit, no GENERAL, warp grids that
        tile the block in whole 16x16 fragments."""
        nw, bm, bn, d = self.nw, self.bm, self.bn, self.d
        ok = (self.elem in ("f16_t", "bf16_t") and self.wd == 1 and not self.general
              and all(w > 0 and nw % w == 0 for w in (self.wms, self.wnkv, self.wmq))
              and all(x % 16 == 0 for x in (bm // self.wms, bn // (nw // self.wms),
                                            bn // self.wnkv, d // (nw // self.wnkv),
                                            bm // self.wmq, d // (nw // self.wmq)))
              and self.nbuf in (1, 2))
        if not ok:
            raise ValueError(f"{self.name}: not a flash_bwd_2d tiling")


def smem_bytes_2d(d: int, bm: int, bn: int, nbuf: int) -> int:
    """flash_bwd_2d's dynamic shared memory (16-bit types): K, V [BN, d + 8], NBUF x (Q, dO
    [BM, d + 8]), P, dS [BM, BN + 8], NBUF x (lse, D [BM] float32). Mirrors portable/bwd.cu."""
    pr = d + 8
    return (2 * bn * pr + 2 * nbuf * bm * pr + 2 * bm * (bn + 8)) * 2 + 2 * nbuf * bm * 4


def smem_bytes(elem: str, d: int, bm: int, bn: int, nbuf: int) -> int:
    """flash_bwd's dynamic shared memory: K, V [BN, pitch], NBUF x (Q, dO [BM, pitch]),
    dSᵀ [BN, BM + pad], NBUF x (lse, D [BM] in the accumulator type: float32, float64 for
    float64). Mirrors BwdPitch / DsPitch in portable/bwd.cu."""
    es = ELEM_SIZE[elem]
    pr = d + 8 if es == 2 else d + 4
    pds = bm + 8 if es == 2 else bm + 4
    return (2 * bn * pr + 2 * nbuf * bm * pr + bn * pds) * es + 2 * nbuf * bm * ACC_SIZE[elem]


# float64 where shared memory allows twice the key tile (sm_90's 227 KB): WD halved, so each
# warp recomputes Sᵀ / dPᵀ half as often, at the cost of a few spilled registers (136 / 176 B):
# H100, hd 64 / 128, seqlen 4096: 20.9 / 16.0 vs 14.2 / 10.1 TFLOP/s for the _TILES choice.
_TILES_F64_WIDE = {64: (16, 8, 1, 1), 128: (16, 8, 2, 1)}


def tiles(elem: str, d_bucket: int, smem_optin: int,
          general: bool = False) -> Tuple[int, int, int, int]:
    """(BM, NW, WD, NBUF); ``general`` (bias / mask / varlen) uses the same tiles."""
    wide = _TILES_F64_WIDE.get(d_bucket) if elem == "f64_t" and not general else None
    if wide and smem_bytes(elem, d_bucket, wide[0], 16 * wide[1] // wide[2], wide[3]) <= smem_optin:
        return wide
    return _TILES[(smem_class(smem_optin), ELEM_SIZE[elem])][d_bucket]


#: flash_bwd_2d tiles (BM, NW, WMS, WNKV, WMQ, NBUF) per shared-memory class and head-dim
#: bucket (16-bit types; BN = 16·NW), first choice first: the first that fits the device's
#: shared memory is taken (none above hd 128: flash_bwd there).
#: Big class (sm_80 163 KB, sm_90 227 KB): hd 64 FlashAttention-2's tile (BM 128, 8 warps: S / dP
#: warp tiles 32 x 64, dK / dV and dQ 32 x 32); hd 128 BM 64 (S / dP 32 x 32, dK / dV 32 x 64,
#: dQ 32 x 32); the fallbacks fit sm_80's 163 KB with two buffers.
#: Small class (99 KB: sm_86, sm_89, sm_120): the tiles of the big class's timing table
#: (docs/backward.md "Speed") that fit 99 KB with the padded pitches: hd 64 BM 64 x BN 128 with
#: one Q / dO buffer (90.6 KB; two buffers need 107 KB), hd 128 BM 32 x BN 64 (79 KB: BM 64 x
#: BN 128 needs 175 KB); hd 32 and 96 (not timed) the same warp tiles at their head dims
#: (75 / 97 KB).
_TILES_2D = {
    "big": {
        32: ((128, 8, 4, 4, 4, 2),),
        64: ((128, 8, 4, 4, 4, 2), (64, 8, 2, 4, 2, 2)),
        96: ((64, 8, 2, 4, 4, 2),),
        128: ((64, 8, 2, 4, 2, 2), (32, 4, 2, 2, 2, 2)),
    },
    "small": {
        32: ((64, 8, 2, 4, 4, 2),),
        64: ((64, 8, 2, 4, 2, 1), (64, 4, 2, 2, 2, 2)),
        96: ((64, 4, 2, 2, 2, 2),),
        128: ((32, 4, 2, 2, 2, 2),),
    },
}


def variant_2d(elem: str, d_bucket: int, smem_optin: int, window: bool,
               score_mod: bool) -> Optional[BwdVariant]:
    """The flash_bwd_2d variant for a 16-bit call without GENERAL features, or None (float32 /
    float64, a bucket above 128, or no tile fits ``smem_optin``)."""
    tiles_2d = _TILES_2D[smem_class(smem_optin)]
    if ELEM_SIZE[elem] != 2 or d_bucket not in tiles_2d:
        return None
    for bm, nw, wms, wnkv, wmq, nbuf in tiles_2d[d_bucket]:
        if smem_bytes_2d(d_bucket, bm, 16 * nw, nbuf) <= smem_optin:
            return BwdVariant(elem, d_bucket, bm, nw, 1, nbuf, window, score_mod, False,
                              wms, wnkv, wmq)
    return None


def variants(smem_optin: int = SM90_SMEM_MAX):
    """Every BwdVariant the planner can select on a device with this shared-memory limit
    (flash_bwd's, then flash_bwd_2d's: ``TUNING.portable_bwd_2d`` picks between them)."""
    out = []
    for elem in ELEMS:
        for dbk in HEAD_DIM_BUCKETS:
            bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin)
            if smem_bytes(elem, dbk, bm, 16 * nw // wd, nbuf) > smem_optin:
                continue   # (float64 above D = 160 on the small class)
            for window in (False, True):
                for mod in (False, True):
                    out.append(BwdVariant(elem, dbk, bm, nw, wd, nbuf, window, mod))
            bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin, general=True)
            out.append(BwdVariant(elem, dbk, bm, nw, wd, nbuf, True, True, True))
    for elem in ELEMS:
        for dbk in HEAD_DIM_BUCKETS:
            for window in (False, True):
                for mod in (False, True):
                    v = variant_2d(elem, dbk, smem_optin, window, mod)
                    if v is not None:
                        out.append(v)
    return out


class BwdPlan(NamedTuple):
    variant: BwdVariant
    grid: Tuple[int, int, int]          # flash_bwd: (num_n_blocks, h_k, b)
    block: Tuple[int, int, int]
    smem: int
    pre_grid: Tuple[int, int, int]      # flash_bwd_pre: 8 rows per 256-thread block
    dq_grid: Tuple[int, int, int]       # flash_bwd_dq: grid-stride over b·h·s_q·d
    accum_elems: int                    # float32 elements of the dQ accumulator (all slabs)
    params: np.ndarray                  # 0-d PARAMS_DTYPE: sizes and scalars filled


def plan_backward(dtype_name: str, b: int, s_q: int, s_k: int, h: int, h_k: int, d: int,
                  d_v: int, *, scale: float, window_left: int = -1, window_right: int = -1,
                  bottom_right: bool = True, softcap: float = 0.0, has_alibi: bool = False,
                  allow_tf32: bool = False, deterministic: bool = False,
                  smem_optin: int = SM90_SMEM_MAX, num_sms: int = 132,
                  variant: Optional[BwdVariant] = None, has_bias: bool = False,
                  has_mask: bool = False, varlen: bool = False) -> BwdPlan:
    """Choose the backward variant and launch shapes; fill the size/scalar fields of Params.

    A bias, a mask or varlen selects the GENERAL variant (the launcher fills their pointers,
    strides and the dbias mode: ``dbias_plan``)."""
    if h % h_k:
        raise ValueError(f"heads {h} is not a multiple of heads_k {h_k}")
    if min(b, s_q, s_k, h, h_k, d, d_v) < 1:
        raise ValueError("empty problem: the launcher handles zero sizes before planning")
    elem = elem_tag(dtype_name, allow_tf32)
    dbk = head_dim_bucket(d, d_v)
    general = has_bias or has_mask or varlen
    window = window_left >= 0 or window_right >= 0 or general
    score_mod = softcap > 0 or has_alibi or general
    if variant is None and TUNING.portable_bwd_2d and not general:
        variant = variant_2d(elem, dbk, smem_optin, window, score_mod)
    if variant is None:
        bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin, general)
        variant = BwdVariant(elem, dbk, bm, nw, wd, nbuf, window, score_mod, general)
    elif (variant.elem != elem or variant.d < max(d, d_v) or (window and not variant.window)
          or (score_mod and not variant.score_mod) or (general and not variant.general)):
        raise ValueError(f"kernel {variant.name} cannot compute this problem")
    if variant.wms:
        variant.check_2d()
    if variant.smem_bytes > smem_optin:
        raise NotImplementedError(
            f"{variant.name} needs {variant.smem_bytes} bytes of shared memory; the device "
            f"allows {smem_optin}")
    num_n = -(-s_k // variant.bn)
    if h_k > 65535 or b > 65535:
        raise NotImplementedError(f"grid ({num_n}, {h_k}, {b}) exceeds CUDA's grid limits")
    rows = b * h * s_q
    prm = problem_params(variant.bm, b, s_q, s_k, h, h_k, d, d_v, scale, window_left,
                         window_right, bottom_right, softcap)
    prm["num_n_blocks"] = num_n
    prm["bn"] = variant.bn
    prm["deterministic"] = int(bool(deterministic))
    prm["dq_accum_slab"] = rows * d
    dq_blocks = max(1, min(-(-rows * d // 256), num_sms * 8))
    plan = BwdPlan(variant, (num_n, h_k, b), (variant.threads, 1, 1), variant.smem_bytes,
                   (-(-rows // 8), 1, 1), (dq_blocks, 1, 1), rows * d, prm)
    return with_dq_slabs(plan, 2 * num_sms)


def with_dq_slabs(plan: BwdPlan, resident_blocks: int) -> BwdPlan:
    """Deterministic mode: flash_bwd's grid x becomes the dQ slab count G, the most blocks
    (G · kv heads · batch) that are resident at once (``resident_blocks``: SMs × blocks per SM;
    the launcher asks the driver, the planner assumes 2 per SM), at least 1 and at most one per
    key tile. Block x adds the dQ parts of key tiles x, x + G, ... into slab x in order, so
    memory is G float32 copies of dq, not one per key tile (s_k / BN copies: at s = 16k, hd 128
    the size of the float32 score matrix), and one wave of blocks takes within a key tile of the
    same work each. Atomic mode: the plan unchanged (grid x = key tiles, one accumulator)."""
    prm = plan.params
    if not prm["deterministic"]:
        return plan
    num_n, per_slab = int(prm["num_n_blocks"]), plan.grid[1] * plan.grid[2]
    g = max(1, min(num_n, resident_blocks // per_slab))
    prm = prm.copy()
    prm["dq_slabs"] = g
    return plan._replace(grid=(g,) + plan.grid[1:], accum_elems=int(prm["dq_accum_slab"]) * g,
                         params=prm)


def plan_backward_varlen(dtype_name: str, batch: int, total_q: int, total_k: int,
                         max_seqlen_q: int, max_seqlen_k: int, h: int, h_k: int, d: int, d_v: int,
                         **kw) -> BwdPlan:
    """The GENERAL backward over ``batch`` packed sequences (keywords as plan_backward).

    flash_bwd grid (ceil(max_seqlen_k / BN), h_k, batch), deterministic (G, h_k, batch): blocks
    past their sequence's keys exit at once. pre / dq kernels see the packed tokens as one batch
    (Params b = 1, s_q = total_q: lse, D and the dQ accumulator are [1, h, total_q]).
    """
    bottom_right = kw.pop("bottom_right", True)
    plan = plan_backward(dtype_name, 1, total_q, max(1, max_seqlen_k), h, h_k, d, d_v,
                         bottom_right=bottom_right, varlen=True, **kw)
    if batch > 65535:
        raise NotImplementedError(f"{batch} sequences exceed CUDA's grid limit (65535)")
    prm = plan.params
    prm["s_k"] = total_k
    prm["diag_offset"] = 0                        # per sequence, from varlen_bottom_right
    prm["varlen_bottom_right"] = int(bool(bottom_right))
    unbounded = total_q + total_k                 # past every sequence's own s_q + s_k
    for side in ("window_left", "window_right"):
        if kw.get(side, -1) < 0:
            prm[side] = unbounded
    return with_dq_slabs(plan._replace(grid=(int(prm["num_n_blocks"]), h_k, batch)),
                         2 * kw.get("num_sms", 132))


class DbiasPlan(NamedTuple):
    """How flash_bwd reduces dS into dbias for one bias shape (see dbias_plan)."""

    mode: int                     # Params.dbias_mode (DBIAS_* bits of common/params.cuh), -1: zero
    slabs: int                    # float32 slabs of the reduced shape
    shape: Tuple[int, ...]        # the bias's 4-D shape (each dimension 1 or full)
    strides: Tuple[int, ...]      # element strides inside one slab, 0 along size-1 dims

DBIAS_ROWS, DBIAS_ATOMIC, DBIAS_SLAB_B, DBIAS_SLAB_H = 1, 2, 4, 8
DBIAS_STORE = 16   # Hopper backward only: each element has one writer, plain stores
DBIAS_SCHED_B = 32  # Hopper backward only: work tiles batch-fastest (dbias summed over batch)


def hopper_dbias_mode(dplan: "DbiasPlan", b: int, h: int) -> int:
    """Params.dbias_mode for the Hopper backward: dbias_plan's bits, plus DBIAS_STORE where each
    element has one writer (single_writer) and DBIAS_SCHED_B where dbias sums over a batch > 1
    (the blocks adding into the same dbias tile then run at the same time: L2 hits, not a
    read of the float32 accumulator from DRAM per batch entry)."""
    mode = dplan.mode
    if single_writer(dplan.shape, b, h):
        mode |= DBIAS_STORE
    if TUNING.hopper_sched_b and dplan.shape[0] == 1 and b > 1 and dplan.shape[2] > 1:
        mode |= DBIAS_SCHED_B
    return mode


def single_writer(bias_shape, b: int, h: int) -> bool:
    """Each dbias element receives dS from exactly one (batch, head, query) (so the Hopper
    backward stores it, DBIAS_STORE): no broadcast dimension of the bias is summed over (a size-1
    dimension of the bias counts as summed unless the problem's extent there is 1 too), and the
    query dimension is not broadcast (DBIAS_ROWS sums a step's rows)."""
    shape = tuple(int(n) for n in bias_shape)
    return (shape[2] > 1 and (shape[0] > 1 or b == 1) and (shape[1] > 1 or h == 1)
            and shape[3] > 1)


def dbias_plan(bias_shape, b: int, h_k: int, deterministic: bool) -> DbiasPlan:
    """dbias = dS summed over the bias's broadcast dimensions, by flash_bwd.

    * key dimension broadcast (shape[3] == 1): dbias is exactly 0 (a per-row constant does not
      change a softmax: Σ_j dS_ij = Σ_j P_ij dP_ij − D_i = 0), mode -1: the launcher zero-fills.
    * row dimension broadcast: each warp sums its rows per key first (DBIAS_ROWS).
    * one flash_bwd block owns a key tile of one (batch, kv head): contributions to one element
      from other blocks exist only over a broadcast batch (b > 1) or a broadcast head dim
      (h_k > 1). Then: float atomics into one slab, or, deterministic, one slab per such block
      coordinate (DBIAS_SLAB_B / _H), summed in order afterwards. Otherwise one owner lane per
      element adds in program order (no atomics, deterministic).
    """
    shape = tuple(int(n) for n in bias_shape)
    if shape[3] == 1:
        return DbiasPlan(-1, 0, shape, (0, 0, 0, 0))
    mode = DBIAS_ROWS if shape[2] == 1 else 0
    by_b = shape[0] == 1 and b > 1
    by_h = shape[1] == 1 and h_k > 1
    slabs = 1
    if deterministic:
        mode |= (DBIAS_SLAB_B if by_b else 0) | (DBIAS_SLAB_H if by_h else 0)
        slabs = (b if by_b else 1) * (h_k if by_h else 1)
    elif by_b or by_h:
        mode |= DBIAS_ATOMIC
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(0 if n == 1 else acc)
        acc *= n
    return DbiasPlan(mode, slabs, shape, tuple(reversed(strides)))


@dataclass(frozen=True)
class DbiasVariant(KernelVariant):
    """One instantiation of flash_bwd_dbias (portable/bwd.cu): dbias planes summed in registers."""

    elem: str
    d: int        # head-dim bucket (covers d and d_v)
    bm: int       # queries per tile (BM / 16 warps)
    bn: int       # keys per tile
    nbuf: int = 1  # 2: the next (batch, head) pair's tiles load while this one is computed

    template = "flash_bwd_dbias"
    file = "portable/bwd.cu"

    def template_args(self) -> tuple:
        return (self.elem, str(self.d), str(self.bm), str(self.bn), str(self.nbuf))

    @property
    def helper_expressions(self):
        return ()

    @property
    def name(self) -> str:
        return f"bwd_dbias_{self.elem[:-2]}_d{self.d}_{self.bm}x{self.bn}b{self.nbuf}"

    @property
    def threads(self) -> int:
        return 32 * (self.bm // 16)

    @property
    def smem_bytes(self) -> int:
        """NBUF x (Q, dO [BM, pitch], K, V [BN, pitch], lse and D [BM] float32); BwdPitch in portable/bwd.cu."""
        es = ELEM_SIZE[self.elem]
        pr = self.d + 8 if es == 2 else self.d + 4
        return self.nbuf * ((2 * self.bm + 2 * self.bn) * pr * es + 2 * self.bm * 4)


#: flash_bwd_dbias tiles (BM, BN, NBUF), first choice first: the first whose shared memory fits
#: the device (two buffers: one block per SM whose loads overlap its own products) or, with one
#: buffer, DBIAS_SMEM_CAP (at most half an H100 / H200 SM: blocks overlap each other instead).
DBIAS_TILES = ((128, 64, 2), (64, 64, 1), (64, 32, 1), (32, 32, 1), (32, 16, 1), (16, 16, 1))
DBIAS_SMEM_CAP = 112 * 1024


def dbias_variant(elem: str, d_bucket: int,
                  smem_optin: int = SM90_SMEM_MAX) -> DbiasVariant:
    """The flash_bwd_dbias instantiation for this element type and head-dim bucket."""
    for bm, bn, nbuf in DBIAS_TILES:
        v = DbiasVariant(elem, d_bucket, bm, bn, nbuf)
        if v.smem_bytes <= (smem_optin if nbuf == 2 else min(smem_optin, DBIAS_SMEM_CAP)):
            return v
    raise NotImplementedError(f"no flash_bwd_dbias tile fits {smem_optin} bytes of shared memory")


def dbias_variants(smem_optin: int = SM90_SMEM_MAX):
    """Every DbiasVariant the launcher can select on a device with this shared-memory limit."""
    return [dbias_variant(e, d, smem_optin) for e in ELEMS if e != "f64_t" for d in HEAD_DIM_BUCKETS]


def dbias_by_kernel(dplan: DbiasPlan, bias_dtype, operand_dtype, dbias_direct: bool) -> bool:
    """Whether flash_bwd_dbias can give dbias (a tile per block, the broadcast pairs summed in
    registers, stored once in the bias's type; flash_bwd then writes none) instead of
    flash_bwd's float32 accumulator: a bias with whole query and key dimensions (shape[2],
    shape[3] > 1) whose dbias is not its own float32 accumulator (``dbias_direct``: float32,
    contiguous, one slab), when the kernels read the bias itself (``operand_dtype`` = the bias's
    dtype, so dbias is written in the type the kernel reads). Extra memory is then dbias only
    (no float32 copy, no deterministic slabs), at the cost of recomputing S and dP
    (``use_dbias_kernel`` decides whether an eligible call takes it). A bias broadcast over the
    query rows (DBIAS_ROWS, a float32 accumulator of b'·h'·s_k elements) and a bias of another
    dtype than q / float32 keep flash_bwd's accumulator."""
    if dplan.mode < 0 or dplan.shape[2] == 1 or dbias_direct:
        return False
    return np.dtype(bias_dtype) == np.dtype(operand_dtype)


def use_dbias_kernel(forced: Optional[bool], deterministic: bool, hopper_dbias: bool) -> bool:
    """Whether an eligible call (``dbias_by_kernel``) takes the dbias-kernel path before trying the
    float32 accumulator: ``forced`` (TUNING.dbias_kernel) when not None; else in deterministic mode (no
    slabs, same bits every run) and where the Hopper dbias kernel covers the call
    (``hopper_dbias``; measured on the H200: the whole bias backward 1.15-1.48x faster
    than with the accumulator, and dbias is then the only extra memory). The portable
    flash_bwd_dbias is slower than the accumulator (0.57-0.78x), so elsewhere the accumulator is
    tried first and the kernel runs only when it does not fit."""
    if forced is not None:
        return bool(forced)
    return bool(deterministic) or bool(hopper_dbias)


def query_tiles(n_block: int, bn: int, bm: int, s_q: int, s_k: int, window_left: int,
                window_right: int, diag_offset: int, window: bool = True) -> range:
    """Query tiles flash_bwd visits for key tile ``n_block`` (mirror of the kernel's i_lo/i_hi):
    those holding a row i that keeps some key j of the tile, i + off − left <= j <= i + off + right.
    Window sides are Params values (unbounded = s_q + s_k)."""
    n0 = n_block * bn
    n_rows = min(bn, s_k - n0)
    i_lo, i_hi = 0, s_q - 1
    if window:
        i_lo = max(0, n0 - diag_offset - window_right)
        i_hi = min(s_q - 1, n0 + n_rows - 1 - diag_offset + window_left)
    if i_hi < i_lo:
        return range(0)
    return range(i_lo // bm, i_hi // bm + 1)


def flops(b: int, h: int, s_q: int, s_k: int, d: int, d_v: int, causal: bool = False) -> float:
    """Backward FLOPs by FlashAttention's count: 2.5 x the forward's."""
    return 2.5 * plan_fwd.flops(b, h, s_q, s_k, d, d_v, causal)
