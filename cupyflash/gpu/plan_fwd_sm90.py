"""Hopper forward planner (pure Python): the variants of flash_fwd_sm90 (kernels_cu/hopper/fwd.cu,
16-bit) and flash_fwd_sm90_f32 (kernels_cu/hopper/fwd_f32.cu, float32), why a call is not covered
(``why_unsupported``), tile choice, the split tail, and the persistent grid's plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .params import sizes_and_scalars, varlen_params
from .plan_fwd import Plan
from .tuning import TUNING
from .variants import SM90_SMEM_MAX, KernelVariant, cpp_bool, elem_tag, sm90_common_unsupported


# ------------------------------------------------------------------------------------------
# Hopper (sm_90a) forward: flash_fwd_sm90<E, D, BN, STAGES, NC, WINDOW, SOFTCAP, VARLEN, BIAS,
# SPLIT, MAXFREE> in
# kernels_cu/hopper/fwd.cu (TMA + wgmma, one producer and NC consumer warpgroups, BM = 64·NC,
# one Q buffer).
# Chosen on compute capability 9.0 wherever it covers the call (why_unsupported() is None);
# everything else runs the portable kernel above.
# ------------------------------------------------------------------------------------------
SM90_HEAD_DIMS = (64, 128, 256)


#: (BN, STAGES, NC) per head dim: K/V tiles of BN keys in a ring of STAGES buffers, NC consumer
#: warpgroups of 64 query rows (work tiles of BM = 64·NC rows). benchmarks/sm90_tune.py measured these
#: (docs/hopper.md): three consumers win at hd 64 except for causal / window calls of up to
#: 2k queries (SM90_TILES_FEW_ROWS below).
SM90_TILES = {64: (128, 2, 3), 128: (128, 2, 2), 256: (80, 2, 2)}


#: hd 64 with two consumers: softcap, varlen and bias (the tanh, the per-sequence tile state or
#: the bias fragment needs registers that three consumers' 160 lack: ptxas spills).
SM90_TILES_NC2 = {64: (128, 2, 2)}


#: hd 64 causal / window calls of at most SM90_FEW_ROWS_SQ queries without softcap, varlen or
#: bias: one consumer, 64-key tiles and three blocks per SM (Sm90Variant.blocks_per_sm), so
#: the many short work tiles' boundaries (the lone first S, the masked softmax, the epilogue)
#: run beside the other blocks' key-tile loops. H200, sm90_tune.py (docs/hopper.md, "One consumer, several blocks per SM"):
#: causal 512 / 1k / 2k 268 / 311 / 351 TFLOP/s against two consumers' 218 / 290 / 335 and
#: three's 187 / 251 / 340; at 4k three consumers lead (400 against 374).
SM90_TILES_FEW_ROWS = {64: (64, 2, 1)}
SM90_FEW_ROWS_SQ = 2048


#: shared memory of one SM (228 KB on the H100 / H200; each resident block reserves 1 KB of it)
SM90_SMEM_PER_SM = 228 * 1024


#: hd 128 with key tiles of 176 (FlashAttention-3's width) where query rows see at least
#: SM90_WIDE_MIN_KEYS keys on average (sm90_keys): on the H200 (sm90_tune, 11
#: interleaved rounds, 176 against 128) non-causal 4k -1.2 %, 6k / 8k / 16k +2.5 / +1.8 / +1.4 %;
#: causal 4k / 6k -3.5 / -1.6 %, 8k +0.1 %, 12k / 16k +1.5 / +1.8 %: the mean keys per row, 6k
#: on, separate them (docs/hopper.md, steps 8 and 33). Calls without softcap or bias only:
#: those variants spill at 176. Causal / window calls only: dense calls
#: without a band take the max-free softmax on 128-key tiles (SM90_MAXFREE_MIN_KEYS), 13-16 %
#: faster than 176 at 8k / 16k.
SM90_TILES_WIDE = {128: (176, 2, 2)}
SM90_WIDE_MIN_KEYS = 6144


#: The max-free softmax (MAXFREE: the key-tile loop's softmax against the running max of the
#: tiles before, without the tile's own row max or O's rescale while each lane's row sums of the
#: tile stay at most 256, i.e. no P above 256; docs/hopper.md, "Max-free softmax") for dense hd 128 calls
#: without a band, softcap, varlen or bias, on 128-key tiles (its second P buffer leaves no
#: registers at 176), where query rows see at least SM90_MAXFREE_MIN_KEYS keys. On the H200
#: (benchmarks/sm90_tune.py, bf16, FA shapes, interleaved rounds), TFLOP/s
#: of 128-key tiles without / with it and of 176-key tiles: 512 512.5 / 518.8, 1k 581.6 / 610.0,
#: 2k 593.8 / 651.7 / 581.8, 4k 619.6 / 708.0 / 607.5, 6k 618.2 / 691.4 / 633.2, 8k 625.9 /
#: 730.9 / 631.4, 16k 632.9 / 724.4 / 640.7. From 1k on (512's +1.2 % is inside the rounds'
#: spread; the FA bench ran it without).
SM90_MAXFREE_HEAD_DIMS = (128,)
SM90_MAXFREE_MIN_KEYS = 1024


#: Head dims of the BIAS variants (hd 256 spills with the bias loads).
SM90_BIAS_HEAD_DIMS = (64, 128)


#: rows of the Hopper forward's out box: one consumer warpgroup's O rows (sm90::WG_ROWS)
SM90_O_BOX_ROWS = 64


@dataclass(frozen=True)
class Sm90Variant(KernelVariant):
    """One template instantiation of flash_fwd_sm90."""

    elem: str
    d: int
    bn: int
    stages: int
    window: bool
    softcap: bool
    nc: int = 2
    varlen: bool = False
    bias: int = 0           # 0 none, 1 bias in the inputs' 16-bit type, 2 float32 bias
    split: bool = False     # the grid's last partial wave split along the keys (sm90_split)
    maxfree: bool = False   # the key-tile loop's softmax without the tile's row max (MAXFREE)

    file = "hopper/fwd.cu"
    arch_options = ("-arch=sm_90a",)   # wgmma / setmaxnreg need the arch-specific target

    @property
    def bm(self) -> int:
        return 64 * self.nc

    @property
    def threads(self) -> int:
        return 128 * (self.nc + 1)

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM of the persistent grid (mirrors hopper/fwd.cu's BlocksPerSm, which
        the kernel's __launch_bounds__ asks for): with one consumer two, three with 64-key tiles,
        as many as fit in an SM's shared memory; else one."""
        n = (3 if self.bn <= 64 else 2) if self.nc == 1 else 1
        while n > 1 and n * (self.smem_bytes + 1024) > SM90_SMEM_PER_SM:
            n -= 1
        return n

    template = "flash_fwd_sm90"

    def template_args(self) -> tuple:
        b = cpp_bool
        return (self.elem, str(self.d), str(self.bn), str(self.stages), str(self.nc),
                b(self.window), b(self.softcap), b(self.varlen), str(self.bias), b(self.split),
                b(self.maxfree))

    @property
    def name(self) -> str:
        flags = ("_window" if self.window else "") + ("_softcap" if self.softcap else "") + (
            "_varlen" if self.varlen else "") + ("", "_bias", "_bias32")[self.bias] + (
            "_split" if self.split else "") + ("_maxfree" if self.maxfree else "")
        return f"fwd90_{self.elem[:-2]}_d{self.d}_{self.bm}x{self.bn}s{self.stages}{flags}"

    @property
    def smem_bytes(self) -> int:
        return sm90_smem_bytes(self.d, self.bn, self.stages, self.nc, self.varlen)

    @property
    def o_smem(self) -> bool:
        """The epilogue stages O in shared memory for a TMA store (needs the tma_o map)."""
        return sm90_o_smem(self.d, self.bn, self.stages, self.nc, self.varlen)


