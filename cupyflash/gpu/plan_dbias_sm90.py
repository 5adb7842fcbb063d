"""Hopper (sm_90a) dbias kernel, planner side (pure Python): coverage, variants, work
decomposition. dbias_sm90.py launches it.

``flash_bwd_dbias_sm90<E, D, BIAS_F32, STAGES, BIASBUF, WINDOW>`` in kernels_cu/hopper/dbias.cu is
portable/bwd.cu's ``flash_bwd_dbias`` (dbias summed over the (batch, head) pairs each plane broadcasts
to, in float32 registers, stored once in the bias's type: extra memory = dbias only) with TMA
loads and wgmma products. When the backward takes the dbias-kernel path (``plan_bwd.dbias_by_kernel``
and ``TUNING.dbias_kernel`` / deterministic mode / no room for the float32 accumulator), the launcher
runs this kernel instead of flash_bwd_dbias on compute capability 9.0 where ``why_unsupported``
passes and ``TUNING.dbias_sm90`` is set, else flash_bwd_dbias.

Work tiles: [BM = 128 queries, BN = 128 keys] of one dbias plane, query tiles fastest, then key
tiles, then planes (``work_tiles`` mirrors the kernel's decomposition); a persistent grid of at
most one block per SM draws them from the per-stream counter of the Hopper kernels. Coverage:
float16 / bfloat16, d = d_v in {64, 128}, the bias in q's 16-bit type or float32 with a full query
dimension and strides TMA accepts, any scale, GQA / MQA, causal / window; no softcap, ALiBi or
boolean mask (those stay on flash_bwd_dbias).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .tma import TMA_ALIGN, bias_tma_unsupported
from .variants import SM90_SMEM_MAX, KernelVariant, cpp_bool, sm90_common_unsupported


BM = 128             # queries per work tile (two consumer warpgroups x 64)
BN = 128             # keys per work tile
THREADS = 384
HEAD_DIMS = (64, 128)
TILE_RING = 2        # work-tile indices in flight
SMEM_LIMIT = SM90_SMEM_MAX   # the H100 / H200 opt-in limit the rings below are sized for


#: (STAGES, BIASBUF) per (d, float32 bias): half stages of the ring ((Q, K) or (dO, V) of a pair)
#: and bias tile buffers within SMEM_LIMIT (kernels_cu/hopper/dbias_layout.cuh: the arithmetic): at d = 128
#: the most that fit; at d = 64 two pairs ahead (a fifth half stage would fit, not measured)
BUFFERS = {(128, False): (3, 1), (128, True): (2, 1), (64, False): (4, 2), (64, True): (4, 1)}


def smem_bytes(d: int, bias_f32: bool, stages: int, biasbuf: int) -> int:
    """Mirrors sm90d::Layout in hopper/dbias_layout.cuh: STAGES x ([BM, d] + [BN, d] 16-bit), BIASBUF x the
    bias tile [BM, BN] (2 or 4 bytes), the tile ring (16 bytes), the mbarriers, and 1024 bytes of
    slack to align the swizzled panels."""
    half = (BM + BN) * d * 2
    bias_tile = BM * BN * (4 if bias_f32 else 2)
    return stages * half + biasbuf * bias_tile + 16 + 8 * (2 * stages + 2 * biasbuf + 2 * TILE_RING) + 1024


@dataclass(frozen=True)
class Sm90DbiasVariant(KernelVariant):
    """One template instantiation of flash_bwd_dbias_sm90."""

    elem: str          # f16_t / bf16_t (q, k, v, dout)
    d: int             # d = d_v
    bias_f32: bool     # bias and dbias elements float32 (else elem's 16-bit type)
    window: bool       # causal / sliding window
    stages: int        # half stages in the ring
    biasbuf: int       # bias tile buffers

    file = "hopper/dbias.cu"
    arch_options = ("-arch=sm_90a",)
    bm = BM
    bn = BN
    threads = THREADS
    helper_expressions = ()

    template = "flash_bwd_dbias_sm90"

    def template_args(self) -> tuple:
        b = cpp_bool
        return (self.elem, str(self.d), b(self.bias_f32), str(self.stages), str(self.biasbuf),
                b(self.window))

    @property
    def name(self) -> str:
        return (f"dbias90_{self.elem[:-2]}_d{self.d}_{BM}x{BN}s{self.stages}b{self.biasbuf}"
                + ("_bias32" if self.bias_f32 else "_bias16") + ("_window" if self.window else ""))

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.d, self.bias_f32, self.stages, self.biasbuf)


def variant_for(elem: str, d: int, bias_f32: bool, window: bool) -> Sm90DbiasVariant:
    """The instantiation the launcher runs for this element type, head dim, bias type and mask."""
    stages, biasbuf = BUFFERS[(d, bool(bias_f32))]
    return Sm90DbiasVariant(elem, d, bool(bias_f32), bool(window), stages, biasbuf)


def variants():
    """Every Sm90DbiasVariant the launcher can select (compiled by the harness for sm_90a)."""
    return [variant_for(e, d, f32, w) for e in ("f16_t", "bf16_t") for d in HEAD_DIMS
            for f32 in (False, True) for w in (False, True)]


def num_work(s_q: int, s_k: int, planes: int) -> int:
    """Work tiles of a launch: query tiles x key tiles x dbias planes."""
    return -(-s_q // BM) * -(-s_k // BN) * planes


def why_unsupported(dtype_name: str, d: int, d_v: int, *, cc: int, smem_optin: int, softcap: float,
                has_alibi: bool, has_mask: bool, tensors=(), bias_shape=(), bias_strides=(),
                bias_itemsize: int = 2, s_q: int = 1, s_k: int = 1, planes: int = 1) -> Optional[str]:
    """Why flash_bwd_dbias_sm90 cannot give this call's dbias (None when it can). ``tensors``:
    (shape, element strides) of q, k, v and dout; the bias operand's 4-D ``bias_shape`` and element
    ``bias_strides`` (0 where broadcast) and its item size (2: q's 16-bit type, 4: float32);
    ``planes``: dbias planes (the bias's batch x head extents). Base addresses are checked at
    launch."""
    if softcap > 0 or has_alibi:
        return "softcap / alibi_slopes (not in the Hopper dbias kernel)"
    if has_mask:
        return "a boolean mask (not in the Hopper dbias kernel)"
    bias_f32 = bias_itemsize == 4
    need = smem_bytes(d, bias_f32, *BUFFERS[(d, bias_f32)]) if (d, bias_f32) in BUFFERS else 0
    why = sm90_common_unsupported(dtype_name, d, d_v, HEAD_DIMS, cc=cc, smem_need=need,
                                        smem_optin=smem_optin, tensors=tensors)
    if why is not None:
        return why
    if bias_itemsize not in (2, 4):
        return f"bias item size {bias_itemsize} (q's 16-bit type or float32)"
    why = bias_tma_unsupported(bias_shape, bias_strides, s_q, 0, bias_itemsize)
    if why is not None:
        return why
    if num_work(s_q, s_k, planes) > 2**31 - 1:
        return "more than 2^31 - 1 dbias tiles"
    return None


def work_tiles(s_q: int, s_k: int, b: int, h: int, sum_b: bool, sum_h: bool, window_left: int,
               window_right: int, diag_offset: int, window: bool):
    """Mirror of the kernel's work decomposition (hopper/sched.cuh: dbias_tile, pair_of): yields
    (w, m0, n0, pb, ph, pairs, need_mask) per work tile in index order; ``pairs`` lists the
    (batch, head) pairs summed into the tile in the kernel's order (empty: stored as zeros).
    ``sum_b`` / ``sum_h``: dbias is summed over the batch / heads (dbias_stride_b / _h = 0).
    Window sides are Params values (unbounded: s_q + s_k); ``window``: the WINDOW flag."""
    num_m, num_n = -(-s_q // BM), -(-s_k // BN)
    planes_b, planes_h = (1 if sum_b else b), (1 if sum_h else h)
    nb, nh = (b if sum_b else 1), (h if sum_h else 1)
    for w in range(num_m * num_n * planes_b * planes_h):
        m0, n0 = (w % num_m) * BM, ((w // num_m) % num_n) * BN
        plane = w // num_m // num_n
        pb, ph = plane // planes_h, plane % planes_h
        count, need_mask = nb * nh, False
        if window:
            m_last, n_last = min(m0 + BM, s_q) - 1, min(n0 + BN, s_k) - 1
            if n_last < m0 + diag_offset - window_left or n0 > m_last + diag_offset + window_right:
                count = 0
            need_mask = (n0 + BN - 1 > m0 + diag_offset + window_right
                         or n0 < m0 + BM - 1 + diag_offset - window_left)
        pairs = [(pb if not sum_b else it // nh, ph if not sum_h else it % nh) for it in range(count)]
        yield w, m0, n0, pb, ph, pairs, need_mask


def bases_aligned(*arrays) -> bool:
    """Whether every array's base address is one TMA can take (16-byte aligned): q, k, v, dout
    and the bias operand, checked by the launcher before it picks this kernel and by launch."""
    return all(a.data.ptr % TMA_ALIGN == 0 for a in arrays)
