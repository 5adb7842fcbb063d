"""Ring attention with simulated ranks (InProcessTransport, NumPy, the CPU implementation)
against one cupyflash.attention / attention_backward call on the whole sequence.

float64: max error <= 1e-10 for out, lse, dq, dk, dv (the ring changes only the summation order).
float32: the ring's error against the float64 reference within 2x the single call's, plus 1e-6.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import reference
from cupyflash.distributed import (InProcessTransport, ring_attention, ring_attention_backward,
                                   ring_attention_vjp, shard, unshard)

TOL64 = 1e-10


def _draw(rng, b, s_q, s_k, h, hk, d, dv, dtype=np.float64):
    q = rng.standard_normal((b, s_q, h, d)).astype(dtype)
    k = rng.standard_normal((b, s_k, hk, d)).astype(dtype)
    v = rng.standard_normal((b, s_k, hk, dv)).astype(dtype)
    do = rng.standard_normal((b, s_q, h, dv)).astype(dtype)
    return q, k, v, do


def _split(x, world, scheme, axis=1):
    return [shard(x, r, world, axis=axis, scheme=scheme) for r in range(world)]


def _ring_all(q, k, v, do, world, scheme, transport=None, **opts):
    """Forward and backward through the simulated ring; everything unsharded again."""
    t = transport or InProcessTransport(world)
    qs, ks, vs, dos = (_split(x, world, scheme) for x in (q, k, v, do))
    outs, lses = ring_attention(qs, ks, vs, t, return_lse=True, scheme=scheme, **opts)
    grads = ring_attention_backward(dos, qs, ks, vs, outs, lses, t, scheme=scheme, **opts)
    out = unshard(outs, world, scheme=scheme)
    lse = unshard(lses, world, axis=2, scheme=scheme)
    dq, dk, dv = (unshard([g[i] for g in grads], world, scheme=scheme) for i in range(3))
    return out, lse, dq, dk, dv


def _whole(q, k, v, do, **opts):
    out, lse = cf.attention(q, k, v, return_lse=True, **opts)
    return (out, lse) + tuple(cf.attention_backward(do, q, k, v, out, lse, **opts))


def _assert_close(got, want, tol, what=("out", "lse", "dq", "dk", "dv")):
    for name, g, w in zip(what, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        assert np.array_equal(np.isneginf(g), np.isneginf(w)), f"{name}: -inf rows differ"
        fin = np.isfinite(w)
        assert np.isfinite(g[fin]).all(), f"{name}: non-finite values"
        err = float(np.abs(g[fin] - w[fin]).max()) if fin.any() else 0.0
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", range(1, 9), ids=lambda w: f"w{w}")
def test_matches_single_call_float64(rng, world, causal, scheme):
    # contiguous: a length no world size > 1 divides (uneven shards); zigzag: 3 per chunk
    s = 6 * world if scheme == "zigzag" else 5 * world + (3 if world > 1 else 0)
    q, k, v, do = _draw(rng, 2, s, s, 4, 2, 8, 6)
    _assert_close(_ring_all(q, k, v, do, world, scheme, causal=causal),
                  _whole(q, k, v, do, causal=causal), TOL64)


WINDOWS = {
    "window_5_3": dict(window=(5, 3)),
    "window_0_0": dict(window=(0, 0)),
    "window_left_only": dict(window=(7, -1)),
    "window_right_only": dict(window=(None, 2)),
    "causal_window": dict(causal=True, window=(4, None)),
}


@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3, 5], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("opts", list(WINDOWS.values()), ids=list(WINDOWS))
def test_window_float64(rng, opts, world, scheme):
    s = 4 * world if scheme == "zigzag" else 4 * world + 1
    q, k, v, do = _draw(rng, 1, s, s, 2, 2, 8, 8)
    _assert_close(_ring_all(q, k, v, do, world, scheme, **opts), _whole(q, k, v, do, **opts), TOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q,s_k", [(24, 16), (16, 28)], ids=["sq>sk", "sq<sk"])
@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
def test_different_query_and_key_lengths(rng, s_q, s_k, causal, scheme):
    """Bottom-right alignment of the whole sequences; with s_q > s_k and causal the first rows
    see nothing (out 0, lse -inf) on the ranks holding them."""
    world = 2
    q, k, v, do = _draw(rng, 2, s_q, s_k, 2, 1, 8, 8)
    _assert_close(_ring_all(q, k, v, do, world, scheme, causal=causal),
                  _whole(q, k, v, do, causal=causal), TOL64)


def test_options_and_bhsd_layout(rng):
    world, scheme = 3, "zigzag"
    q, k, v, do = _draw(rng, 2, 18, 18, 4, 4, 8, 8)
    opts = dict(causal=True, scale=0.3, softcap=2.5)
    want = _whole(q, k, v, do, **opts)
    tr = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    t = InProcessTransport(world, copy=True)
    qs, ks, vs, dos = (_split(tr(x), world, scheme, axis=2) for x in (q, k, v, do))
    outs, lses = ring_attention(qs, ks, vs, t, return_lse=True, scheme=scheme, layout="bhsd", **opts)
    grads = ring_attention_backward(dos, qs, ks, vs, outs, lses, t, scheme=scheme, layout="bhsd",
                                    **opts)
    assert outs[0].shape == (2, 4, 6, 8) and grads[1][0].shape == (2, 4, 6, 8)
    got = [tr(unshard(outs, axis=2, scheme=scheme)), unshard(lses, axis=2, scheme=scheme)]
    got += [tr(unshard([g[i] for g in grads], axis=2, scheme=scheme)) for i in range(3)]
    _assert_close(got, want, TOL64)


def test_uneven_shards_with_empty_rank(rng):
    """Contiguous shards of any lengths, one of them empty."""
    q, k, v, do = _draw(rng, 1, 11, 11, 2, 2, 4, 4)
    cuts = [0, 5, 5, 7, 11]
    sl = lambda x: [x[:, a:b] for a, b in zip(cuts, cuts[1:])]  # noqa: E731
    t = InProcessTransport(4)
    outs, lses = ring_attention(sl(q), sl(k), sl(v), t, causal=True, return_lse=True)
    grads = ring_attention_backward(sl(do), sl(q), sl(k), sl(v), outs, lses, t, causal=True)
    got = [np.concatenate(outs, 1), np.concatenate(lses, 2)]
    got += [np.concatenate([g[i] for g in grads], 1) for i in range(3)]
    _assert_close(got, _whole(q, k, v, do, causal=True), TOL64)


def test_vjp_form(rng):
    world = 4
    q, k, v, do = _draw(rng, 1, 16, 16, 2, 2, 8, 8)
    t = InProcessTransport(world)
    qs, ks, vs, dos = (_split(x, world, "zigzag") for x in (q, k, v, do))
    outs, vjp = ring_attention_vjp(qs, ks, vs, t, causal=True, scheme="zigzag")
    grads = vjp(dos)
    out, f = cf.attention_vjp(q, k, v, causal=True)
    want = (out,) + tuple(f(do))
    got = [unshard(outs, scheme="zigzag")]
    got += [unshard([g[i] for g in grads], scheme="zigzag") for i in range(3)]
    _assert_close(got, want, TOL64, what=("out", "dq", "dk", "dv"))
    with pytest.raises(TypeError, match="return_lse"):
        ring_attention_vjp(qs, ks, vs, t, return_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_within_twice_single_call_error(rng, causal):
    world, scheme = 4, "zigzag"
    q, k, v, do = _draw(rng, 2, 64, 64, 4, 2, 16, 16, np.float32)
    got = _ring_all(q, k, v, do, world, scheme, causal=causal)
    single = _whole(q, k, v, do, causal=causal)
    r_out, r_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    r_grads = reference.attention_backward(do, q, k, v, causal=causal)
    for name, g, s, r in zip(("out", "lse", "dq", "dk", "dv"), got, single, (r_out, r_lse) + tuple(r_grads)):
        assert g.dtype == s.dtype, name
        err = np.abs(g.astype(np.float64) - r).max()
        bound = 2 * np.abs(s.astype(np.float64) - r).max() + 1e-6
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


def test_errors_name_the_argument(rng):
    q, k, v, _ = _draw(rng, 1, 10, 10, 2, 2, 4, 4)
    t = InProcessTransport(2)
    two = lambda x: [x[:, :5], x[:, 5:]]  # noqa: E731
    with pytest.raises(ValueError, match="zigzag"):
        ring_attention(two(q), two(k), two(v), t, causal=True, scheme="zigzag")  # odd shards
    with pytest.raises(ValueError, match="zigzag"):
        shard(q, 0, 3, scheme="zigzag")                                           # 10 % 6
    with pytest.raises(ValueError, match="scheme"):
        ring_attention(two(q), two(k), two(v), t, scheme="striped")
    with pytest.raises(ValueError, match="window"):
        ring_attention(two(q), two(k), two(v), t, window=(3, -2))
    with pytest.raises(ValueError, match="seqlens_q"):
        ring_attention(two(q), two(k), two(v), t, seqlens_q=[4, 6])
    with pytest.raises(ValueError, match="q: got 1 arrays"):
        ring_attention([q], two(k), two(v), t)
    with pytest.raises(TypeError, match="comm"):
        ring_attention(q, k, v, object())
    with pytest.raises(ValueError, match="layout"):
        ring_attention(two(q), two(k), two(v), t, layout="sbhd")