def _sm90_ring_bytes(d: int, bn: int, stages: int, nc: int) -> int:
    """Q [64·nc, d], K and V [stages, bn, d] (16-bit), the mbarriers, the work-tile index and
    1024 bytes of slack to align the swizzled panels (sm90::Layout without O)."""
    return 2 * d * (64 * nc + 2 * stages * bn) + 8 * (2 + 5 * stages + 1) + 1024


def sm90_o_smem(d: int, bn: int, stages: int, nc: int = 2, varlen: bool = False) -> bool:
    """Mirrors sm90::Layout::O_SMEM: the epilogue stages O [64·nc, d] in shared memory for a TMA
    store where it fits beside the ring; not for packed sequences (a box could reach into the
    next sequence's rows)."""
    return not varlen and _sm90_ring_bytes(d, bn, stages, nc) + 2 * d * 64 * nc <= SM90_SMEM_MAX


def sm90_smem_bytes(d: int, bn: int, stages: int, nc: int = 2, varlen: bool = False) -> int:
    """Mirrors sm90::Layout in hopper/fwd.cu: the ring (_sm90_ring_bytes) and, where
    sm90_o_smem, O [64·nc, d]."""
    o = 2 * d * 64 * nc if sm90_o_smem(d, bn, stages, nc, varlen) else 0
    return _sm90_ring_bytes(d, bn, stages, nc) + o


