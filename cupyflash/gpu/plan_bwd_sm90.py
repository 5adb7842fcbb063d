"""Hopper (sm_90a) backward main kernel, planner side (pure Python): variants, coverage, shared
memory, work decomposition. bwd_sm90.py launches it.

``flash_bwd_sm90<E, D, WINDOW, DQ_BULK, KVBUF, VARLEN, BIAS, DET>`` in kernels_cu/hopper/bwd.cu replaces the
portable main kernel (flash_bwd in portable/bwd.cu) on compute capability 9.0 wherever it covers the call; the helper
kernels before it (``flash_bwd_pre_sm90``: D = rowsum(dO ∘ O) with the zeroed dQ accumulator; portable/bwd.cu's
``flash_bwd_pre`` when O's rows are not 16-byte aligned) and after it (``flash_bwd_dq_sm90``: the dQ
conversion) are compiled into the same module. Coverage (``why_unsupported`` says why not):
float16 / bfloat16, d = d_v in {64, 128, 256} (256: no bias),
no softcap / ALiBi, scale > 0, strides TMA accepts
(16-byte multiples) for q, k, v and dout; an additive bias with dbias where ``bias_unsupported``
accepts its layout (no mask: the launcher keeps masks on the portable GENERAL kernel), not in
deterministic mode (dbias is added with atomics). The BIAS template argument says how the bias is read:
BIAS_TMA (3) stages q's 16-bit bias per step into shared memory through a tensor map, where
``bias_tma_unsupported`` allows (a full query dimension, 16-byte strides); otherwise the consumers
load it from global memory (1: q's 16-bit type, 2: float32).

Persistent grid (at most one block per SM) over work tiles (key tile of 128 keys, kv head, batch),
drawn from the per-stream counter the forward uses (``device.sched_counter``): a producer warpgroup
loads each tile's K, V (KVBUF buffers: 2 at d = 64, 1 at d = 128, where two do not fit) and the
Q / dO tiles of 64 query rows per step through TMA, the next tile's while the consumers finish the
current one; two consumer warpgroups of 64 keys each keep dK, dV in registers; each step's dQ tile
goes through shared memory into the float32 accumulator (one cp.reduce.async.bulk .add.f32 by a
producer warp). The accumulator's rows are chunk-swizzled (hopper/bwd.cu: dq_swizzle), so the dQ
conversion is flash_bwd_dq_sm90.

Head dim 256 (``split_d``): dK, dV [64 keys, 256] would take all of a consumer's registers, so the
work tile is 64 keys and both consumers take them, each with half the head dim
(hopper/bwd_split_consumer.cuh: c0 computes Sᵀ and Pᵀ, c1 dPᵀ and dSᵀ, handed over in shared
memory); one K / V buffer, no dQ tile in shared memory (64 KB more than the block has): each
consumer adds its dQ slice into the accumulator with red.global.add (``dq_bulk`` False); DET
orders those adds per (dQ tile, column half) on two semaphores per tile
(``dq_semaphores(..., parts=2)``).
``TUNING.bwd_sm90_d256`` lets the planner route such calls to it (``kernel="sm90"`` runs it
whatever the switch).

DET (``deterministic=True``): each dQ tile of 64 query rows of one (sequence, query head) receives
the additions of the key tiles that touch it in key-tile order (descending by default), each
waiting on an int32 semaphore (the rank of its key tile among them: ``dq_rank``) that the
previous one releases after its bulk reduce has landed. ``Params.det_sched`` (``det_sched``)
sets the order and how the work tiles are numbered (``det_work_tile``: (kv head, batch) pairs in
groups, key-tile-major) and a tile's steps run query tiles outer, the group's heads inner
(``steps``). The semaphores follow the accumulator in the same allocation (``dq_semaphores``;
zeroed per call), the accumulator is one slab as in atomic mode. docs/hopper.md has the ordering
and deadlock-freedom argument.

VARLEN (``backward_varlen``): work tiles over (key tile of the longest sequence, kv head,
sequence) on the packed [1, total, h, d] tensors; lse, D and the accumulator are [h, total_q]
rows; tiles past a sequence's keys are skipped by the producer; the helper kernels see the packed
tokens as one batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .variants import KernelVariant, cpp_bool, sm90_common_unsupported


BN = 128             # keys per block (head dims 64, 128)
BN_SPLIT = 64        # keys per block at head dim 256 (both consumers on the same keys)
BM = 64              # query rows per step
THREADS = 384
HEAD_DIMS = (64, 128, 256)
SPLIT_D = 256        # the head dim whose consumers split the head dim between them
NBUF = 2             # Q / dO ring depth
TILE_RING = 2        # work-tile indices in flight


#: BIAS template values (hopper/bwd.cu: sm90b::BIAS_*)
BIAS_NONE, BIAS_LD16, BIAS_LD32, BIAS_TMA = 0, 1, 2, 3


def kv_buffers(d: int) -> int:
    """K / V buffers (KVBUF): two where they fit in shared memory (d = 64), else one."""
    return 2 if d == 64 else 1


def bn_for(d: int) -> int:
    """Keys per work tile of the head dim (sm90b::Layout::BN)."""
    return BN_SPLIT if d == SPLIT_D else BN


@dataclass(frozen=True)
class Sm90BwdVariant(KernelVariant):
    """One template instantiation of flash_bwd_sm90 (plus its dtype's helper kernels)."""

    elem: str
    d: int
    window: bool
    dq_bulk: bool = True   # dQ tile via shared memory + one bulk reduce-add (else red.global)
    kvbuf: int = 1         # K / V buffers: 2 loads the next work tile's K, V during this one's steps
    varlen: bool = False   # packed sequences (cu_seqlens), backward_varlen
    bias: int = 0          # additive bias (+ dbias): BIAS_NONE, BIAS_LD16 (the inputs' 16-bit type),
                           # BIAS_LD32 (float32), BIAS_TMA (16-bit, staged by TMA)
    det: bool = False      # deterministic dQ: key tiles add in order (semaphores; no bias)

    file = "hopper/bwd.cu"
    arch_options = ("-arch=sm_90a",)
    bm = BM
    threads = THREADS

    template = "flash_bwd_sm90"

    @property
    def bn(self) -> int:
        return bn_for(self.d)

    def template_args(self) -> tuple:
        b = cpp_bool
        det = ("true",) if self.det else ()   # the template's default is false
        return (self.elem, str(self.d), b(self.window), b(self.dq_bulk), str(self.kvbuf),
                b(self.varlen), str(self.bias)) + det

    @property
    def pre_expression(self) -> str:
        return f"flash_bwd_pre_sm90<{self.elem}, {self.d}>"

    @property
    def pre_portable_expression(self) -> str:   # O's rows not 16-byte aligned
        return f"flash_bwd_pre<{self.elem}>"

    @property
    def dq_expression(self) -> str:
        return f"flash_bwd_dq_sm90<{self.elem}, {self.d}>"

    @property
    def helper_expressions(self):
        return (self.pre_expression, self.pre_portable_expression, self.dq_expression)

    @property
    def name(self) -> str:
        return (f"bwd90_{self.elem[:-2]}_d{self.d}_{BM}x{self.bn}" + ("_window" if self.window else "")
                + ("" if self.dq_bulk else "_red") + (f"_kv{self.kvbuf}" if self.kvbuf != 1 else "")
                + ("_varlen" if self.varlen else "")
                + ("", "_bias16", "_bias32", "_bias16_tma")[self.bias]
                + ("_det" if self.det else ""))

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.d, self.kvbuf, self.bias == BIAS_TMA, self.det)


