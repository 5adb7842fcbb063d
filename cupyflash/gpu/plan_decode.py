"""Planner of the split-KV decode kernels (kernels_cu/portable/decode.cu): variants, tile sizes, GQA packing,
the split count, and the DecodeParams record. Pure Python (NumPy): runs without a GPU.

One CTA of ``flash_decode`` covers one (split, kv head, batch entry x packed-row tile). The packed
rows are the query heads of one kv group times the query rows (row r = qi * g + head in group),
16 * MT of them per CTA, so a group's heads share one pass over their keys and values (GQA
packing). Inside a CTA each of NW warps streams its own 16-key K / V tiles through a STAGES-deep
cp.async ring.

Split count (``num_splits=0``): the cache is read once, so the time is the bytes over the
bandwidth reached; that needs every SM busy with enough bytes in flight. With ``ctas`` CTAs per
split (batch x kv heads x row tiles), ``slots`` CTAs resident on the GPU (SMs x CTAs per SM) and
s splits, the grid runs ``waves = ceil(ctas * s / slots)`` waves, each CTA reading 1/s of its
keys at the bandwidth's per-slot share and paying a fixed cost (launch, ring prologue, warp
merge, partial store: CTA_FIXED_S). In units of one unsplit CTA's read time::

    cost(s) = waves(s) * (1 / s + CTA_FIXED_S * HBM_BYTES_PER_S / (key bytes of one CTA * slots))

``choose_splits`` takes the s in 1..s_max with the least cost (the smallest on ties), s_max
keeping every split at >= 8 tiles per warp (512 keys at 4 warps) and <= 128 splits. On the H200
(132 SMs, 2 CTAs each at hd 128) this gives 33 splits for 1 x 131k x 32/8, 4 for 8 x 8k x 32/8,
2 for 4 x 32k x 32/32 and 1 for 64 x 4k x 32/32 and 32 x 16k x 32/8.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from .variants import KernelVariant

#: err[0] bits written by kvcache_check (KV_ERR_* in kernels_cu/portable/decode.cu)
ERR_LENGTH, ERR_BLOCK, ERR_ROTARY = 1, 2, 4

#: head dims the attention kernel takes (d = d_v = D exactly; others run the gather path)
DECODE_HEAD_DIMS = (64, 128, 192, 256)
#: element tags of the attention kernels; kvcache_prep also takes float32 storage ("f32x3_t")
DECODE_ELEMS = ("f16_t", "bf16_t")
PREP_ELEMS = ("f16_t", "bf16_t", "f32x3_t")
ELEM_OF = {"float16": "f16_t", "bfloat16": "bf16_t", "float32": "f32x3_t"}

NW = 4               # warps per CTA
TILE_KEYS = 16       # keys per warp tile: a tile never straddles a page (pages are multiples of 16)
MIN_TILES_PER_WARP = 8
MAX_SPLITS = 128
CTA_FIXED_S = 2.5e-6        # fixed cost of one CTA (seconds): prologue, merge, partial store
HBM_BYTES_PER_S = 4.0e12     # bandwidth the cost model assumes (H200 decode class)


# ------------------------------------------------------------------------------------------
# DecodeParams: mirror of `struct DecodeParams` in kernels_cu/portable/decode.cu (same order, C types)
# ------------------------------------------------------------------------------------------
DECODE_PARAMS_FIELDS = (
    [(n, np.uint64) for n in ("q", "k_cache", "v_cache", "o", "lse", "o_part", "lse_part",
                               "cache_seqlens", "block_table", "alibi", "err", "k_new", "v_new",
                               "q_in", "rot_cos", "rot_sin")]
    + [(f"{t}_stride_{a}", np.int64) for t, axes in (("q", "bsh"), ("k", ("blk", "s", "h")),
                                                      ("v", ("blk", "s", "h")), ("o", "bsh"),
                                                      ("kn", "bsh"), ("vn", "bsh"), ("qi", "bsh"))
       for a in axes]
    + [("bt_stride_b", np.int64), ("alibi_stride_b", np.int64)]
    + [(n, np.int32) for n in ("b", "s_q", "h", "h_k", "g", "d", "s_new", "page_size",
                               "num_blocks", "max_blocks", "capacity", "seqlens_const",
                               "num_splits", "num_m_tiles", "window_left", "window_right",
                               "bottom_right", "rot_dim", "rot_interleaved", "rot_q_per_row",
                               "seqlen_ro", "head_fastest", "pad1")]
    + [("split_count", np.uint64)]
    + [(n, np.float32) for n in ("scale_log2", "softcap_pre", "softcap_post", "pad0")]
)
DECODE_PARAMS_DTYPE = np.dtype(DECODE_PARAMS_FIELDS, align=True)


def new_params() -> np.ndarray:
    """A zeroed DecodeParams record (1-element array); window sides unbounded (-1)."""
    prm = np.zeros(1, DECODE_PARAMS_DTYPE)
    prm["window_left"] = prm["window_right"] = -1
    prm["bottom_right"] = 1
    return prm


# ------------------------------------------------------------------------------------------
# variants
# ------------------------------------------------------------------------------------------
def pitch(d: int) -> int:
    """Shared-memory row pitch (elements) of Q / K / V tiles: D + 8 (16 bytes of padding)."""
    return d + 8


def smem_bytes(d: int, mt: int, nw: int, stages: int) -> int:
    """Dynamic shared memory of flash_decode<., d, mt, nw, stages>: the Q tile, then the warps'
    rings (K and V, 16 keys each per stage), which the warp merge (float32 O, m, l) overlays."""
    bm = 16 * mt
    q = bm * pitch(d) * 2
    rings = nw * stages * 2 * TILE_KEYS * pitch(d) * 2
    merge = nw * bm * d * 4 + nw * bm * 2 * 4
    return q + max(rings, merge)


def choose_stages(d: int, mt: int, smem_optin: int, nw: int = NW) -> tuple:
    """(stages, CTAs per SM): c = TUNING["ctas_per_sm"] CTAs per SM with the deepest ring (up to
    6) that fits 1 / c of the opt-in shared memory when that ring is at least 3 deep (c = 2) or 2
    deep (c > 2); else one CTA with the deepest ring that fits (at least 2)."""
    c = int(TUNING["ctas_per_sm"])
    if c >= 2:
        share = smem_optin // c - 1024
        for st in range(6, 2 if c == 2 else 1, -1):
            if smem_bytes(d, mt, nw, st) <= share:
                return st, c
    for st in range(6, 1, -1):
        if smem_bytes(d, mt, nw, st) <= smem_optin:
            return st, 1
    raise ValueError(f"head dim {d}: no decode tile fits {smem_optin} bytes of shared memory")


@dataclass(frozen=True)
class DecodeVariant(KernelVariant):
    """flash_decode<E, D, MT, NW, STAGES> with its combine kernel, kvcache_prep<E> and
    kvcache_check in the same module."""

    elem: str
    d: int
    mt: int
    nw: int
    stages: int

    template: ClassVar[str] = "flash_decode"
    file: ClassVar[str] = "portable/decode.cu"

    def template_args(self) -> tuple:
        return (self.elem, str(self.d), str(self.mt), str(self.nw), str(self.stages))

    @property
    def helper_expressions(self) -> tuple:
        return (f"flash_decode_combine<{self.elem}, {self.d}>", f"kvcache_prep<{self.elem}>",
                "kvcache_check")

    @property
    def name(self) -> str:
        return f"decode_{self.elem}_d{self.d}_m{16 * self.mt}_w{self.nw}_s{self.stages}"

    @property
    def threads(self) -> int:
        return 32 * self.nw

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.d, self.mt, self.nw, self.stages)


@dataclass(frozen=True)
class PrepVariant(KernelVariant):
    """kvcache_prep<E> alone (with kvcache_check): append and rotary for calls whose attention
    runs the gather path (float32, other head dims)."""

    elem: str

    template: ClassVar[str] = "kvcache_prep"
    file: ClassVar[str] = "portable/decode.cu"
    helper_expressions: ClassVar[tuple] = ("kvcache_check",)

    def template_args(self) -> tuple:
        return (self.elem,)

    @property
    def name(self) -> str:
        return f"kvcache_prep_{self.elem}"

    threads: ClassVar[int] = 128
    smem_bytes: ClassVar[int] = 0


def mt_for(rows: int, d: int) -> int:
    """16-row slabs per CTA: 1 for up to 16 packed rows (decode), 2 above when d <= 128."""
    return 1 if rows <= 16 or d > 128 else 2


def variant_for(elem: str, d: int, rows: int, smem_optin: int) -> tuple:
    """(DecodeVariant, CTAs per SM) for ``rows`` packed rows (seqlen_q * heads per kv head):
    TUNING["nw"] warps, halved while their 2-stage rings do not fit the opt-in shared memory (the
    99 KB class at d 192 / 256: 4 warps need 106 / 140 KB, 2 warps 58 / 74 KB)."""
    mt = mt_for(rows, d)
    nw = int(TUNING["nw"])
    while nw > 1 and smem_bytes(d, mt, nw, 2) > smem_optin:
        nw //= 2
    stages, per_sm = choose_stages(d, mt, smem_optin, nw)
    return DecodeVariant(elem, d, mt, nw, stages), per_sm


def variants(smem_optin: int) -> list:
    """Every attention variant the planner can pick on a device with ``smem_optin`` bytes."""
    out = []
    for elem in DECODE_ELEMS:
        for d in DECODE_HEAD_DIMS:
            for rows in (1, 32):
                v, _ = variant_for(elem, d, rows, smem_optin)
                if v not in out:
                    out.append(v)
    return out


def prep_variants() -> list:
    return [PrepVariant(e) for e in PREP_ELEMS]


# ------------------------------------------------------------------------------------------
# coverage and plan
# ------------------------------------------------------------------------------------------
def why_unsupported(dtype_name: str, d: int, d_v: int, cc: int, aligned: bool) -> Optional[str]:
    """None when flash_decode covers a call, else the reason (the call runs the gather path)."""
    if cc < 80:
        return f"compute capability {cc / 10:.1f} (the decode kernel needs 8.0+)"
    if ELEM_OF.get(dtype_name) not in DECODE_ELEMS:
        return f"dtype {dtype_name} (the decode kernel takes float16, bfloat16)"
    if d != d_v or d not in DECODE_HEAD_DIMS:
        return f"head dim {d} / {d_v} (the decode kernel takes d = d_v in {DECODE_HEAD_DIMS})"
    if not aligned:
        return "strides or base addresses not multiples of 16 bytes"
    return None


def choose_splits(ctas: int, key_tiles: int, slots: int, tile_bytes: int = 2 * 16 * 128 * 2,
                  nw: int = NW) -> int:
    """The split count for ``ctas`` CTAs per split, ``key_tiles`` 16-key tiles in the longest key
    range, ``slots`` CTAs resident on the whole GPU and ``tile_bytes`` bytes of K and V per tile
    (module docstring)."""
    if ctas <= 0 or key_tiles <= 0:
        return 1
    s_max = max(1, min(MAX_SPLITS, key_tiles // (nw * MIN_TILES_PER_WARP)))
    fixed = CTA_FIXED_S * HBM_BYTES_PER_S / (key_tiles * tile_bytes * slots)
    best, best_cost = 1, math.inf
    for s in range(1, s_max + 1):
        cost = math.ceil(ctas * s / slots) * (1.0 / s + fixed)
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = s, cost
    return best


#: Choices the decode benchmark A/Bs (benchmarks/bench_kvcache.py --ab): ``head_fastest`` orders
#: the grid (kv head, split, batch x row tile) so that the kv heads of one key range run side by
#: side (their rows interleave in a bshd cache), else (split, kv head, ...); ``fused_combine``
#: lets the split that finishes last merge the partials (one launch), else flash_decode_combine.
#: ``l2_prefetch`` (0, 128, 256): the L2 prefetch-size hint of the K / V copies (a build option,
#: -DKV_L2_PREFETCH); ``ctas_per_sm`` 2: two CTAs per SM where a ring of >= 3 stages allows,
#: 1: one CTA with the deepest ring, 3 or more: that many with rings of >= 2 stages; ``nw``: warps
#: per CTA. ``mha_forward``: multi-head calls on compute capability 9.0 attend on the Hopper
#: forward (route_forward).
#: Measured (H100, bf16 hd 128, lab/ab_decode.py, interleaved, GB/s; docs/kvcache.md): 3 CTAs x
#: 2 stages per SM as fast as 2 x 3 (geomean 1.000), 4 CTAs x 2 warps 0.974, twice the planned
#: splits 0.977; the Hopper forward on the multi-head rows 3206 vs 3035 (64 x 4k) and 3181 vs 2926
#: (4 x 32k). Measured earlier (H200, the seven rows of bench_kvcache.py in one run): the grid
#: order made no difference (within 1 %); the fused combine beat the combine kernel by 1-2 % on
#: the split rows (1 x 131k: 3694 vs 3606); L2::128B was faster on 6 of 7 rows (+0.5 to +2.5 %,
#: 1 x 131k 3783 vs 3694, page 16 4163 vs 4061; 32 x 16k contiguous 4032 vs 4131), L2::256B
#: no better than none; one CTA per SM with a 6-deep ring was 15-35 % slower (1 x 131k 3011).
TUNING = {"head_fastest": True, "fused_combine": True, "l2_prefetch": 128, "ctas_per_sm": 2,
          "nw": NW, "mha_forward": True}


def build_options() -> tuple:
    """Extra NVRTC options of the decode module under TUNING."""
    n = int(TUNING["l2_prefetch"])
    return (f"-DKV_L2_PREFETCH={n}",) if n else ()


@dataclass(frozen=True)
class DecodePlan:
    variant: DecodeVariant
    grid: tuple
    block: tuple
    smem: int
    num_splits: int
    num_m_tiles: int
    head_fastest: bool = True
    fused_combine: bool = True


def fused_fits(variant: DecodeVariant, num_splits: int) -> bool:
    """The fused combine keeps one weight per (row, split) in the merge area."""
    q = 16 * variant.mt * pitch(variant.d) * 2
    return 16 * variant.mt * num_splits * 4 <= variant.smem_bytes - q


def plan_decode(dtype_name: str, b: int, s_q: int, h: int, h_k: int, d: int, max_keys: int,
                num_splits: int, sm_count: int, smem_optin: int) -> DecodePlan:
    """Grid and variant of one call: ``max_keys`` bounds the keys of the longest batch entry
    (after the append; the cache's capacity when the lengths live on the device);
    ``num_splits`` 0 = choose_splits, else used as given (capped at the key tiles)."""
    g = h // h_k
    rows = s_q * g
    var, per_sm = variant_for(ELEM_OF[dtype_name], d, rows, smem_optin)
    m_tiles = -(-rows // (16 * var.mt))
    ctas = b * h_k * m_tiles
    tiles = -(-max(max_keys, 1) // TILE_KEYS)
    if num_splits == 0:
        splits = choose_splits(ctas, tiles, per_sm * sm_count, 2 * TILE_KEYS * d * 2, var.nw)
    else:
        splits = max(1, min(int(num_splits), tiles, 1024))
    head_fastest = bool(TUNING["head_fastest"])
    fused = bool(TUNING["fused_combine"]) and splits > 1 and fused_fits(var, splits)
    grid = (h_k, splits, b * m_tiles) if head_fastest else (splits, h_k, b * m_tiles)
    return DecodePlan(var, grid, (var.threads, 1, 1), var.smem_bytes, splits, m_tiles,
                      head_fastest, fused)


#: Multi-head calls read at least this many bytes of K and V to take the Hopper forward
#: (route_forward): a call whose length changes replans the forward (host time), which a call of
#: this size hides behind the GPU's.
FORWARD_ROUTE_MIN_BYTES = 1 << 30


def route_forward(cc: int, h: int, h_k: int, paged: bool, device_lengths: bool, num_splits: int,
                  kv_bytes: int) -> bool:
    """True when an attention_with_kvcache call should attend on the Hopper forward instead of
    flash_decode (TUNING["mha_forward"]): compute capability 9.0, multi-head (no GQA packing to
    gain), a contiguous cache whose entries hold the same number of keys (host-held lengths),
    the planner's split count, and at least FORWARD_ROUTE_MIN_BYTES of K / V."""
    return (bool(TUNING["mha_forward"]) and cc == 90 and h == h_k and not paged
            and not device_lengths and num_splits == 0 and kv_bytes >= FORWARD_ROUTE_MIN_BYTES)


def route_attention(dtype_name: str, b: int, s_q: int, s_k: int, h: int, h_k: int, d: int,
                    d_v: int, has_bias_or_mask: bool, sm_count: int, cc: int = 90) -> bool:
    """True when a plain ``attention`` call should run the split-KV decode path: few packed rows
    (seqlen_q x heads per kv head <= 32, one CTA tile), at least 512 keys, a dtype and head dim the
    decode kernel takes, no bias or mask, and either GQA (the group's heads share one pass over
    K / V: the forward reads them once per query head, 1456-1473 GB/s against 4218-4827 for this
    path on the H200's GQA decode rows) or, off compute capability 9.0, fewer (batch x heads)
    than SMs (the portable forward does not split keys). Multi-head calls on 9.0 stay on the
    Hopper forward, which splits its last wave along the keys and read 4439-4445 GB/s on the
    MHA decode rows against this path's 4078-4132."""
    if has_bias_or_mask or ELEM_OF.get(dtype_name) not in DECODE_ELEMS:
        return False
    if d != d_v or d not in DECODE_HEAD_DIMS or h_k == 0 or h % h_k:
        return False
    g = h // h_k
    if s_q * g > 32 or s_k < 512:
        return False
    return g > 1 or (cc != 90 and b * h < sm_count)