# ------------------------------------------------------------------------------------------
# Hopper float32 forward: flash_fwd_sm90_f32<E, D, BN, STAGES, NC, WINDOW> in
# kernels_cu/hopper/fwd_f32.cu (3xTF32 on wgmma; E = f32x3_t, or tf32_t with allow_tf32).
# ------------------------------------------------------------------------------------------
SM90_F32_HEAD_DIMS = (64, 128)


#: (BN, STAGES, NC, QREG) per head dim, chosen by the shared-memory budget (measured on the H200:
#: 73-97 TFLOP/s; the alternatives below not timed yet): a
#: stage holds K big / small, Vᵀ big / small and the raw V tile (5·BN·d floats); Q big takes
#: 64·NC·d floats, and as much again for Q small unless QREG (the consumers keep Q small in
#: registers). hd 64: 128 x 64 tiles, two stages (193 KB); hd 128: 128 x 32, two stages
#: (225 KB). Alternatives that fit can be forced for tuning (an Sm90F32Variant as ``kernel``,
#: benchmarks/bench_f32.py --variant): without QREG hd 64 128 x 64 x 2 (225 KB), hd 128 64 x 32 x 2
#: (one consumer, 225 KB) or 64 x 64 x 1.
SM90_F32_TILES = {64: (64, 2, 2, True), 128: (32, 2, 2, True)}
F32_ELEMS = ("f32x3_t", "tf32_t")


@dataclass(frozen=True)
class Sm90F32Variant(KernelVariant):
    """One template instantiation of flash_fwd_sm90_f32 (float32, 3xTF32 or TF32)."""

    elem: str               # f32x3_t (float32 accuracy) or tf32_t (allow_tf32: one product)
    d: int
    bn: int
    stages: int
    nc: int
    window: bool
    qreg: bool = True       # Q small in the consumers' registers (no q_small tile)

    file = "hopper/fwd_f32.cu"
    arch_options = ("-arch=sm_90a",)
    softcap = False         # not in the float32 kernel (the planner's checks read these)
    varlen = False
    bias = 0
    bm = Sm90Variant.bm             # 64 query rows per consumer warpgroup
    threads = Sm90Variant.threads   # a producer warpgroup + nc consumers

    template = "flash_fwd_sm90_f32"

    def template_args(self) -> tuple:
        b = cpp_bool
        return (self.elem, str(self.d), str(self.bn), str(self.stages), str(self.nc),
                b(self.window), b(self.qreg))

    @property
    def name(self) -> str:
        return (f"fwd90_{self.elem[:-2]}_d{self.d}_{self.bm}x{self.bn}s{self.stages}"
                + ("_qr" if self.qreg else "") + ("_window" if self.window else ""))

    @property
    def smem_bytes(self) -> int:
        return sm90_f32_smem_bytes(self.d, self.bn, self.stages, self.nc, self.qreg)


def sm90_f32_smem_bytes(d: int, bn: int, stages: int, nc: int, qreg: bool = True) -> int:
    """Mirrors sm90f32::Layout in hopper/fwd_f32.cu: Q big (and small unless qreg) [64·nc, d], per
    stage K big / small, Vᵀ big / small and raw V [bn, d] (float32), 3 + 7·stages mbarriers, the
    work-tile index, and 1024 bytes of slack to align the swizzled panels."""
    q_tiles = 1 if qreg else 2
    return 4 * d * (q_tiles * 64 * nc + 5 * stages * bn) + 8 * (3 + 7 * stages) + 8 + 1024