def smem_bytes(d: int, kvbuf: int = None, bias_tma: bool = False, det: bool = False) -> int:
    """Mirrors sm90b::Layout in hopper/bwd_parts.cuh: KVBUF x K, V [BN, d]; NBUF x (Q, dO [64, d]); two
    dSᵀ [BN, 64] buffers (16-bit; d = 256: dSᵀ and Pᵀ); the dQ tile [64, d] float32 (not at
    d = 256); ``bias_tma``: NBUF x the bias tile [64, BN] (16-bit); NBUF x (lse, D [64] floats);
    the work-tile ring and dQ job (16 + 16 bytes, ``det``: + 16); the mbarriers (d = 256: + Pᵀ's
    two); 1024 bytes of slack to align the swizzled panels. ``kvbuf`` defaults to kv_buffers(d)."""
    kvbuf = kv_buffers(d) if kvbuf is None else kvbuf
    bn, split = bn_for(d), d == SPLIT_D
    return (2 * kvbuf * bn * d * 2 + 2 * NBUF * BM * d * 2 + 2 * bn * BM * 2
            + (0 if split else BM * d * 4)
            + (NBUF * BM * bn * 2 if bias_tma else 0)
            + NBUF * 2 * BM * 4 + 16 + (32 if det else 16)
            + 8 * (2 * kvbuf + 2 * NBUF + 2 + 2 * TILE_RING + (2 if split else 0)) + 1024)


