"""The CPU implementation's threading: blocks over (batch, kv head) (and query rows, forward) on a
thread pool give the same results as one thread, for every option that is sliced per block
(bias and mask broadcast or full, ALiBi per head or per batch, GQA, windows), and BLAS is
single-threaded only while a call runs."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _checks as ck
from cupyflash import cpu


@pytest.fixture
def parallel_always(monkeypatch):
    """Every problem large enough for the pool (the tests' problems are small)."""
    monkeypatch.setattr(cpu, "_PARALLEL_MIN_SCORES", 0)


CASES = {
    "plain": dict(),
    "gqa": dict(heads_k=1),
    "causal": dict(causal=True),
    "window": dict(window=(3, 1)),
    "bias-full": dict(bias=(2, 4, 9, 11)),
    "bias-per-head": dict(bias=(1, 4, 1, 11)),
    "bias-per-batch": dict(bias=(2, 1, 9, 11)),
    "bias-scalar": dict(bias=(1, 1, 1, 1)),
    "mask-per-head": dict(mask=(1, 4, 9, 11)),
    "alibi-heads": dict(alibi=(4,)),
    "alibi-batch-heads": dict(alibi=(2, 4)),
    "softcap-bias-causal-gqa": dict(softcap=5.0, bias=(2, 1, 9, 11), causal=True, heads_k=2),
}


def _problem(rng, heads_k=4, causal=False, window=None, bias=None, mask=None, alibi=None,
             softcap=None, dtype=np.float64):
    b, sq, sk, h, d = 2, 9, 11, 4, 8
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, heads_k, d)).astype(dtype)
    v = rng.standard_normal((b, sk, heads_k, d)).astype(dtype)
    dims = ck.check_qkv(q, k, v)
    maskv = None
    if mask is not None:
        maskv = rng.random(mask) < 0.8
        maskv[..., 0] = True
    opts = ck.make_options(
        dims, np, causal=causal, window=window, softcap=softcap,
        bias=None if bias is None else rng.standard_normal(bias).astype(dtype),
        mask=maskv, alibi_slopes=None if alibi is None else rng.random(alibi))
    return q, k, v, opts


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_threads_give_the_one_thread_result(rng, parallel_always, case, threads):
    q, k, v, opts = _problem(rng, **CASES[case])
    out1, lse1 = cpu.forward(q, k, v, opts, block_k=4, threads=1)
    outn, lsen = cpu.forward(q, k, v, opts, block_k=4, threads=threads)
    np.testing.assert_allclose(outn, out1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lsen, lse1, rtol=1e-12, atol=1e-12)
    dout = rng.standard_normal(out1.shape)
    g1 = cpu.backward(dout, q, k, v, out1, lse1, opts, block_k=4, threads=1)
    gn = cpu.backward(dout, q, k, v, out1, lse1, opts, block_k=4, threads=threads)
    for a, b in zip(gn, g1):
        if b is None:
            assert a is None
        else:
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_blocks_cover_every_pair_and_row_once():
    for b, h_k, s_q, threads in [(1, 8, 64, 2), (3, 5, 10, 4), (1, 1, 100, 4), (2, 1, 7, 16),
                                 (16, 16, 32, 2)]:
        seen = np.zeros((b, h_k, s_q), int)
        for (b0, b1), (k0, k1), (r0, r1) in cpu._blocks(b, h_k, s_q, threads, split_rows=True):
            seen[b0:b1, k0:k1, r0:r1] += 1
        assert (seen == 1).all(), (b, h_k, s_q, threads)
        items = cpu._blocks(b, h_k, s_q, threads, split_rows=False)
        assert all(rows == (0, s_q) for _, _, rows in items)


def test_one_kv_head_splits_query_rows_forward(rng, parallel_always):
    items = cpu._blocks(1, 1, 64, 4, split_rows=True)
    assert len(items) == 4


def test_env_variable_sets_threads(monkeypatch):
    monkeypatch.setenv("CUPYFLASH_CPU_THREADS", "3")
    assert cpu.num_threads() == 3
    monkeypatch.setenv("CUPYFLASH_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="^CUPYFLASH_CPU_THREADS: got '0'"):
        cpu.num_threads()
    monkeypatch.delenv("CUPYFLASH_CPU_THREADS")
    assert cpu.num_threads() >= 1


@pytest.mark.parametrize("cores, threads", [(1, 2), (2, 4), (4, 8), (16, 20)],
                         ids=lambda x: str(x))
def test_default_threads_are_cores_plus_up_to_four_spares(monkeypatch, cores, threads):
    monkeypatch.delenv("CUPYFLASH_CPU_THREADS", raising=False)
    monkeypatch.setattr(cpu, "_cores", lambda: cores)
    assert cpu.num_threads() == threads


def test_blas_limited_only_during_a_threaded_call(rng, parallel_always):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    if not blas or blas[0]["num_threads"] == 1:
        pytest.skip("no multi-threaded BLAS to limit")
    before = blas[0]["num_threads"]
    seen = []
    real = cpu._forward_block

    def spy(*args, **kwargs):
        seen.append(threadpoolctl.threadpool_info()[0]["num_threads"])
        return real(*args, **kwargs)

    q, k, v, opts = _problem(rng)
    try:
        cpu._forward_block = spy
        cpu.forward(q, k, v, opts, threads=2)
    finally:
        cpu._forward_block = real
    assert seen and set(seen) == {1}
    assert threadpoolctl.threadpool_info()[0]["num_threads"] == before


def test_error_in_a_block_propagates(rng, parallel_always, monkeypatch):
    q, k, v, opts = _problem(rng)

    def boom(*args, **kwargs):
        raise FloatingPointError("boom")

    monkeypatch.setattr(cpu, "_forward_block", boom)
    with pytest.raises(FloatingPointError, match="boom"):
        cpu.forward(q, k, v, opts, threads=2)
    assert cpu._limit_depth == 0


@pytest.mark.parametrize("shape, expected", [
    ((1, 3, 2, 2, 4), 0),          # tiny products: BLAS would not thread them, left untouched
    ((1, 64, 4, 4, 32), 0),
    ((1, 128, 1, 1, 256), 1),      # few scores but a product BLAS would thread: one thread, limited
    ((1, 256, 8, 8, 64), "all"),   # enough scores for the pool
    ((1, 4096, 8, 2, 64), "all"),
], ids=str)
def test_thread_plan(monkeypatch, shape, expected):
    monkeypatch.setenv("CUPYFLASH_CPU_THREADS", "5")
    b, s, h, h_k, d = shape
    got = cpu._plan_threads(b, h, h_k, s, s, d, 128, None)
    assert got == (5 if expected == "all" else expected)
    assert cpu._plan_threads(b, h, h_k, s, s, d, 128, 3) == 3     # an explicit count wins
