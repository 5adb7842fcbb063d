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
    assert len(dets) == 24 and all(x.bias == 0 and x.dq_bulk == (x.d != 256) for x in dets)
    assert {(x.elem, x.d, x.window, x.varlen) for x in dets} == {
        (e, d, w, vl_) for e in ("f16_t", "bf16_t") for d in (64, 128, 256) for w in (False, True)
        for vl_ in (False, True)}
    # head dim 256: ordered adds from registers, two semaphores per dQ tile (one per half)
    v256 = P.variant_for("bf16_t", 256, True, det=True)
    assert v256.name == "bwd90_bf16_d256_64x64_window_red_det"
    assert v256.name_expression == "flash_bwd_sm90<bf16_t, 256, true, false, 1, false, 0, true>"
    assert v256.smem_bytes == P.smem_bytes(256) + 16 <= H200_SMEM


def test_det_kernel_expressions():
    """The mirrors below (dq_semaphore_index, dq_rank, steps, det_work_tile) are the kernel's
    expressions."""
    src = _kernel_source("hopper/bwd.cu")
    for expr in (
            "template <typename E, int D, bool WINDOW, bool DQ_BULK, int KVBUF, bool VARLEN, int BIAS,\n"
            "          bool DET = false>",
            "slab = (i64)head * p.b + wt.batch;",
            "row0 = (i64)head * p.s_q + ld_seq(p.cu_seqlens_q + wt.batch);",
            "slab = (i64)wt.batch * p.h + head;",
            "row0 = slab * p.s_q;",
            "return (int*)(p.dq_accum + p.dq_accum_slab) + PARTS * ((row0 + m0) / BM + slab) + part;",
            "sem = dq_sem<VARLEN, BM, 2>(p, wt, head, m0, cw);",
            "rank = dq_rank<WINDOW, BM, BN>(p, n0, s_q, wt.s_k, wt.diag, m0);",
            "const KeyTile wt = key_tile<BN, BM, WINDOW, VARLEN, BIAS_NONE, DET>(p, w);",
            "const int m0 = step_m0<BM, DET>(p, wt, st);",
            "const int head = step_head<DET>(p, wt, st);",
            "const int n_hi = WINDOW ? min(s_k - 1, min(m0 + BM, s_q) - 1 + diag + p.window_right) / BN\n"
            "                                : (s_k - 1) / BN;",
            "return n_hi - n0 / BN;",
            "const int n_lo = WINDOW ? max(0, m0 + diag - p.window_left) / BN : 0;",
            "return n0 / BN - n_lo;",
            "const int diag = VARLEN ? n0 - seq_smem[1] : p.diag_offset;",
            "const int s_k = VARLEN ? n0 + seq_smem[0] : p.s_k;",
            "job_smem[3] = (u64)dq_rank<WINDOW, BM, BN>(p, n0, s_q, s_k, diag, m0);",
            "if constexpr (DET) return wt.kv_head * p.h_per_hk + st % p.h_per_hk;",
            "const int mi = st / p.h_per_hk;",
            "return (wt.m_first + ((p.det_sched & 1) ? mi : wt.m_count - 1 - mi)) * BM;",
            "const int mq = !DET || (p.det_sched & 1) ? mi : wt.m_count - 1 - mi;",
            "if (++head == head0 + p.h_per_hk) {",
            "const int pairs = p.h_k * p.b, g0 = max(1, p.det_sched >> 1);",
            "const int first = w / (g0 * num_n) * g0;",
            "const int g = min(g0, pairs - first);",
            "const int wi = w - first * num_n;",
            "const int nl = wi / g, q = first + wi % g;",
            "wt.n0 = ((p.det_sched & 1) ? num_n - 1 - nl : nl) * BN;",
            "wt.kv_head = q % p.h_k;",
            "wt.batch = q / p.h_k;",
            "key_tile<BN, BM, WINDOW, VARLEN, BIAS, DET>(p, w)",
            "sem_wait_eq(sem, rank);",
            "sem_release(sem, rank + 1);",
            "if (DET && !p.sched) __trap();"):
        assert expr in src, expr
    assert src.count("key_tile<BN, BM, WINDOW, VARLEN, BIAS, DET>(p, w)") == 3


