"""The Hopper dbias kernel's planner (cupyflash/gpu/plan_dbias_sm90.py), CPU only: variants and their
shared memory, coverage reasons, and the work decomposition (every dbias element of every plane
in exactly one work tile, each tile summing exactly the plane's pairs; tiles skipped or left
unmasked only where the causal / window band allows)."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.gpu import plan_dbias_sm90

SMEM = 227 * 1024


def test_variants_fit_and_name_their_template():
    vs = plan_dbias_sm90.variants()
    assert len(vs) == len(set(vs)) == 16
    assert len({v.name for v in vs}) == 16
    for v in vs:
        assert v.smem_bytes <= SMEM, v.name
        assert (v.stages, v.biasbuf) == plan_dbias_sm90.BUFFERS[(v.d, v.bias_f32)]
        assert v.name_expression.startswith("flash_bwd_dbias_sm90<")
    v = plan_dbias_sm90.variant_for("bf16_t", 128, False, True)
    assert v.name_expression == "flash_bwd_dbias_sm90<bf16_t, 128, false, 3, 1, true>"
    assert v.name == "dbias90_bf16_d128_128x128s3b1_bias16_window"


def test_buffers_are_the_most_that_fit():
    """One more half stage (or bias buffer) would not fit the 227 KB of an H100 / H200 block."""
    for (d, f32), (stages, biasbuf) in plan_dbias_sm90.BUFFERS.items():
        assert plan_dbias_sm90.smem_bytes(d, f32, stages, biasbuf) <= SMEM
        assert plan_dbias_sm90.smem_bytes(d, f32, stages + 1, biasbuf) > SMEM or \
            plan_dbias_sm90.smem_bytes(d, f32, stages, biasbuf + 1) > SMEM or stages >= 4


def test_smem_bytes_mirror():
    """d = 128, 16-bit bias: 3 half stages of 64 KB + a 32 KB bias tile + tile ring + 12
    mbarriers + 1024 bytes of alignment slack."""
    assert plan_dbias_sm90.smem_bytes(128, False, 3, 1) == 3 * 65536 + 32768 + 16 + 8 * 12 + 1024
    assert plan_dbias_sm90.smem_bytes(64, True, 4, 1) == 4 * 32768 + 65536 + 16 + 8 * 14 + 1024


def _why(**kw):
    base = dict(cc=90, smem_optin=SMEM, softcap=0.0, has_alibi=False, has_mask=False,
                tensors=[((2, 200, 4, 128), (200 * 4 * 128, 4 * 128, 128, 1))] * 4,
                bias_shape=(1, 4, 157, 200), bias_strides=(0, 157 * 200, 200, 1),
                bias_itemsize=2, s_q=157, s_k=200, planes=4)
    d, dtype = kw.pop("d", 128), kw.pop("dtype", "bfloat16")
    base.update(kw)
    return plan_dbias_sm90.why_unsupported(dtype, d, d, **base)


def test_unsupported_reasons():
    assert _why() is None
    assert _why(bias_itemsize=4, bias_strides=(0, 157 * 200, 200, 1)) is None   # 800-byte rows
    assert _why(d=64, tensors=[((2, 200, 4, 64), (200 * 256, 256, 64, 1))] * 4) is None
    assert "softcap" in _why(softcap=5.0)
    assert "alibi" in _why(has_alibi=True)
    assert "mask" in _why(has_mask=True)
    assert "compute capability" in _why(cc=80)
    assert "dtype" in _why(dtype="float32")
    assert "head dims" in _why(d=96)
    # a bias row of 199 16-bit elements (398 bytes) is no tensor-map stride
    assert "16-byte" in _why(bias_shape=(1, 4, 157, 199), bias_strides=(0, 157 * 199, 199, 1),
                             s_k=199)
    assert "queries" in _why(bias_shape=(1, 4, 1, 200), bias_strides=(0, 200, 0, 1))
    n = 2**24
    assert "2^31" in _why(bias_shape=(1, 4, 157, n), bias_strides=(0, 157 * n, n, 1), s_k=n,
                          planes=2**14)


def _check_decomposition(s_q, s_k, b, h, sum_b, sum_h, wl, wr, diag, window):
    planes_b, planes_h = (1 if sum_b else b), (1 if sum_h else h)
    covered = np.zeros((planes_b, planes_h, s_q, s_k), int)
    i = np.arange(s_q)[:, None] + diag
    j = np.arange(s_k)[None, :]
    keep = (j >= i - wl) & (j <= i + wr) if window else np.ones((s_q, s_k), bool)
    ws = []
    for w, m0, n0, pb, ph, pairs, need_mask in plan_dbias_sm90.work_tiles(s_q, s_k, b, h, sum_b, sum_h,
                                                              wl, wr, diag, window):
        ws.append(w)
        covered[pb, ph, m0:m0 + plan_dbias_sm90.BM, n0:n0 + plan_dbias_sm90.BN] += 1
        tile_keep = keep[m0:m0 + plan_dbias_sm90.BM, n0:n0 + plan_dbias_sm90.BN]
        if not pairs:
            assert not tile_keep.any(), (w, m0, n0)   # stored as zeros: no kept element
            continue
        want = [(bb, hh) for bb in (range(b) if sum_b else [pb]) for hh in (range(h) if sum_h else [ph])]
        assert pairs == want
        if not need_mask:
            assert tile_keep.all(), (w, m0, n0)       # no per-element mask: every element kept
    assert ws == list(range(len(ws)))
    assert (covered == 1).all()


@pytest.mark.parametrize("s_q, s_k", [(1, 1), (157, 200), (128, 128), (300, 129), (64, 1000)])
@pytest.mark.parametrize("sum_b, sum_h", [(True, False), (False, True), (True, True), (False, False)])
def test_work_tiles_dense(s_q, s_k, sum_b, sum_h):
    _check_decomposition(s_q, s_k, 3, 2, sum_b, sum_h, s_q + s_k, s_q + s_k, s_k - s_q, False)


@pytest.mark.parametrize("s_q, s_k", [(157, 200), (300, 129), (700, 700), (64, 1000)])
@pytest.mark.parametrize("wl, wr, bottom_right", [(-1, 0, True), (-1, 0, False), (50, 9, True),
                                                  (0, 0, True), (200, -1, False)])
def test_work_tiles_window(s_q, s_k, wl, wr, bottom_right):
    unbounded = s_q + s_k
    _check_decomposition(s_q, s_k, 2, 2, True, False, wl if wl >= 0 else unbounded,
                         wr if wr >= 0 else unbounded, s_k - s_q if bottom_right else 0, True)


@pytest.mark.parametrize("offsets,want", [((0, 0, 0, 0, 0), True), ((0, 0, 0, 0, 8), False),
                                          ((16, 32, 0, 48, 0), True), ((2, 0, 0, 0, 0), False)],
                         ids=["all-aligned", "bias-8", "multiples-of-16", "q-2"])
def test_bases_aligned(offsets, want):
    """TMA needs 16-byte aligned bases: the launcher keeps the float32 accumulator otherwise."""
    from types import SimpleNamespace
    arrays = [SimpleNamespace(data=SimpleNamespace(ptr=4096 + o)) for o in offsets]
    assert plan_dbias_sm90.bases_aligned(*arrays) is want
