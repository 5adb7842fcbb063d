"""GPU backward: planner (pure Python, testable without a GPU) and launcher.

Three kernels in kernels_cu/bwd.cu, launched in order on the current stream:

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
   once; on compute capability 9.0 ``flash_bwd_dbias_sm90`` (dbias_sm90.cu, _gpu_dbias_sm90)
   where it covers the call, else ``flash_bwd_dbias``.

Extra device memory: D (4·b·h·s_q bytes) and the accumulator (4·b·h·s_q·d bytes), times
G = min(ceil(s_k / BN), resident blocks / (h_k · b)) in deterministic mode (see docs/backward.md).

``backward(dout, q, k, v, out, lse, dq, dk, dv, opts, dbias=None) -> str`` is the launcher the
API calls; with a bias or mask it runs the GENERAL variant (``flash_bwd<..., true, true, true>``)
and writes dbias (``dbias_plan`` says how dS is reduced to the bias's shape), except that on
compute capability 9.0 a bias without a mask runs the Hopper main kernel's BIAS variant
(_gpu_bwd_sm90) where it covers the call.
``backward_varlen`` runs packed sequences in one launch set (``plan_backward_varlen``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np

from . import _plan

ELEMS = _plan.ELEMS
HEAD_DIM_BUCKETS = _plan.HEAD_DIM_BUCKETS
_ELEM_SIZE = {"f16_t": 2, "bf16_t": 2, "f32x3_t": 4, "tf32_t": 4}

# (BM, NW, WD, NBUF) per (shared-memory class, element size) and head-dim bucket.
# BN = 16·NW/WD keys per block. Each warp holds dK and dV for 16 keys x D/WD columns in
# registers (D/WD floats per lane) plus Sᵀ and dPᵀ (BM/2 floats each); WD = 2 above 128 keeps
# that under the 255-register limit. Chosen from the ptxas reports (tests/test_compile_bwd.py).
_TILES = {
    ("big", 2): {32: (64, 8, 1, 2), 64: (64, 8, 1, 2), 96: (64, 8, 1, 2), 128: (32, 8, 1, 2),
                 160: (64, 8, 2, 2), 192: (32, 8, 2, 2), 224: (64, 8, 2, 1), 256: (32, 8, 2, 2)},
    ("small", 2): {32: (64, 8, 1, 2), 64: (64, 8, 1, 1), 96: (64, 8, 1, 1), 128: (32, 8, 1, 1),
                   160: (64, 8, 2, 1), 192: (32, 8, 2, 1), 224: (64, 4, 2, 1), 256: (32, 4, 2, 1)},
    ("big", 4): {32: (32, 4, 1, 2), 64: (32, 4, 1, 2), 96: (32, 4, 2, 2), 128: (32, 4, 1, 1),
                 160: (32, 4, 2, 1), 192: (32, 4, 2, 1), 224: (16, 4, 2, 1), 256: (16, 4, 2, 1)},
    ("small", 4): {32: (32, 4, 1, 2), 64: (32, 4, 1, 1), 96: (32, 4, 2, 1), 128: (32, 4, 2, 1),
                   160: (32, 4, 2, 1), 192: (32, 4, 4, 1), 224: (16, 4, 2, 1), 256: (16, 4, 4, 1)},
}


class BwdVariant(NamedTuple):
    """One template instantiation of flash_bwd."""

    elem: str
    d: int
    bm: int
    nw: int
    wd: int
    nbuf: int
    window: bool
    score_mod: bool
    general: bool = False   # GENERAL: bias (+ dbias) / mask / varlen (window and score_mod set)

    @property
    def bn(self) -> int:
        return 16 * self.nw // self.wd

    @property
    def name_expression(self) -> str:
        b = _plan.cpp_bool
        gen = ", true" if self.general else ""   # the template's default is false
        return (f"flash_bwd<{self.elem}, {self.d}, {self.bm}, {self.nw}, {self.wd}, "
                f"{self.nbuf}, {b(self.window)}, {b(self.score_mod)}{gen}>")

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
        return (f"bwd_{self.elem[:-2]}_d{self.d}_{self.bm}x{self.bn}w{self.nw}"
                f"s{self.wd}b{self.nbuf}{flags}")

    @property
    def threads(self) -> int:
        return 32 * self.nw

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.elem, self.d, self.bm, self.bn, self.nbuf)


def smem_bytes(elem: str, d: int, bm: int, bn: int, nbuf: int) -> int:
    """flash_bwd's dynamic shared memory: K, V [BN, pitch], NBUF x (Q, dO [BM, pitch]),
    dSᵀ [BN, BM + pad], NBUF x (lse, D [BM] float32). Mirrors BwdPitch / DsPitch in bwd.cu."""
    es = _ELEM_SIZE[elem]
    pr = d + 8 if es == 2 else d + 4
    pds = bm + 8 if es == 2 else bm + 4
    return (2 * bn * pr + 2 * nbuf * bm * pr + bn * pds) * es + 2 * nbuf * bm * 4


def tiles(elem: str, d_bucket: int, smem_optin: int,
          general: bool = False) -> Tuple[int, int, int, int]:
    """(BM, NW, WD, NBUF); ``general`` (bias / mask / varlen) uses the same tiles."""
    return _TILES[(_plan.smem_class(smem_optin), _ELEM_SIZE[elem])][d_bucket]


def all_variants(smem_optin: int = _plan.SM90_SMEM_MAX):
    """Every BwdVariant the planner can select on a device with this shared-memory limit."""
    out = []
    for elem in ELEMS:
        for dbk in HEAD_DIM_BUCKETS:
            bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin)
            for window in (False, True):
                for mod in (False, True):
                    out.append(BwdVariant(elem, dbk, bm, nw, wd, nbuf, window, mod))
            bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin, general=True)
            out.append(BwdVariant(elem, dbk, bm, nw, wd, nbuf, True, True, True))
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
                  smem_optin: int = _plan.SM90_SMEM_MAX, num_sms: int = 132,
                  variant: Optional[BwdVariant] = None, has_bias: bool = False,
                  has_mask: bool = False, varlen: bool = False) -> BwdPlan:
    """Choose the backward variant and launch shapes; fill the size/scalar fields of Params.

    A bias, a mask or varlen selects the GENERAL variant (the launcher fills their pointers,
    strides and the dbias mode: ``dbias_plan``)."""
    if h % h_k:
        raise ValueError(f"heads {h} is not a multiple of heads_k {h_k}")
    if min(b, s_q, s_k, h, h_k, d, d_v) < 1:
        raise ValueError("empty problem: the launcher handles zero sizes before planning")
    elem = _plan.elem_tag(dtype_name, allow_tf32)
    dbk = _plan.head_dim_bucket(d, d_v)
    general = has_bias or has_mask or varlen
    window = window_left >= 0 or window_right >= 0 or general
    score_mod = softcap > 0 or has_alibi or general
    if variant is None:
        bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin, general)
        variant = BwdVariant(elem, dbk, bm, nw, wd, nbuf, window, score_mod, general)
    elif (variant.elem != elem or variant.d < max(d, d_v) or (window and not variant.window)
          or (score_mod and not variant.score_mod) or (general and not variant.general)):
        raise ValueError(f"kernel {variant.name} cannot compute this problem")
    if variant.smem_bytes > smem_optin:
        raise NotImplementedError(
            f"{variant.name} needs {variant.smem_bytes} bytes of shared memory; the device "
            f"allows {smem_optin}")
    num_n = -(-s_k // variant.bn)
    if h_k > 65535 or b > 65535:
        raise NotImplementedError(f"grid ({num_n}, {h_k}, {b}) exceeds CUDA's grid limits")
    rows = b * h * s_q
    unbounded = s_q + s_k
    prm = np.zeros((), _plan.PARAMS_DTYPE)
    prm["b"], prm["h"], prm["h_k"], prm["h_per_hk"] = b, h, h_k, h // h_k
    prm["s_q"], prm["s_k"], prm["d"], prm["d_v"] = s_q, s_k, d, d_v
    prm["window_left"] = window_left if window_left >= 0 else unbounded
    prm["window_right"] = window_right if window_right >= 0 else unbounded
    prm["diag_offset"] = s_k - s_q if bottom_right else 0
    prm["num_m_blocks"] = -(-s_q // variant.bm)
    prm["scale_log2"] = scale * _plan.LOG2E
    prm["scale"] = scale
    if softcap > 0:
        prm["softcap_pre"] = scale / softcap
        prm["softcap_post"] = softcap * _plan.LOG2E
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

    mode: int                     # Params.dbias_mode (DBIAS_* bits of common.cuh), -1: zero
    slabs: int                    # float32 slabs of the reduced shape
    shape: Tuple[int, ...]        # the bias's 4-D shape (each dimension 1 or full)
    strides: Tuple[int, ...]      # element strides inside one slab, 0 along size-1 dims


DBIAS_ROWS, DBIAS_ATOMIC, DBIAS_SLAB_B, DBIAS_SLAB_H = 1, 2, 4, 8
DBIAS_STORE = 16   # Hopper backward only: each element has one writer, plain stores
DBIAS_SCHED_B = 32  # Hopper backward only: work tiles batch-fastest (dbias summed over batch)
HOPPER_SCHED_B = True   # use DBIAS_SCHED_B (a switch for A/B measurements)
DBIAS_KERNEL = None     # the dbias-kernel path where eligible: None = use_dbias_kernel decides
                        # (the Hopper dbias kernel covers the call, deterministic mode, or the
                        # float32 accumulator does not fit); True / False force it (A/B, tests)
DBIAS_SM90 = True       # where that dbias kernel runs: on compute capability 9.0 the Hopper one
                        # (flash_bwd_dbias_sm90, _gpu_dbias_sm90) wherever it covers the call;
                        # False: always the portable flash_bwd_dbias (A/B, tests)


def hopper_dbias_mode(dplan: "DbiasPlan", b: int, h: int) -> int:
    """Params.dbias_mode for the Hopper backward: dbias_plan's bits, plus DBIAS_STORE where each
    element has one writer (single_writer) and DBIAS_SCHED_B where dbias sums over a batch > 1
    (the blocks adding into the same dbias tile then run at the same time: L2 hits, not a
    read of the float32 accumulator from DRAM per batch entry)."""
    mode = dplan.mode
    if single_writer(dplan.shape, b, h):
        mode |= DBIAS_STORE
    if HOPPER_SCHED_B and dplan.shape[0] == 1 and b > 1 and dplan.shape[2] > 1:
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


class DbiasVariant(NamedTuple):
    """One instantiation of flash_bwd_dbias (bwd.cu): dbias planes summed in registers."""

    elem: str
    d: int        # head-dim bucket (covers d and d_v)
    bm: int       # queries per tile (BM / 16 warps)
    bn: int       # keys per tile
    nbuf: int = 1  # 2: the next (batch, head) pair's tiles load while this one is computed

    @property
    def name_expression(self) -> str:
        return f"flash_bwd_dbias<{self.elem}, {self.d}, {self.bm}, {self.bn}, {self.nbuf}>"

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
        """NBUF x (Q, dO [BM, pitch], K, V [BN, pitch], lse and D [BM] float32); BwdPitch in bwd.cu."""
        es = _ELEM_SIZE[self.elem]
        pr = self.d + 8 if es == 2 else self.d + 4
        return self.nbuf * ((2 * self.bm + 2 * self.bn) * pr * es + 2 * self.bm * 4)


#: flash_bwd_dbias tiles (BM, BN, NBUF), first choice first: the first whose shared memory fits
#: the device (two buffers: one block per SM whose loads overlap its own products) or, with one
#: buffer, DBIAS_SMEM_CAP (at most half an H100 / H200 SM: blocks overlap each other instead).
DBIAS_TILES = ((128, 64, 2), (64, 64, 1), (64, 32, 1), (32, 32, 1), (32, 16, 1), (16, 16, 1))
DBIAS_SMEM_CAP = 112 * 1024


def dbias_variant(elem: str, d_bucket: int,
                  smem_optin: int = _plan.SM90_SMEM_MAX) -> DbiasVariant:
    """The flash_bwd_dbias instantiation for this element type and head-dim bucket."""
    for bm, bn, nbuf in DBIAS_TILES:
        v = DbiasVariant(elem, d_bucket, bm, bn, nbuf)
        if v.smem_bytes <= (smem_optin if nbuf == 2 else min(smem_optin, DBIAS_SMEM_CAP)):
            return v
    raise NotImplementedError(f"no flash_bwd_dbias tile fits {smem_optin} bytes of shared memory")


def all_dbias_variants(smem_optin: int = _plan.SM90_SMEM_MAX):
    """Every DbiasVariant the launcher can select on a device with this shared-memory limit."""
    return [dbias_variant(e, d, smem_optin) for e in ELEMS for d in HEAD_DIM_BUCKETS]


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
    float32 accumulator: ``forced`` (DBIAS_KERNEL) when not None; else in deterministic mode (no
    slabs, same bits every run) and where the Hopper dbias kernel covers the call
    (``hopper_dbias``; measured on the H200, session 9: the whole bias backward 1.15-1.48x faster
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
    return 2.5 * _plan.flops(b, h, s_q, s_k, d, d_v, causal)


# ------------------------------------------------------------------------------------------
# Compilation (one RawModule per main variant, holding the two helper kernels of its dtype)
# ------------------------------------------------------------------------------------------
def program(variants):
    """(source, options, name expressions) compiling ``variants`` (all BwdVariant, from bwd.cu,
    or all Sm90BwdVariant, from bwd_sm90.cu) and their helper kernels (``helper_expressions``)."""
    from . import _modules
    src, opts, names = _modules.program(variants, file=getattr(variants[0], "file", "bwd.cu"))
    helpers = []
    for v in variants:
        for n in v.helper_expressions:
            if n not in helpers:
                helpers.append(n)
    return src, opts, names + helpers


_functions = {}   # (device id, variant class, variant) -> (main, *helpers) RawKernels


def get_functions(variant, device_id: int):
    """(main, *helpers in helper_expressions order) kernels of a BwdVariant ((main, pre, dq)) or
    Sm90BwdVariant ((main, pre, pre_portable, dq)) on ``device_id`` (lazy)."""
    key = (device_id, type(variant), variant)
    fns = _functions.get(key)
    if fns is None:
        import cupy
        src, opts, names = program([variant])
        mod = cupy.RawModule(code=src, options=opts, name_expressions=names)
        main = mod.get_function(variant.name_expression)
        if variant.smem_bytes > 48 * 1024:
            main.max_dynamic_shared_size_bytes = variant.smem_bytes
        fns = _functions[key] = (main,) + tuple(mod.get_function(n) for n in variant.helper_expressions)
    return fns


def precompile(variants, workers: int = 8):
    """Fill CuPy's disk cache for ``variants`` (same programs as get_functions) in processes."""
    from . import _modules
    return _modules.precompile(variants, workers, program_fn=program)


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
        main = get_functions(variant, dev_id)[0]    # a RawKernel; .kernel: its CUfunction
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(main.kernel.ptr, variant.threads,
                                                                   variant.smem_bytes)
        n = _RESIDENT[key] = num_sms * max(1, per_sm)
    return n


