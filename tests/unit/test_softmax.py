"""The seed's softmax algorithms in cupyflash.cpu against plain, scipy-free references."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import cpu

SOFTMAXES = {
    "three_pass": cpu.softmax_three_pass,
    "online_two_pass": cpu.softmax_online_two_pass,
}


def naive_softmax(x):
    """exp(x) / sum(exp(x)) row by row with math.fsum (fine for moderate x)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        e = [math.exp(t) for t in x[idx]]
        tot = math.fsum(e)
        out[idx] = [t / tot for t in e]
    return out


def naive_logsumexp(x):
    x = np.asarray(x, dtype=np.float64)
    out = np.empty(x.shape[:-1])
    for idx in np.ndindex(x.shape[:-1]):
        out[idx] = math.log(math.fsum(math.exp(t) for t in x[idx]))
    return out


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 13), (2, 3, 64)], ids=str)
def test_softmax_matches_naive(rng, name, shape):
    x = 3 * rng.standard_normal(shape)
    y = SOFTMAXES[name](x)
    np.testing.assert_allclose(y, naive_softmax(x), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-13)


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
@pytest.mark.parametrize("shift", [1e3, -1e3, 1e5, 3e30], ids=lambda s: f"shift{s:g}")
def test_softmax_large_magnitudes(rng, name, shift):
    # softmax(x + c) = softmax(x); naive exp would overflow / underflow here
    x = rng.standard_normal((4, 17))
    y = SOFTMAXES[name](x + shift)
    ref = naive_softmax((x + shift) - (x + shift).max(-1, keepdims=True))
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, ref, rtol=1e-12 * max(1.0, abs(shift) / 1e3), atol=1e-300)


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
def test_softmax_neg_inf_entries(rng, name):
    x = rng.standard_normal((5, 11))
    drop = rng.random((5, 11)) < 0.4
    drop[:, 0] = False
    x[drop] = -np.inf
    y = SOFTMAXES[name](x)
    assert np.all(y[drop] == 0)
    for r in range(5):
        np.testing.assert_allclose(y[r, ~drop[r]], naive_softmax(x[r, ~drop[r]]), rtol=1e-13)


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
def test_softmax_all_neg_inf_row_is_zero_not_nan(rng, name):
    x = rng.standard_normal((3, 6))
    x[1] = -np.inf
    y = SOFTMAXES[name](x)
    assert not np.any(np.isnan(y))
    assert np.all(y[1] == 0)
    np.testing.assert_allclose(y[[0, 2]], naive_softmax(x[[0, 2]]), rtol=1e-13)


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
def test_softmax_float32_stays_float32(rng, name):
    x = (5 * rng.standard_normal((4, 33))).astype(np.float32)
    y = SOFTMAXES[name](x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, naive_softmax(x), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("value_shape", ["scalar", "vector"])
@pytest.mark.parametrize("n", [1, 2, 9, 50])
def test_one_pass_delayed_matches_softmax_weighted_sum(rng, value_shape, n):
    x = 4 * rng.standard_normal((3, n))
    vals = rng.standard_normal((3, n) if value_shape == "scalar" else (3, n, 5))
    got = cpu.softmax_one_pass_delayed(x, vals)
    p = naive_softmax(x)
    want = (p * vals).sum(-1) if value_shape == "scalar" else np.einsum("rn,rne->re", p, vals)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_one_pass_delayed_large_magnitudes_and_neg_inf(rng):
    x = rng.standard_normal((4, 20)) + 1e4
    x[0, ::2] = -np.inf
    x[3] = -np.inf
    vals = rng.standard_normal((4, 20, 3))
    got = cpu.softmax_one_pass_delayed(x, vals)
    assert not np.any(np.isnan(got))
    np.testing.assert_array_equal(got[3], 0.0)
    p = cpu.softmax_three_pass(x)
    np.testing.assert_allclose(got[:3], np.einsum("rn,rne->re", p, vals)[:3], rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("shape", [(1,), (9,), (4, 31)], ids=str)
def test_logsumexp_matches_naive(rng, shape):
    x = 3 * rng.standard_normal(shape)
    np.testing.assert_allclose(cpu.logsumexp(x), naive_logsumexp(x), rtol=1e-14)


@pytest.mark.parametrize("shift", [1e3, -1e3, 1e8, -1e300], ids=lambda s: f"shift{s:g}")
def test_logsumexp_large_magnitudes(rng, shift):
    x = rng.standard_normal((3, 12))
    got = cpu.logsumexp(x + shift)
    np.testing.assert_allclose(got, naive_logsumexp(x) + shift, rtol=1e-14, atol=1e-12)


def test_logsumexp_neg_inf(rng):
    x = rng.standard_normal((3, 8))
    x[0, 3:] = -np.inf
    x[2] = -np.inf
    got = cpu.logsumexp(x)
    np.testing.assert_allclose(got[0], naive_logsumexp(x[0, :3]), rtol=1e-14)
    np.testing.assert_allclose(got[1], naive_logsumexp(x[1]), rtol=1e-14)
    assert got[2] == -np.inf


def test_logsumexp_axis(rng):
    x = rng.standard_normal((5, 6))
    np.testing.assert_allclose(cpu.logsumexp(x, axis=0), naive_logsumexp(x.T), rtol=1e-14)