def sm90_f32_variant(elem: str, d: int, window: bool) -> Sm90F32Variant:
    """The planner's float32 Hopper instantiation (SM90_F32_TILES)."""
    bn, stages, nc, qreg = SM90_F32_TILES[d]
    return Sm90F32Variant(elem, d, bn, stages, nc, window, qreg)


def f32_variants():
    """Every Sm90F32Variant the planner can select (compiled by the harness for sm_90a)."""
    return [sm90_f32_variant(e, d, w) for e in F32_ELEMS for d in SM90_F32_HEAD_DIMS
            for w in (False, True)]


def _clamped_sum(a: int, n: int, hi: int) -> int:
    """Σ min(max(x, 0), hi) over the n integers x = a, a + 1, ..., a + n − 1."""
    def ramp(m):   # Σ max(x, 0) over x <= m
        return m * (m + 1) // 2 if m > 0 else 0
    b = a + n - 1
    return ramp(b) - ramp(a - 1) - (ramp(b - hi) - ramp(a - 1 - hi))


def sm90_keys(s_q: int, s_k: int, window_left: int, window_right: int,
              bottom_right: bool = True) -> float:
    """The keys a query row sees on average: row i sees keys [i + diag − left, i + diag + right]
    clipped to [0, s_k) (diag = s_k − s_q bottom-right, 0 top-left; −1 = unbounded)."""
    diag = s_k - s_q if bottom_right else 0
    hi = s_q * s_k if window_right < 0 else _clamped_sum(diag + window_right + 1, s_q, s_k)
    lo = 0 if window_left < 0 else _clamped_sum(diag - window_left, s_q, s_k)
    return max(hi - lo, 0) / s_q if s_q > 0 else 0.0


#: The split tail (sm90_split), in key-tile steps of one work tile: what a piece costs besides
#: its key tiles (the first S, the last P·V alone, the epilogue: ~0.9 step at hd 128 on the H200,
#: docs/hopper.md, "Where the time goes") and, per partial, the merge of a split tile (write, read, rescale).
SM90_SPLIT_BOUNDARY = 1.0
SM90_SPLIT_MERGE = 0.25


#: split only when the model gains at least this fraction of the call's time
SM90_SPLIT_MIN_GAIN = 0.05


#: at most this many pieces per work tile (the last to finish reads all the others' partials)
SM90_SPLIT_MAX_PARTS = 16


#: at least this many key tiles per piece (H200, hd 128, b 1, h 16, s 512: two pieces of two
#: key tiles ran 0.92x the whole tiles; docs/hopper.md, "Split tail")
SM90_SPLIT_MIN_KEYS = 4


#: the partials' workspace, at most (bytes)
SM90_SPLIT_MAX_WS = 64 << 20