def _elem_strides(a, what):
    """(batch, seq, head) strides in elements of a 4-D bshd array with a unit last stride."""
    from . import _gpu
    if a.ndim != 4:
        raise ValueError(f"{what}: expected a 4-D bshd array, got shape {a.shape}")
    return _gpu._elem_strides(a, what)[:3]


def _checks(dout, q, k, v, out, lse, dq, dk, dv):
    """dtype name of a launchable problem (same dtype everywhere, float32 contiguous lse)."""
    from . import _gpu

    name = _gpu._DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise NotImplementedError(f"GPU backward: dtype {q.dtype} (float16, bfloat16, float32)")
    for a, w in ((k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (dq, "dq"), (dk, "dk"),
                 (dv, "dv")):
        if a.dtype != q.dtype:
            raise ValueError(f"{w} has dtype {a.dtype}, q has {q.dtype}")
    if lse.dtype != np.float32 or not lse.flags.c_contiguous:
        raise ValueError("lse must be a contiguous float32 array")
    return name


def _device():
    """(device id, smem opt-in, SM count) of the current device; sm_80+ required."""
    import cupy
    from . import _gpu

    dev_id = cupy.cuda.runtime.getDevice()
    cc, smem, _ = _gpu._info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU backward needs compute capability 8.0 or newer; device {dev_id} is sm_{cc}")
    num_sms = _NUM_SMS.get(dev_id)
    if num_sms is None:   # Device.attributes queries every attribute: once per device
        num_sms = _NUM_SMS[dev_id] = cupy.cuda.Device(dev_id).attributes["MultiProcessorCount"]
    return dev_id, smem, num_sms


def _fill_and_launch(plan, dout, q, k, v, out, lse, dq, dk, dv, opts, dev_id, *,
                     zero_batch_strides=False, extra=None, hopper=None,
                     hopper_accum=True, after=None):
    """Strides, pointers, ALiBi slopes into the plan's Params; D and dQ accumulator allocated;
    ``extra(prm)`` writes the GENERAL fields; the three kernels launched in order, or
    ``hopper(prm)`` launches them with the Hopper main kernel (None: it could not).
    ``hopper_accum=False``: the Hopper kernels add dQ into dq (bwd_sm90_f32.cu), so the
    accumulator is allocated only if ``hopper`` falls back. ``after(prm)`` launches more
    kernels reading the same Params (the 0-d array; flash_bwd_dbias or flash_bwd_dbias_sm90)
    after the main kernels, while D is alive."""
    import cupy

    from . import _gpu

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
    prm["vec_ok"] = int(_plan.vec_ok(ptrs, strides, q.dtype.itemsize))
    alibi = _gpu.set_alibi(prm, opts.alibi_slopes)
    rows = plan.params["dq_accum_slab"] // max(1, int(plan.params["d"]))
    dsum = cupy.empty(rows, np.float32)
    for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse), ("dout", dout),
                 ("dq", dq), ("dk", dk), ("dv", dv), ("dsum", dsum)):
        prm[n] = a.data.ptr

    def accumulator():   # the float32 dQ accumulator (all slabs), its address in prm
        # deterministic slabs are added into (zeroed here); atomic mode's is zeroed by flash_bwd_pre
        a = (cupy.zeros if prm["deterministic"] else cupy.empty)(plan.accum_elems, np.float32)
        prm["dq_accum"] = a.data.ptr
        return a

    accum = accumulator() if hopper is None or hopper_accum else None
    keep = extra(prm) if extra is not None else ()
    ran = hopper(prm) if hopper is not None else None
    if ran is None:
        if accum is None:
            accum = accumulator()
        main, pre, conv = get_functions(plan.variant, dev_id)
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
    bias_f32) from _gpu.bias_operand for a call with a bias (no mask): the BIAS variant then runs
    where the bias layout allows it (_gpu_bwd_sm90.bias_unsupported)."""
    from . import _gpu
    from . import _gpu_bwd_sm90 as h90

    if name == "float32":   # bwd_sm90_f32.cu: dense calls without a bias only
        from . import _gpu_bwd_sm90_f32
        if varlen is None and bias_operand is None:
            return _gpu_bwd_sm90_f32.launcher(plan, name, dout, q, k, v, opts, dev_id, smem,
                                              num_sms, forced)
        if forced:
            raise ValueError("kernel='sm90': the Hopper backward cannot run this call: float32 "
                             "with a bias or packed sequences (bwd_sm90_f32.cu is dense only)")
        return None
    cc = _gpu._info(dev_id)[0]
    why = h90.unsupported(
        name, q.shape[3], v.shape[3], scale=float(opts.scale),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        deterministic=bool(opts.deterministic), cc=cc, smem_optin=smem,
        tensors=[(a.shape, _gpu._elem_strides(a, t))
                 for a, t in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"))])
    bias_kind = 0
    if why is None and opts.mask is not None:
        why = "a boolean mask (not in the Hopper backward)"
    if why is None and varlen is not None:   # the kernel's int work-tile count
        nseq, max_k = varlen
        if -(-int(max_k) // h90.BN) * k.shape[2] * int(nseq) > 2**31 - 1:
            why = (f"{nseq} sequences x {k.shape[2]} kv heads x the longest sequence's key tiles "
                   "exceed 2^31 - 1 work tiles")
    if why is None and bias_operand is not None:
        b_arr, f32 = bias_operand
        why = h90.bias_unsupported(_gpu.broadcast_strides(b_arr), k.shape[1],
                                   b_arr.data.ptr, b_arr.itemsize)
        bias_kind = h90.BIAS_LD32 if f32 else h90.BIAS_LD16
        if (not f32 and h90.smem_bytes(q.shape[3], bias_tma=True) <= smem
                and h90.bias_tma_unsupported(b_arr.shape, _gpu.broadcast_strides(b_arr), q.shape[1],
                                             b_arr.data.ptr, b_arr.itemsize) is None):
            bias_kind = h90.BIAS_TMA   # the bias tile staged by TMA (else the consumers load it)
    if why is not None:
        if forced:
            raise ValueError(f"kernel='sm90': the Hopper backward cannot run this call: {why}")
        return None
    # (a GENERAL plan always has window set: the Hopper variant only where a side is bounded)
    window = int(opts.window_left) >= 0 or int(opts.window_right) >= 0
    variant = h90.variant_for(plan.variant.elem, q.shape[3], window, bias_kind,
                              varlen=varlen is not None)

    def hopper(prm):
        ran = h90.launch(variant, prm, plan.pre_grid, q, k, v, dout, dev_id, num_sms, varlen,
                         bias=bias_operand[0] if bias_operand is not None else None)
        if ran is None and forced:
            raise ValueError("kernel='sm90': a base address is not 16-byte aligned")
        return ran

    return hopper


def _dbias_sm90_variant(name, q, k, v, dout, operand, opts, dplan, dev_id, smem):
    """The Hopper dbias kernel's variant for an eligible call (None: DBIAS_SM90 off, a base
    address TMA cannot take, or _gpu_dbias_sm90.unsupported names a reason; the call then keeps
    the default of other devices, use_dbias_kernel)."""
    if not DBIAS_SM90:
        return None
    from . import _gpu, _gpu_dbias_sm90 as d90
    b_arr = operand[0]
    if not d90.bases_aligned(q, k, v, dout, b_arr):
        return None
    shape = dplan.shape
    why = d90.unsupported(
        name, q.shape[3], v.shape[3], cc=_gpu._info(dev_id)[0], smem_optin=smem,
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        has_mask=opts.mask is not None,
        tensors=[(a.shape, _gpu._elem_strides(a, t))
                 for a, t in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"))],
        bias_shape=b_arr.shape, bias_strides=_gpu.broadcast_strides(b_arr),
        bias_itemsize=b_arr.itemsize, s_q=q.shape[1], s_k=k.shape[1],
        planes=shape[0] * shape[1])
    if why is not None:
        return None
    window = int(opts.window_left) >= 0 or int(opts.window_right) >= 0
    return d90.variant_for(_plan.elem_tag(name, False), q.shape[3], b_arr.itemsize == 4, window)


def backward(dout, q, k, v, out, lse, dq, dk, dv, opts, *, kernel=None, dbias=None) -> str:
    """dq, dk, dv [...] = gradients of attention(q, k, v) at dout; returns the variant's name.

    dout, out [b, s_q, h, d_v]; q [b, s_q, h, d]; k [b, s_k, h_k, d]; v [b, s_k, h_k, d_v]:
    CuPy bshd views of one dtype with a contiguous last dimension; lse float32 [b, h, s_q]
    contiguous (natural log, -inf for rows that see no key); dq, dk, dv preallocated with
    q, k, v's shapes and dtype (any strides). Current device and stream. ``kernel``: None or
    "auto" (the planner: the Hopper main kernel, _gpu_bwd_sm90, on compute capability 9.0 where
    it covers the call, else the portable one), "portable", "sm90" (ValueError where it cannot
    run), or a BwdVariant to force (tuning, benchmarks); anything else is a ValueError. On
    float32 the Hopper main kernel is bwd_sm90_f32.cu (_gpu_bwd_sm90_f32: 3xTF32, hd 64 / 128, dense,
    no softcap / ALiBi / bias / mask, not deterministic); other float32 calls run bwd.cu.
    With ``opts.bias`` / ``opts.mask`` the GENERAL variant runs (a bias without a mask: the Hopper
    kernel's BIAS variant on compute capability 9.0 where it covers the call); ``dbias`` (a CuPy
    array of opts.bias's 4-D shape, any float dtype) then receives dS summed over the bias's
    broadcast dimensions (float32 accumulation; ``dbias_plan`` says how, plus
    ``hopper_dbias_mode`` on the Hopper kernel; or a dbias kernel where ``dbias_by_kernel``
    allows and ``use_dbias_kernel`` takes it). Raises NotImplementedError for
    head dims > 256, other dtypes, pre-sm_80 GPUs.
    """
    import cupy

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
    if opts.deterministic:
        plan = with_dq_slabs(plan, _resident_blocks(plan.variant, dev_id, num_sms))
    if kernel == "sm90" and plan.variant.general and bias is None:   # a mask alone
        raise ValueError("kernel='sm90': the Hopper backward cannot run this call: a boolean "
                         "mask (not in the Hopper backward)")
    hopper = None
    operand = None   # _gpu.bias_operand(bias, q.dtype), once made
    if (kernel is None or kernel == "sm90") and (not plan.variant.general or bias is not None):
        if bias is not None:
            from . import _gpu
            operand = _gpu.bias_operand(bias, q.dtype)
        hopper = _hopper_launcher(plan, name, dout, q, k, v, opts, dev_id, smem, num_sms,
                                  forced=kernel == "sm90", bias_operand=operand)
    extra = after = None
    dplan = accum = by_kernel = dbias90 = None
    if plan.variant.general:
        from . import _gpu

        if bias is not None:
            dplan = dbias_plan(bias.shape, b, h_k, bool(opts.deterministic))
            hopper_mode = hopper_dbias_mode(dplan, b, h)
            if operand is None:
                operand = _gpu.bias_operand(bias, q.dtype)
            direct = (dplan.slabs == 1 and dbias.dtype == np.float32
                      and dbias.flags.c_contiguous and dbias.shape == dplan.shape
                      and dbias.data.ptr % 8 == 0)   # Hopper: 8-byte pairs
            eligible = (dbias.flags.c_contiguous and dbias.shape == dplan.shape
                        and dbias_by_kernel(dplan, dbias.dtype, operand[0].dtype, direct))
            if eligible:
                dbias90 = _dbias_sm90_variant(name, q, k, v, dout, operand, opts, dplan, dev_id,
                                              smem)
            if eligible and use_dbias_kernel(DBIAS_KERNEL, bool(opts.deterministic),
                                             dbias90 is not None):
                by_kernel = dbias_variant(plan.variant.elem, plan.variant.d, smem)
            elif dplan.mode >= 0:
                if direct:   # the float32 output is its own accumulator
                    accum = dbias.reshape(-1)
                    accum.fill(0)
                else:
                    try:
                        accum = cupy.zeros(dplan.slabs * int(np.prod(dplan.shape)), np.float32)
                    except cupy.cuda.memory.OutOfMemoryError:   # no room: dbias without it
                        if not eligible or DBIAS_KERNEL is False:
                            raise
                        by_kernel = dbias_variant(plan.variant.elem, plan.variant.d, smem)

        def extra(prm):
            keep = _gpu.set_bias_mask(prm, opts, q.dtype, operand)
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
                    from . import _gpu_dbias_sm90
                    if _gpu_dbias_sm90.launch(dbias90, prm, q, k, v, dout, operand[0], dev_id,
                                              num_sms) is not None:
                        return
                rec = prm.reshape(1)[0]
                fn = get_functions(by_kernel, dev_id)[0]
                grid = (-(-s_k // by_kernel.bn), -(-s_q // by_kernel.bm),
                        (b if dplan.shape[0] > 1 else 1) * (h if dplan.shape[1] > 1 else 1))
                fn(grid, (by_kernel.threads, 1, 1), (rec,), shared_mem=by_kernel.smem_bytes)

    # float32: the Hopper kernel (bwd_sm90_f32.cu) adds dQ into dq, no accumulator
    res = _fill_and_launch(plan, dout, q, k, v, out, lse, dq, dk, dv, opts, dev_id, extra=extra,
                           hopper=hopper, hopper_accum=name != "float32", after=after)
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
    """Gradients of _gpu.forward_varlen in one launch set: the Hopper main kernel's VARLEN
    variant (_gpu_bwd_sm90) on compute capability 9.0 where it covers the call (same rules as
    the dense backward), else the portable GENERAL variant. ``kernel``: "auto", "sm90"
    (ValueError naming the reason where the Hopper kernel cannot run the call) or "portable".

    dout, out [1, total_q, h, d_v]; q [1, total_q, h, d]; k [1, total_k, h_k, d]; v [1, total_k,
    h_k, d_v] (CuPy bshd views of the packed tokens); lse float32 [h, total_q] contiguous from
    the varlen forward; cu_seqlens_q / _k int32 CuPy [batch + 1]; dq, dk, dv preallocated like
    q, k, v (every element written). Returns the variant's name (``bwd90_…_varlen`` for Hopper).
    """
    import cupy

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
    if opts.deterministic:
        plan = with_dq_slabs(plan, _resident_blocks(plan.variant, dev_id, num_sms))
    cq = cupy.ascontiguousarray(cu_seqlens_q, dtype=np.int32)
    ck = cupy.ascontiguousarray(cu_seqlens_k, dtype=np.int32)

    def extra(prm):
        prm["cu_seqlens_q"], prm["cu_seqlens_k"] = cq.data.ptr, ck.data.ptr
        return (cq, ck)

    hopper = None
    if kernel != "portable":
        hopper = _hopper_launcher(plan, name, dout, q, k, v, opts, dev_id, smem, num_sms,
                                  forced=kernel == "sm90", varlen=(nseq, int(max_seqlen_k)))
    return _fill_and_launch(plan, dout, q, k, v, out, lse, dq, dk, dv, opts, dev_id,
                            zero_batch_strides=True,
                            extra=extra, hopper=hopper)


__all__ = ["BwdVariant", "BwdPlan", "plan_backward", "plan_backward_varlen", "dbias_plan",
           "DbiasPlan", "DbiasVariant", "dbias_variant", "all_dbias_variants", "dbias_by_kernel",
           "use_dbias_kernel",
           "all_variants", "backward", "backward_varlen", "tiles", "smem_bytes", "flops", "program",
           "precompile"]
