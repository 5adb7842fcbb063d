"""Deterministic mode of the Hopper 16-bit backward (flash_bwd_sm90<..., DET = true>), planner
side (pure Python, no GPU): the variants, the workspace (dQ semaphores after the accumulator),
the rank each key tile waits for, and the DET step order, against the kernel's expressions.
tests/models/test_sm90_bwd_det_protocol.py models the semaphores across blocks."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.gpu import plan_bwd, plan_bwd_sm90 as P

from test_plan_sm90 import _kernel_source  # noqa: E402  (pytest puts tests/planner on sys.path)

H200_SMEM = 227 * 1024


def test_det_variants_names_and_expressions():
    v = P.variant_for("bf16_t", 128, False, det=True)
    assert v.name == "bwd90_bf16_d128_64x128_det"
    assert v.name_expression == "flash_bwd_sm90<bf16_t, 128, false, true, 1, false, 0, true>"
    vl = P.variant_for("f16_t", 64, True, varlen=True, det=True)
    assert vl.name == "bwd90_f16_d64_64x128_window_kv2_varlen_det"
    assert vl.name_expression == "flash_bwd_sm90<f16_t, 64, true, true, 2, true, 0, true>"
    # the default instantiation's expression is unchanged (DET defaults to false)
    assert P.variant_for("bf16_t", 128, False).name_expression == \
        "flash_bwd_sm90<bf16_t, 128, false, true, 1, false, 0>"
    assert v.smem_bytes == P.smem_bytes(128) + 16 <= H200_SMEM
    with pytest.raises(AssertionError):
        P.variant_for("bf16_t", 128, False, bias=P.BIAS_LD16, det=True)
    dets = [x for x in P.variants() if x.det]
    assert len(dets) == 16 and all(x.bias == 0 and x.dq_bulk for x in dets)
    assert {(x.elem, x.d, x.window, x.varlen) for x in dets} == {
        (e, d, w, vl_) for e in ("f16_t", "bf16_t") for d in (64, 128) for w in (False, True)
        for vl_ in (False, True)}


def test_det_kernel_expressions():
    """The mirrors below (dq_semaphore_index, dq_rank, steps) are the kernel's expressions."""
    src = _kernel_source("hopper/bwd.cu")
    for expr in (
            "template <typename E, int D, bool WINDOW, bool DQ_BULK, int KVBUF, bool VARLEN, int BIAS,\n"
            "          bool DET = false>",
            "slab = (i64)head * p.b + wt.batch;",
            "row0 = (i64)head * p.s_q + ld_seq(p.cu_seqlens_q + wt.batch);",
            "slab = (i64)wt.batch * p.h + head;",
            "row0 = slab * p.s_q;",
            "return (int*)(p.dq_accum + p.dq_accum_slab) + (row0 + m0) / BM + slab;",
            "const int n_lo = WINDOW ? max(0, m0 + diag - p.window_left) / BN : 0;",
            "return n0 / BN - n_lo;",
            "const int diag = VARLEN ? n0 - seq_smem[1] : p.diag_offset;",
            "if constexpr (DET) return wt.kv_head * p.h_per_hk + st % p.h_per_hk;",
            "if constexpr (DET) return (wt.m_first + wt.m_count - 1 - st / p.h_per_hk) * BM;",
            "int head = head0, mi = DET ? wt.m_count - 1 : 0;",
            "if (++head == head0 + p.h_per_hk) {",
            "sem_wait_eq(sem, rank);",
            "sem_release(sem, rank + 1);",
            "if (DET && !p.sched) __trap();"):
        assert expr in src, expr


@pytest.mark.parametrize("b,h,s_q", [(1, 1, 1), (2, 3, 63), (2, 3, 64), (3, 2, 65), (1, 4, 1000),
                                     (5, 1, 127)])
def test_dense_semaphores_distinct_and_in_bounds(b, h, s_q):
    idx = [P.dq_semaphore_index(bb * h + hd, (bb * h + hd) * s_q, m0)
           for bb in range(b) for hd in range(h) for m0 in range(0, s_q, P.BM)]
    assert len(set(idx)) == len(idx)
    assert min(idx) >= 0 and max(idx) < P.dq_semaphores(b * h * s_q, b * h)


@pytest.mark.parametrize("lens", [(5, 1, 0, 130, 64, 257, 3), (64, 64, 64), (1,), (0, 0, 70),
                                  (63, 65, 127, 129, 1)])
def test_varlen_semaphores_distinct_and_in_bounds(lens):
    h = 3
    cq = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    total, nseq = int(cq[-1]), len(lens)
    idx = [P.dq_semaphore_index(hd * nseq + z, hd * total + int(cq[z]), m0)
           for hd in range(h) for z in range(nseq) for m0 in range(0, lens[z], P.BM)]
    assert len(set(idx)) == len(idx)
    assert not idx or (min(idx) >= 0 and max(idx) < P.dq_semaphores(h * total, h * nseq))