def variant_for(elem: str, d: int, window: bool, bias: int = 0,
                varlen: bool = False, det: bool = False) -> "Sm90BwdVariant":
    """The variant the launcher runs for this element type, head dim, mask kind, bias kind
    (BIAS_NONE, BIAS_LD16, BIAS_LD32, BIAS_TMA), layout (``varlen``: packed sequences; never
    with a bias) and dQ order (``det``: deterministic; never with a bias)."""
    assert not (varlen and bias), "the varlen backward takes no bias"
    assert not (det and bias), "the deterministic Hopper backward takes no bias"
    assert d != SPLIT_D or not bias, "head dim 256: no bias"
    return Sm90BwdVariant(elem, d, window, d != SPLIT_D, kv_buffers(d), varlen, bias, det)


def variants():
    """Every Sm90BwdVariant (compiled by the harness for sm_90a): dense without and with a bias
    (each BIAS kind), varlen, and the deterministic dense and varlen ones (head dim 256: those
    without a bias)."""
    return [variant_for(e, d, w, bias, vl, det) for e in ("f16_t", "bf16_t") for d in HEAD_DIMS
            for w in (False, True)
            for bias, vl, det in ((BIAS_NONE, False, False), (BIAS_LD16, False, False),
                                  (BIAS_LD32, False, False), (BIAS_TMA, False, False),
                                  (BIAS_NONE, True, False), (BIAS_NONE, False, True),
                                  (BIAS_NONE, True, True))
            if d != SPLIT_D or not bias]