def sm90_split(work: int, grid: int, n: int, *, force: bool = False) -> Optional[np.ndarray]:
    """The pieces of the split tail of a dense Hopper forward (SPLIT variants), or None.

    ``work`` work tiles of ``n`` key tiles each run on ``grid`` persistent blocks: F = work //
    grid full waves, then a last wave of R = work % grid tiles on R blocks while the others
    idle (the whole call, when work < grid). Split, each of the R tiles runs as p = grid // R
    pieces (at most n / SM90_SPLIT_MIN_KEYS and SM90_SPLIT_MAX_PARTS), each a contiguous range
    of about n / p of its key tiles: R·p <= grid pieces, one round on the blocks the tail left
    idle; the last piece of a tile to finish merges the others' partial O, m, l. Model
    (key-tile steps, c the boundary): whole (F + 1)·(n + c), split F·(n + c) + ceil(n / p) + c
    + merge·(p − 1); split when that gains SM90_SPLIT_MIN_GAIN. (Pieces are drawn from the
    dynamic counter: pieces of unequal sizes, or more than one round of them, ran slower than
    the whole tiles on the H200, docs/hopper.md, "Split tail".) ``force``: split whatever the model
    says, into at least two pieces per tile of two or more key tiles, the last full wave when
    work is a multiple of grid (tests). Returns int32 [pieces, 4]: tail tile r (work tile work −
    R + r), the piece's first key tile within the tile, its key tiles, and 64 · (the tile's
    first piece) + (its pieces).
    """
    if work < 1 or grid < 1 or n < 1:
        return None
    full, tail = divmod(work, grid)
    if tail == 0 and force:
        full, tail = full - 1, grid
    if tail == 0:
        return None
    parts = min(grid // tail, n // SM90_SPLIT_MIN_KEYS, SM90_SPLIT_MAX_PARTS)
    if force:
        parts = max(parts, min(n, 2))
    elif parts < 2:
        return None
    c = SM90_SPLIT_BOUNDARY
    whole = (full + 1) * (n + c)
    split = full * (n + c) + -(-n // parts) + c + SM90_SPLIT_MERGE * (parts - 1)
    if not force and split > (1.0 - SM90_SPLIT_MIN_GAIN) * whole:
        return None
    j = np.arange(parts)
    lo, hi = j * n // parts, (j + 1) * n // parts            # each tile's pieces, in key order
    r = np.repeat(np.arange(tail), parts)
    table = np.empty((tail * parts, 4), np.int32)
    table[:, 0] = r
    table[:, 1] = np.tile(lo, tail)
    table[:, 2] = np.tile(hi - lo, tail)
    table[:, 3] = 64 * (r * parts) + parts
    return table


def sm90_work_items(first: int, pieces: np.ndarray, n: int) -> np.ndarray:
    """The SPLIT kernel's table, one row per work item (whole tiles too, so that no branch on the
    item's index makes the key-tile loop's bounds look divergent to the compiler): int32
    [first + pieces, 4] = (work tile, first key tile, key tiles, 64 · the tile's first piece +
    its pieces); whole tiles 0 .. first − 1 are (w, 0, n, 1), then ``pieces`` (sm90_split's rows,
    tile first + r; first piece counted from the first piece)."""
    items = np.empty((first + len(pieces), 4), np.int32)
    items[:first, 0] = np.arange(first)
    items[:first, 1:] = (0, n, 1)
    items[first:] = pieces
    items[first:, 0] += first
    return items


def sm90_split_ws_bytes(variant, pieces: int) -> int:
    """Bytes of the SPLIT workspace: per piece and consumer, 128 lanes' O [d / 2] and m, l [4]
    float32 (hopper/fwd.cu's merge_pieces)."""
    return pieces * variant.nc * 128 * (variant.d // 2 + 4) * 4


def sm90_variant(elem: str, d: int, window: bool, softcap: bool,
                 s_q: Optional[int] = None, varlen: bool = False, bias: int = 0,
                 keys: Optional[float] = None, split: bool = False):
    """The planner's Hopper forward instantiation for these template flags, s_q queries (the
    longest sequence's, varlen) and ``keys`` keys per query row on average (sm90_keys)
    (SM90_TILES; SM90_TILES_WIDE for calls without softcap or bias from
    SM90_WIDE_MIN_KEYS keys on;
    SM90_TILES_FEW_ROWS for window calls of at most SM90_FEW_ROWS_SQ queries without softcap,
    varlen or bias; SM90_TILES_NC2 for softcap, varlen and bias); ``split``: its SPLIT twin
    (dense calls without a band, softcap or bias: sm90_split). The max-free softmax (MAXFREE,
    on 128-key tiles, whatever SM90_TILES_WIDE says) for dense calls without a band, softcap or
    bias at SM90_MAXFREE_HEAD_DIMS from SM90_MAXFREE_MIN_KEYS keys on. float32 tags: the
    Sm90F32Variant (no softcap, varlen, bias there)."""
    if elem in F32_ELEMS:
        if softcap or varlen or bias:
            raise ValueError("the float32 Hopper kernel has no softcap, varlen or bias")
        return sm90_f32_variant(elem, d, window)
    plain = not (softcap or varlen or bias)
    if split and (window or not plain):
        raise ValueError("split: dense calls without a window, softcap, varlen or bias only")
    maxfree = (d in SM90_MAXFREE_HEAD_DIMS and plain and not window
               and keys is not None and keys >= SM90_MAXFREE_MIN_KEYS)
    wide = (d in SM90_TILES_WIDE and keys is not None and keys >= SM90_WIDE_MIN_KEYS and plain
            and not maxfree)
    few_rows = (d in SM90_TILES_FEW_ROWS and window and s_q is not None
                and s_q <= SM90_FEW_ROWS_SQ and plain)
    if wide:
        tiles = SM90_TILES_WIDE[d]
    elif few_rows:
        tiles = SM90_TILES_FEW_ROWS[d]
    else:
        tiles = SM90_TILES[d] if plain else SM90_TILES_NC2.get(d, SM90_TILES[d])
    bn, stages, nc = tiles
    return Sm90Variant(elem, d, bn, stages, window, softcap, nc, varlen, bias, split, maxfree)


def variants():
    """Every Sm90Variant the planner can select (compiled by the harness for sm_90a)."""
    found = {}
    for elem in ("f16_t", "bf16_t"):
        for d in SM90_HEAD_DIMS:
            for window in (False, True):
                for cap in (False, True):
                    for s_q, keys in ((None, None), (1, None), (SM90_FEW_ROWS_SQ, None),
                                      (None, SM90_MAXFREE_MIN_KEYS), (None, SM90_WIDE_MIN_KEYS)):
                        for varlen, bias in ((False, 0), (True, 0), (False, 1), (False, 2)):
                            if bias and d not in SM90_BIAS_HEAD_DIMS:
                                continue
                            v = sm90_variant(elem, d, window, cap, s_q, varlen, bias, keys)
                            found[v.name] = v
                            if not (window or cap or varlen or bias):
                                v = v.replace(split=True)
                                found[v.name] = v
    return list(found.values())


def sm90_out_align(variant, dtype_name) -> int:
    """Bytes out's base must be aligned to on the Hopper forward: 16 where O goes out through a
    TMA store (o_smem: such kernels have no other epilogue) or as float32 quads, else 4 (16-bit
    pairs)."""
    return 16 if dtype_name == "float32" or getattr(variant, "o_smem", False) else 4


def why_unsupported(dtype_name: str, d: int, d_v: int, *, scale: float, softcap: float,
                     has_alibi: bool, cc: int, smem_optin: int, tensors=()) -> Optional[str]:
    """Why the Hopper forward kernel cannot run this call (None when it can).

    ``tensors``: (shape, element strides) of q, k, v and out, checked against what TMA accepts.
    Base-pointer alignment is checked at launch (the launcher falls back when it fails).
    """
    if has_alibi:
        return "alibi_slopes (not in the Hopper kernel yet)"
    if not (scale > 0 or softcap > 0):
        return f"scale {scale} <= 0 without softcap"
    if dtype_name == "float32":   # hopper/fwd_f32.cu
        if softcap > 0:
            return "softcap with float32 (not in the float32 Hopper kernel)"
        smem_need = max(sm90_f32_variant("f32x3_t", d, w).smem_bytes
                        for w in (False, True)) if d in SM90_F32_TILES else 0
        return sm90_common_unsupported(dtype_name, d, d_v, SM90_F32_HEAD_DIMS, cc=cc,
                                       smem_need=smem_need, smem_optin=smem_optin,
                                       tensors=tensors, dtypes=("float32",))
    smem_need = max(sm90_variant("f16_t", d, w, softcap > 0, s, keys=kk).smem_bytes
                    for w in (False, True) for s in (None, 1)
                    for kk in (None, SM90_WIDE_MIN_KEYS)) if d in SM90_TILES else 0
    return sm90_common_unsupported(dtype_name, d, d_v, SM90_HEAD_DIMS, cc=cc,
                                   smem_need=smem_need, smem_optin=smem_optin, tensors=tensors)


def plan_forward_sm90(dtype_name: str, b: int, s_q: int, s_k: int, h: int, h_k: int, d: int,
                      d_v: int, *, scale: float, window_left: int = -1, window_right: int = -1,
                      bottom_right: bool = True, softcap: float = 0.0, num_sms: int = 132,
                      variant=None, varlen: bool = False, allow_tf32: bool = False) -> Plan:
    """Plan the Hopper kernel for a call that why_unsupported() accepted: a persistent grid of
    min(work items, num_sms · blocks per SM) blocks walking ceil(s_q / BM) x h x b work tiles
    (``varlen``: see plan_forward_varlen_sm90, which calls this with the longest sequences as
    s_q, s_k). With ``variant`` None (the planner's choice), a dense call without a band,
    softcap or bias splits the grid's last partial wave along the keys where sm90_split's model
    gains (TUNING.sm90_split_auto): the SPLIT variant, Plan.split its work items (the whole tiles, then
    the pieces: sm90_work_items); a forced SPLIT variant always splits; any other forced
    variant never."""
    if h % h_k:
        raise ValueError(f"heads {h} is not a multiple of heads_k {h_k}")
    if min(b, s_q, s_k, h, h_k, d, d_v) < 1:
        raise ValueError("empty problem: the launcher handles zero sizes before planning")
    elem = elem_tag(dtype_name, allow_tf32)   # float32: f32x3_t, or tf32_t (allow_tf32)
    window = window_left >= 0 or window_right >= 0
    auto = variant is None
    if auto:
        variant = sm90_variant(elem, d, window, softcap > 0, s_q,
                               keys=sm90_keys(s_q, s_k, window_left, window_right,
                                              bottom_right))
    elif variant.elem != elem or variant.d != d or d_v != d or (window and not variant.window) \
            or (softcap > 0) != variant.softcap or variant.varlen != varlen:
        raise ValueError(f"kernel {variant.name} cannot compute this problem")
    prm, (num_m, _, _) = sizes_and_scalars(variant.bm, b, s_q, s_k, h, h_k, d, d_v, scale,
                                            window_left, window_right, bottom_right, softcap)
    work = num_m * h * b
    if work > 2**31 - 1:
        raise NotImplementedError(f"{work} work tiles exceed the kernel's int32 tile index")
    blocks = num_sms * getattr(variant, "blocks_per_sm", 1)
    table = None
    if getattr(variant, "split", False) or (auto and TUNING.sm90_split_auto and isinstance(
            variant, Sm90Variant) and not (window or variant.softcap or variant.bias)):
        # dense, no band: every work tile runs all n = ceil(s_k / bn) key tiles. The planner's
        # variant splits where sm90_split's model gains; a forced SPLIT variant always does.
        n = -(-s_k // variant.bn)
        table = sm90_split(work, blocks, n, force=variant.split)
        too_big = table is not None and (
            len(table) + work >= 2**31
            or sm90_split_ws_bytes(variant, len(table)) > SM90_SPLIT_MAX_WS)
        if too_big and variant.split:
            raise ValueError(f"kernel {variant.name}: the split's workspace exceeds "
                             f"SM90_SPLIT_MAX_WS ({SM90_SPLIT_MAX_WS} bytes) for this call")
        table = None if too_big else table
        variant = variant.replace(split=table is not None)
    first = work
    if table is not None:
        first = work - (int(table[-1, 0]) + 1)
        prm["split_pieces"] = len(table)
        table = sm90_work_items(first, table, n)
    prm["split_first"] = first
    grid = min(work if table is None else len(table), blocks)
    return Plan(variant, (grid, 1, 1), (variant.threads, 1, 1), variant.smem_bytes, prm, table)


def plan_forward_varlen_sm90(dtype_name: str, batch: int, total_q: int, total_k: int,
                             max_seqlen_q: int, max_seqlen_k: int, h: int, h_k: int, d: int,
                             d_v: int, *, scale: float, window_left: int = -1,
                             window_right: int = -1, bottom_right: bool = True,
                             softcap: float = 0.0, num_sms: int = 132) -> Plan:
    """The Hopper kernel over ``batch`` packed sequences (a call why_unsupported() accepted):
    a persistent grid walking ceil(max_seqlen_q / BM) x h x batch work tiles; tiles past their
    sequence's end are skipped by the producer. Params: b = batch, s_q / s_k = the packed totals
    (lse is [h, total_q]), causal / window aligned per sequence (``varlen_bottom_right``). The
    launcher sets pointers, cu_seqlens, zero batch strides and the TMA descriptors."""
    if min(batch, total_q, total_k, max_seqlen_q, max_seqlen_k) < 1:
        raise ValueError("empty problem: the launcher handles zero sizes before planning")
    window = window_left >= 0 or window_right >= 0
    variant = sm90_variant(elem_tag(dtype_name, False), d, window, softcap > 0, max_seqlen_q,
                           varlen=True)
    plan = plan_forward_sm90(dtype_name, batch, max_seqlen_q, max_seqlen_k, h, h_k, d, d_v,
                             scale=scale, window_left=window_left, window_right=window_right,
                             bottom_right=bottom_right, softcap=softcap, num_sms=num_sms,
                             variant=variant, varlen=True)
    varlen_params(plan.params, total_q, total_k, window_left, window_right, bottom_right)
    return plan