MODES = {"plain": (-1, -1, True), "causal": (-1, 0, True), "causal_top_left": (-1, 0, False),
         "window": (20, 5, True), "left_only": (50, -1, True), "right_only": (-1, 30, False),
         "diagonal": (0, 0, True), "wide": (300, 150, True)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (1, 300), (300, 1), (127, 131), (257, 1000),
                                     (1000, 257), (640, 640), (64, 129)])
def test_rank_counts_the_earlier_key_tiles(s_q, s_k, mode):
    """For each query tile, the key tiles that visit it (plan_bwd.query_tiles, the kernel's
    query_tile_range) are consecutive, n_lo .. n_hi, and dq_rank gives each its place among
    them: the semaphore values 0, 1, .. in key-tile order, each value waited for by one tile."""
    wl, wr, bottom_right = MODES[mode]
    window = wl >= 0 or wr >= 0
    unb = s_q + s_k
    wl_p, wr_p = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    diag = s_k - s_q if bottom_right else 0
    num_n = -(-s_k // P.BN)
    visits = {}
    for n in range(num_n):
        for m in plan_bwd.query_tiles(n, P.BN, P.BM, s_q, s_k, wl_p, wr_p, diag, window):
            visits.setdefault(m, []).append(n)
    for m, ns in visits.items():
        assert ns == list(range(ns[0], ns[0] + len(ns))), (m, ns)
        assert [P.dq_rank(n, m, diag, wl_p, window) for n in ns] == list(range(len(ns)))


@pytest.mark.parametrize("mode", ["plain", "causal", "window", "left_only"])
def test_varlen_rank_counts_the_earlier_key_tiles(mode):
    lens_q, lens_k = (5, 1, 0, 300, 64, 129, 3, 700), (7, 65, 3, 257, 0, 300, 3, 650)
    cq = np.concatenate([[0], np.cumsum(lens_q)])
    ck = np.concatenate([[0], np.cumsum(lens_k)])
    wl, wr, bottom_right = MODES[mode]
    window = wl >= 0 or wr >= 0
    unb = int(cq[-1] + ck[-1])
    wl_p, wr_p = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    h, h_k = 4, 2
    visits = {}
    for w, z, kv_head, n0, m_first, m_count in P.varlen_work_tiles(cq, ck, h, h_k, wl_p, wr_p,
                                                                    bottom_right, window):
        diag = lens_k[z] - lens_q[z] if bottom_right else 0
        for head, m in P.steps(m_first, m_count, kv_head, h // h_k, det=True):
            rank = P.dq_rank(n0 // P.BN, m, diag, wl_p, window)
            visits.setdefault((z, head, m), []).append((n0 // P.BN, rank))
    for key, got in visits.items():
        assert [r for _, r in got] == list(range(len(got))), (key, got)   # w order = n order


@pytest.mark.parametrize("mode", ["plain", "causal", "causal_top_left", "window", "wide"])
@pytest.mark.parametrize("group", [1, 4])
def test_det_step_order_keeps_the_earlier_key_tile_ahead(mode, group):
    """DET's order (query tiles descending, the group's heads inside): of two key tiles n − 1, n
    of one (batch, kv head), the earlier reaches every (head, query tile) they share no later in
    its own steps, so tiles started together do not wait on one another beyond the latency of an
    addition (docs/hopper.md). The default order (heads outer, query tiles ascending) does not
    have this where the tiles' query ranges differ (causal: the earlier one has more steps before
    the shared ones)."""
    s_q = s_k = 2048
    wl, wr, bottom_right = MODES[mode]
    window = wl >= 0 or wr >= 0
    unb = s_q + s_k
    wl_p, wr_p = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    diag = s_k - s_q if bottom_right else 0

    def position(n, det):
        r = plan_bwd.query_tiles(n, P.BN, P.BM, s_q, s_k, wl_p, wr_p, diag, window)
        order = P.steps(r.start, len(r), 0, group, det) if len(r) else []
        return {x: i for i, x in enumerate(order)}

    behind_default = False
    for n in range(1, s_k // P.BN):
        a, b = position(n - 1, True), position(n, True)
        assert all(a[x] <= b[x] for x in a.keys() & b.keys()), n
        a, b = position(n - 1, False), position(n, False)
        behind_default |= any(a[x] > b[x] for x in a.keys() & b.keys())
    assert behind_default == (mode != "plain")   # plain: every key tile has every query tile


def test_steps_mirror_the_kernel_counters():
    """steps(det) is what step_head / step_m0 give for st = 0, 1, ..: DET st = mi · group + hi,
    query tile m_first + m_count − 1 − mi, head kv_head · group + hi."""
    for m_first, m_count, group in ((0, 5, 1), (3, 4, 4), (7, 1, 2)):
        got = P.steps(m_first, m_count, 2, group, det=True)
        want = [(2 * group + st % group, m_first + m_count - 1 - st // group)
                for st in range(m_count * group)]
        assert got == want
        got = P.steps(m_first, m_count, 2, group, det=False)
        want = [(2 * group + st // m_count, m_first + st % m_count) for st in range(m_count * group)]
        assert got == want