def dq_semaphores(rows: int, slabs: int, parts: int = 1) -> int:
    """int32 semaphores of a DET launch (after the accumulator's floats): ``parts`` per BM-row
    tile (head dim 256: one per consumer's column half) of each of the ``slabs`` (sequence, query
    head) slabs of the accumulator's ``rows`` rows, at index parts · (floor(R / BM) + slab) + part
    (``dq_semaphore_index``), all below parts · (ceil(rows / BM) + slabs)."""
    return parts * (-(-rows // BM) + slabs)


def dq_semaphore_index(slab: int, row0: int, m0: int, parts: int = 1, part: int = 0) -> int:
    """Mirror of hopper/bwd_parts.cuh dq_sem: the semaphore of the dQ tile whose first row is m0
    of slab number ``slab`` (dense: batch · h + head; varlen: head · sequences + sequence), whose
    first accumulator row is ``row0`` (``part`` of its ``parts``)."""
    return parts * ((row0 + m0) // BM + slab) + part


def steps(m_first: int, m_count: int, kv_head: int, group: int, det: bool = False,
          descending: bool = True):
    """Mirror of a work tile's step order (hopper/sched.cuh step_head / step_m0; the producer's
    counters in hopper/bwd.cu): (query head, query tile) of each step. Query head outer and query
    tiles ascending; ``det``: query tiles outer, the group's heads inner, query tiles ascending
    where the key tiles add in ``descending`` order, else descending."""
    heads = range(kv_head * group, (kv_head + 1) * group)
    if det:
        ms = range(m_first, m_first + m_count)
        return [(hd, m) for m in (ms if descending else reversed(ms)) for hd in heads]
    return [(hd, m) for hd in heads for m in range(m_first, m_first + m_count)]


def dq_rank(n_block: int, m_block: int, diag: int, window_left: int, window: bool = True, *,
            descending: bool = False, s_q: int = 0, s_k: int = 0, window_right: int = 0,
            bn: int = BN) -> int:
    """Mirror of hopper/bwd_parts.cuh dq_rank: the semaphore value key tile ``n_block`` (of ``bn``
    keys: bn_for(d)) waits for before adding into query tile ``m_block`` of a sequence (s_q, s_k,
    diag): the key tiles that touch it are n_lo .. n_hi; ascending order: n_block − n_lo,
    ``descending``: n_hi − n_block. Window sides are Params values (unbounded: s_q + s_k)."""
    if descending:
        last_row = min(m_block * BM + BM, s_q) - 1
        n_hi = (min(s_k - 1, last_row + diag + window_right) if window else s_k - 1) // bn
        return n_hi - n_block
    n_lo = max(0, m_block * BM + diag - window_left) // bn if window else 0
    return n_block - n_lo


#: Key tiles of one (kv head, batch) pair kept running together in the deterministic order
#: (``det_sched``): at least this many (or all of them), as the default order's key-tile-fastest
#: numbering does, so that their Q / dO reads and dQ additions meet in L2.
DET_TILES_TOGETHER = 8


def det_group(num_n: int, pairs: int, grid: int) -> int:
    """(kv head, batch) pairs per draw group of the deterministic order: the grid spread over as
    many pairs as keep min(num_n, DET_TILES_TOGETHER) key tiles of each running together
    (grid // that), at most all pairs. Blocks that become free at the same moment then draw
    key tiles of different pairs, which do not wait on each other's dQ additions; key tiles
    of one pair started together would (each waits for the previous one's addition to land:
    lab/det_order_model.py)."""
    return max(1, min(pairs, grid // min(num_n, DET_TILES_TOGETHER)))


#: Key tiles per sequence from which the deterministic order is ascending with one pair per draw
#: group (the first version's order) instead of descending with draw groups. bf16, 16k tokens,
#: det/default on the H200 (lab/bench_det_bwd.py): at 16k (128 key tiles) ascending 0.914-0.942
#: against descending 0.747-0.943 (hd 64 / 128, causal and not); at 4k (32) and 1k descending
#: 0.896-1.008 against ascending 0.360-0.875.
DET_ASCENDING_FROM = 128


def det_order(num_n: int, pairs: int, grid: int) -> Tuple[bool, int]:
    """(descending, pairs per draw group) the deterministic backward uses by default."""
    if num_n >= DET_ASCENDING_FROM:
        return False, 1
    return True, det_group(num_n, pairs, grid)


def det_sched(num_n: int, pairs: int, grid: int, descending: Optional[bool] = None,
              group: Optional[int] = None) -> int:
    """Params.det_sched of a DET launch: 2 · (pairs per draw group) + (1: key tiles add in
    descending order). ``descending`` / ``group`` default to TUNING.det_descending /
    TUNING.det_group; where both are None, ``det_order`` decides both; an order given without a
    group takes ``det_group``'s."""
    from .tuning import TUNING
    if descending is None:
        descending = TUNING.det_descending
    if group is None:
        group = TUNING.det_group
    if descending is None:
        descending, auto_group = det_order(num_n, pairs, grid)
        if group is None:
            group = auto_group
    if group is None:
        group = det_group(num_n, pairs, grid)
    return 2 * max(1, min(int(group), pairs)) + int(bool(descending))


def det_work_tile(w: int, num_n: int, pairs: int, sched: int):
    """Mirror of hopper/sched.cuh key_tile's DET numbering: work tile ``w`` -> (key tile, pair),
    pair = kv_head + h_k · batch. Pairs in groups of sched // 2, each group's tiles key-tile-major
    (its pairs inner), key tiles descending where sched is odd."""
    g0 = max(1, sched >> 1)
    first = w // (g0 * num_n) * g0
    g = min(g0, pairs - first)
    wi = w - first * num_n
    nl, q = wi // g, first + wi % g
    return (num_n - 1 - nl if sched & 1 else nl), q


def varlen_work_tiles(cu_seqlens_q, cu_seqlens_k, h: int, h_k: int, window_left: int,
                      window_right: int, bottom_right: bool = True, window: bool = True,
                      bn: int = BN):
    """Mirror of the VARLEN kernel's work decomposition (hopper/sched.cuh: key_tile,
    query_tile_range; hopper/bwd.cu: the producer's skip): yields (w, sequence, kv_head, n0, m_first, m_count)
    for every work tile handed to the consumers, in index order. Window sides are Params values
    (unbounded: total_q + total_k); ``window``: the WINDOW template flag; ``bn``: keys per tile
    (bn_for(d))."""
    cq = [int(x) for x in cu_seqlens_q]
    ck = [int(x) for x in cu_seqlens_k]
    nseq = len(cq) - 1
    num_n = -(-max(ck[z + 1] - ck[z] for z in range(nseq)) // bn)
    for w in range(num_n * h_k * nseq):
        n0 = (w % num_n) * bn
        kv_head = (w // num_n) % h_k
        z = w // num_n // h_k
        s_q, s_k = cq[z + 1] - cq[z], ck[z + 1] - ck[z]
        if n0 >= s_k:          # skipped by the producer
            continue
        diag = s_k - s_q if bottom_right else 0
        n_rows = min(bn, s_k - n0)
        i_lo, i_hi = 0, s_q - 1
        if window:
            i_lo = max(0, n0 - diag - window_right)
            i_hi = min(s_q - 1, n0 + n_rows - 1 - diag + window_left)
        m_count = i_hi // BM - i_lo // BM + 1 if i_hi >= i_lo else 0
        yield w, z, kv_head, n0, i_lo // BM, m_count


def why_unsupported(dtype_name: str, d: int, d_v: int, *, scale: float, softcap: float,
                has_alibi: bool, deterministic: bool, cc: int, smem_optin: int,
                tensors=(), has_bias: bool = False) -> Optional[str]:
    """Why the Hopper backward kernel cannot run this call (None when it can). ``tensors``:
    (shape, element strides) of q, k, v and dout. Base pointers are checked at launch."""
    if softcap > 0 or has_alibi:
        return "softcap / alibi_slopes (not in the Hopper backward yet)"
    if not scale > 0:
        return f"scale {scale} <= 0"
    if deterministic and has_bias:
        return "deterministic=True with a bias (the Hopper backward adds dbias with atomics)"
    if d == SPLIT_D and d_v == d and has_bias:
        return "a bias at head dim 256 (not in the Hopper backward's head dim 256 kernel)"
    return sm90_common_unsupported(dtype_name, d, d_v, HEAD_DIMS, cc=cc,
                                         smem_need=smem_bytes(d, det=deterministic),
                                         smem_optin=smem_optin, tensors=tensors)


def bias_unsupported(strides, s_k: int, ptr: int, itemsize: int) -> Optional[str]:
    """Why the BIAS variant cannot read this bias operand (None when it can): ``strides`` are
    its element strides over (b, h, s_q, s_k), 0 where broadcast (params.broadcast_strides). It
    needs the layout of the forward's pair loads (operands.bias_pair_ok): a unit key stride (the
    warp's loads of 8 consecutive keys coalesce), even s_k and even strides (dbias is written as
    8-byte pairs of keys into an accumulator with the bias's shape), an aligned pair."""
    if strides[3] != 1:
        return "bias layout: key stride %d (the Hopper backward needs 1)" % strides[3]
    if s_k % 2:
        return f"bias with odd seqlen_k {s_k} (the Hopper backward writes dbias in key pairs)"
    if any(x % 2 for x in strides[:3]) or ptr % (2 * itemsize):
        return f"bias layout: strides {tuple(strides)} / address not in aligned pairs"
    return None