@pytest.mark.parametrize("num_n,pairs", [(1, 1), (4, 33), (16, 128), (128, 16), (5, 7), (3, 100)])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("group", [1, 3, 16, 1000])
def test_det_work_tiles_number_every_tile_once_predecessor_first(num_n, pairs, descending, group):
    """det_work_tile is a bijection of [0, num_n · pairs) onto (key tile, pair), and every key
    tile's predecessor in its pair's addition order (n − 1 ascending, n + 1 descending) has the
    smaller index: the counter hands it out first (the deadlock argument)."""
    sched = 2 * group + descending
    index = {}
    for w in range(num_n * pairs):
        n, q = P.det_work_tile(w, num_n, pairs, sched)
        assert 0 <= n < num_n and 0 <= q < pairs
        index[(n, q)] = w
    assert len(index) == num_n * pairs
    for (n, q), w in index.items():
        pred = n + 1 if descending else n - 1
        if 0 <= pred < num_n:
            assert index[(pred, q)] < w
        # within a group, g pairs between two key tiles of one pair
        g = min(group, pairs - q // group * group)
        if 0 <= pred < num_n:
            assert w - index[(pred, q)] == g


@pytest.mark.parametrize("num_n,pairs,grid,want", [
    (4, 512, 132, 33), (8, 256, 132, 16), (16, 128, 132, 16), (128, 16, 132, 16),
    (128, 8, 132, 8), (1, 3, 132, 3), (256, 1, 132, 1), (16, 128, 1, 1)])
def test_det_group_rule(num_n, pairs, grid, want):
    assert P.det_group(num_n, pairs, grid) == want


@pytest.mark.parametrize("num_n,pairs,want", [
    (8, 512, (True, 16)), (32, 64, (True, 16)), (64, 32, (True, 16)), (127, 16, (True, 16)),
    (128, 16, (False, 1)), (128, 32, (False, 1)), (512, 4, (False, 1))])
def test_det_order_rule(num_n, pairs, want):
    """Descending with draw groups below DET_ASCENDING_FROM key tiles per sequence, ascending with
    one pair per group from there (the H200 figures in plan_bwd_sm90); the planner's det_sched
    follows it when TUNING leaves both switches to it."""
    assert P.DET_ASCENDING_FROM == 128
    assert P.det_order(num_n, pairs, 132) == want
    desc, group = want
    assert P.det_sched(num_n, pairs, 132) == 2 * group + desc


def test_det_sched_encoding_and_tuning():
    from cupyflash.gpu.tuning import tuning
    assert P.det_sched(16, 128, 132) == 2 * 16 + 1            # default: descending, det_group
    assert P.det_sched(16, 128, 132, descending=False) == 2 * 16
    assert P.det_sched(16, 128, 132, group=1000) == 2 * 128 + 1   # at most every pair
    with tuning(det_descending=False, det_group=1):
        assert P.det_sched(16, 128, 132) == 2
    assert P.det_sched(16, 128, 132) == 33


@pytest.mark.parametrize("parts", [1, 2], ids=["one_per_tile", "per_half_d256"])
@pytest.mark.parametrize("b,h,s_q", [(1, 1, 1), (2, 3, 63), (2, 3, 64), (3, 2, 65), (1, 4, 1000),
                                     (5, 1, 127)])
def test_dense_semaphores_distinct_and_in_bounds(b, h, s_q, parts):
    idx = [P.dq_semaphore_index(bb * h + hd, (bb * h + hd) * s_q, m0, parts, part)
           for bb in range(b) for hd in range(h) for m0 in range(0, s_q, P.BM) for part in range(parts)]
    assert len(set(idx)) == len(idx)
    assert min(idx) >= 0 and max(idx) < P.dq_semaphores(b * h * s_q, b * h, parts)


@pytest.mark.parametrize("lens", [(5, 1, 0, 130, 64, 257, 3), (64, 64, 64), (1,), (0, 0, 70),
                                  (63, 65, 127, 129, 1)])
@pytest.mark.parametrize("parts", [1, 2], ids=["one_per_tile", "per_half_d256"])
def test_varlen_semaphores_distinct_and_in_bounds(lens, parts):
    h = 3
    cq = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    total, nseq = int(cq[-1]), len(lens)
    idx = [P.dq_semaphore_index(hd * nseq + z, hd * total + int(cq[z]), m0, parts, part)
           for hd in range(h) for z in range(nseq) for m0 in range(0, lens[z], P.BM)
           for part in range(parts)]
    assert len(set(idx)) == len(idx)
    assert not idx or (min(idx) >= 0 and max(idx) < P.dq_semaphores(h * total, h * nseq, parts))


MODES = {"plain": (-1, -1, True), "causal": (-1, 0, True), "causal_top_left": (-1, 0, False),
         "window": (20, 5, True), "left_only": (50, -1, True), "right_only": (-1, 30, False),
         "diagonal": (0, 0, True), "wide": (300, 150, True)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (1, 300), (300, 1), (127, 131), (257, 1000),
                                     (1000, 257), (640, 640), (64, 129)])
@pytest.mark.parametrize("bn", [128, 64], ids=["bn128", "bn64_d256"])
def test_rank_counts_the_earlier_key_tiles(s_q, s_k, mode, bn):
    """For each query tile, the key tiles that visit it (plan_bwd.query_tiles, the kernel's
    query_tile_range) are consecutive, n_lo .. n_hi, and dq_rank gives each its place among
    them in either order: the semaphore values 0, 1, .., each waited for by one tile."""
    wl, wr, bottom_right = MODES[mode]
    window = wl >= 0 or wr >= 0
    unb = s_q + s_k
    wl_p, wr_p = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    diag = s_k - s_q if bottom_right else 0
    num_n = -(-s_k // bn)
    visits = {}
    for n in range(num_n):
        for m in plan_bwd.query_tiles(n, bn, P.BM, s_q, s_k, wl_p, wr_p, diag, window):
            visits.setdefault(m, []).append(n)
    for m, ns in visits.items():
        assert ns == list(range(ns[0], ns[0] + len(ns))), (m, ns)
        assert [P.dq_rank(n, m, diag, wl_p, window, bn=bn) for n in ns] == list(range(len(ns)))
        assert [P.dq_rank(n, m, diag, wl_p, window, descending=True, s_q=s_q, s_k=s_k,
                          window_right=wr_p, bn=bn) for n in ns] == list(range(len(ns)))[::-1]


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("mode", ["plain", "causal", "window", "left_only"])
def test_varlen_rank_counts_the_earlier_key_tiles(mode, descending):
    """Packed sequences (varlen_work_tiles: the producer skips tiles past a sequence's keys):
    each (sequence, head, query tile) gets ranks 0, 1, .. in its addition order."""
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
        for head, m in P.steps(m_first, m_count, kv_head, h // h_k, det=True,
                               descending=descending):
            rank = P.dq_rank(n0 // P.BN, m, diag, wl_p, window, descending=descending,
                             s_q=lens_q[z], s_k=lens_k[z], window_right=wr_p)
            visits.setdefault((z, head, m), []).append((n0 // P.BN, rank))
    for key, got in visits.items():
        got.sort(key=lambda x: -x[0] if descending else x[0])   # the addition order
        assert [r for _, r in got] == list(range(len(got))), (key, got)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("mode", ["plain", "causal", "causal_top_left", "window", "wide",
                                  "left_only"])
@pytest.mark.parametrize("group", [1, 4])
def test_det_step_order_keeps_the_adding_key_tile_ahead(mode, group, descending):
    """DET's step order (query tiles outer, the group's heads inner; ascending with the
    descending addition order, else descending): of two consecutive key tiles of one (batch, kv
    head), the one that adds first (its predecessor p) reaches every (head, query tile) they share
    no later in its own steps, so tiles started together wait for nothing but the latency of an
    addition (docs/hopper.md). Its lead ("slack", in steps) is 2 · group under a causal band in
    the descending order and 0 in the ascending one; the default order (heads outer, query tiles
    ascending) would leave the predecessor behind."""
    s_q = s_k = 2048
    wl, wr, bottom_right = MODES[mode]
    window = wl >= 0 or wr >= 0
    unb = s_q + s_k
    wl_p, wr_p = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    diag = s_k - s_q if bottom_right else 0

    def position(n, det):
        r = plan_bwd.query_tiles(n, P.BN, P.BM, s_q, s_k, wl_p, wr_p, diag, window)
        order = P.steps(r.start, len(r), 0, group, det, descending) if len(r) else []
        return {x: i for i, x in enumerate(order)}

    slack = set()
    for n in range(1, s_k // P.BN):
        first, second = (n, n - 1) if descending else (n - 1, n)
        a, b = position(first, True), position(second, True)
        shared = a.keys() & b.keys()
        assert all(a[x] <= b[x] for x in shared), n
        if shared:
            slack.add(min(b[x] - a[x] for x in shared))
    if mode in ("causal", "causal_top_left"):
        assert slack == ({2 * group} if descending else {0})
    if mode == "plain":
        assert slack == {0}


def test_steps_mirror_the_kernel_counters():
    """steps(det) is what step_head / step_m0 give for st = 0, 1, ..: DET st = mi · group + hi,
    query tile m_first + mi (descending order) or m_first + m_count − 1 − mi, head kv_head ·
    group + hi; the default st = hi · m_count + mi."""
    for m_first, m_count, group in ((0, 5, 1), (3, 4, 4), (7, 1, 2)):
        for desc in (False, True):
            got = P.steps(m_first, m_count, 2, group, det=True, descending=desc)
            want = [(2 * group + st % group,
                     m_first + (st // group if desc else m_count - 1 - st // group))
                    for st in range(m_count * group)]
            assert got == want
        got = P.steps(m_first, m_count, 2, group, det=False)
        want = [(2 * group + st // m_count, m_first + st % m_count) for st in range(m_count * group)]
        assert got == want
