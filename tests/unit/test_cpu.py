"""cupyflash.cpu (blocked online softmax, NumPy) against the float64 reference.

Options are built directly here (the validation module is tested on its own); the reference
takes the public keyword names, so a disagreement in how the two read an option shows up too.
"""
from __future__ import annotations

import contextlib
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cupyflash import cpu, reference as ref
from cupyflash._options import UNBOUNDED, Options

LENGTHS = st.one_of(st.sampled_from([1, 2, 3, 5, 7, 13, 16, 17, 31, 32, 33, 47, 61, 64, 67, 70]),
                    st.integers(1, 70))
FUZZ = settings(max_examples=500, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def tile_elems(n):
    """Temporarily shrink the query-block budget so several query blocks run."""
    old = cpu._TILE_ELEMS
    cpu._TILE_ELEMS = n
    try:
        yield
    finally:
        cpu._TILE_ELEMS = old


@st.composite
def problems(draw, dtype=np.float64):
    """One random attention problem: arrays, Options, and the same options as reference kwargs."""
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    b = draw(st.integers(1, 2))
    s_q, s_k = draw(LENGTHS), draw(LENGTHS)
    h_k = draw(st.integers(1, 2))
    h = h_k * draw(st.sampled_from([1, 2, 3]))
    d, d_v = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    q = rng.standard_normal((b, s_q, h, d)).astype(dtype)
    k = rng.standard_normal((b, s_k, h_k, d)).astype(dtype)
    v = rng.standard_normal((b, s_k, h_k, d_v)).astype(dtype)
    scale = draw(st.sampled_from([None, 0.3, 1.0]))
    kw = {"scale": scale}
    scale = 1 / math.sqrt(d) if scale is None else scale
    causal = draw(st.booleans())
    bottom_right = draw(st.booleans())
    left = draw(st.one_of(st.none(), st.integers(0, 40)))
    right = 0 if causal else draw(st.one_of(st.none(), st.integers(0, 40)))
    kw.update(causal=causal, causal_align="bottom_right" if bottom_right else "top_left",
              window=(left, None if causal else right))
    softcap = draw(st.sampled_from([0.0, 0.0, 0.7, 5.0]))
    kw["softcap"] = softcap or None
    alibi = draw(st.sampled_from([None, "h", "bh"]))
    slopes = None
    if alibi:
        raw = rng.random(h if alibi == "h" else (b, h)).astype(np.float32)
        kw["alibi_slopes"] = raw
        slopes = raw.reshape(-1, h)
    bias = mask = None
    full = (b, h, s_q, s_k)
    if draw(st.booleans()):
        bshape = tuple(n if draw(st.booleans()) else 1 for n in full)
        bias = rng.standard_normal(bshape).astype(dtype)
        kw["bias"] = bias
    if draw(st.booleans()):
        mshape = tuple(n if draw(st.booleans()) else 1 for n in full)
        mask = rng.random(mshape) < 0.8
        kw["mask"] = mask
    opts = Options(scale=scale, window_left=UNBOUNDED if left is None else left,
                   window_right=UNBOUNDED if right is None else right, bottom_right=bottom_right,
                   softcap=softcap, alibi_slopes=slopes, bias=bias,
                   bias_shape=None if bias is None else bias.shape, mask=mask)
    dout = rng.standard_normal((b, s_q, h, d_v)).astype(dtype)
    block_k = draw(st.sampled_from([1, 5, 16, 32, 128]))
    tiles = draw(st.sampled_from([1 << 18, 300, 3000]))
    return dict(q=q, k=k, v=v, dout=dout, opts=opts, kw=kw, block_k=block_k, tiles=tiles)


def run_cpu(p):
    with tile_elems(p["tiles"]):
        out, lse = cpu.forward(p["q"], p["k"], p["v"], p["opts"], block_k=p["block_k"])
        grads = cpu.backward(p["dout"], p["q"], p["k"], p["v"], out, lse, p["opts"],
                             block_k=p["block_k"])
    return out, lse, grads


def run_ref(p):
    out, lse = ref.attention(p["q"], p["k"], p["v"], return_lse=True, **p["kw"])
    grads = ref.attention_backward(p["dout"], p["q"], p["k"], p["v"], **p["kw"])
    return out, lse, grads


def assert_lse_close(lse, want, rtol, atol):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(lse[fin], want[fin], rtol=rtol, atol=atol)


def naive32(p):
    """The same attention done naively in float32 (materialized), forward and backward.

    Its error against the float64 reference is the yardstick of docs/semantics.md §9.
    """
    f = np.float32
    q, k, v, dout, kw = p["q"], p["k"], p["v"], p["dout"], p["kw"]
    b, s_q, h, d = q.shape
    g = h // k.shape[2]
    o = p["opts"]
    qh = q.astype(f).transpose(0, 2, 1, 3)                               # [b, h, s_q, d]
    kh = np.repeat(k.astype(f).transpose(0, 2, 1, 3), g, axis=1)         # [b, h, s_k, d]
    vh = np.repeat(v.astype(f).transpose(0, 2, 1, 3), g, axis=1)         # [b, h, s_k, d_v]
    do = dout.astype(f).transpose(0, 2, 1, 3)                            # [b, h, s_q, d_v]
    s = f(o.scale) * (qh @ kh.swapaxes(-1, -2))
    t = None
    if o.softcap:
        t = np.tanh(s / f(o.softcap))
        s = f(o.softcap) * t
    if o.bias is not None:
        s = s + o.bias.astype(f)
    keep = np.isfinite(ref.scores(q, k, **kw))                           # the mask pattern only
    if o.alibi_slopes is not None:
        diag = np.arange(s_q)[:, None] + o.diag_offset(s_q, k.shape[1])
        s = s - o.alibi_slopes[:, :, None, None] * np.abs(diag - np.arange(k.shape[1])).astype(f)
    s = np.where(keep, s, -np.inf).astype(f)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isneginf(m), 0, m))
    l = e.sum(-1, keepdims=True)
    pr = np.where(l > 0, e / np.where(l > 0, l, 1), 0).astype(f)
    out = pr @ vh
    lse = np.where(l > 0, np.where(np.isneginf(m), 0, m) + np.log(np.where(l > 0, l, 1)), -np.inf)
    dv = (pr.swapaxes(-1, -2) @ do).reshape(b, -1, g, *vh.shape[2:]).sum(2)
    ds = pr * (do @ vh.swapaxes(-1, -2) - (do * out).sum(-1, keepdims=True))
    dbias = None
    if o.bias is not None:
        red = tuple(a for a in range(4) if o.bias.shape[a] == 1)
        dbias = ds.sum(axis=red, keepdims=True)
    if t is not None:
        ds = ds * (1 - t * t)
    dq = f(o.scale) * (ds @ kh)
    dk = (f(o.scale) * (ds.swapaxes(-1, -2) @ qh)).reshape(b, -1, g, *kh.shape[2:]).sum(2)
    bshd = lambda x: x.transpose(0, 2, 1, 3)
    return bshd(out), lse[..., 0], (bshd(dq), bshd(dk), bshd(dv), dbias)


def assert_close_f32(got, want, naive, name, magnitude=None):
    """max |got − want| <= 2 · max |naive32 − want| + 1e-5 · (1 + magnitude)  (docs/semantics.md §9).

    magnitude defaults to max |want|; for a sum that cancels (dbias reduced over many
    elements) pass the max of the summed |terms| instead.
    """
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, name
    assert not np.any(np.isnan(got)), name
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin, err_msg=name)
    if fin.any():
        err = np.abs(got[fin] - want[fin]).max()
        err_naive = np.abs(np.asarray(naive, np.float64)[fin] - want[fin]).max()
        mag = np.abs(want[fin]).max() if magnitude is None else magnitude
        bound = 2 * err_naive + 1e-5 * (1.0 + mag)
        assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g} (naive f32 {err_naive:.3g})"


@FUZZ
@given(problems(np.float64))
def test_fuzz_float64_matches_reference(p):
    out, lse, (dq, dk, dv, dbias) = run_cpu(p)
    r_out, r_lse, (r_dq, r_dk, r_dv, r_dbias) = run_ref(p)
    assert out.dtype == lse.dtype == np.float64
    assert all(g.dtype == np.float64 for g in (dq, dk, dv))
    np.testing.assert_allclose(out, r_out, rtol=1e-10, atol=1e-10)
    assert_lse_close(lse, r_lse, 1e-10, 1e-10)
    for name, g, r in [("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)]:
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10, err_msg=name)
    if p["opts"].bias is None:
        assert dbias is None
    else:
        assert dbias.shape == p["opts"].bias.shape and dbias.dtype == np.float64
        np.testing.assert_allclose(dbias, r_dbias, rtol=1e-10, atol=1e-10)


@settings(FUZZ, max_examples=400)
@given(problems(np.float32))
def test_fuzz_float32_matches_reference(p):
    out, lse, (dq, dk, dv, dbias) = run_cpu(p)
    r_out, r_lse, (r_dq, r_dk, r_dv, r_dbias) = run_ref(p)
    assert out.dtype == lse.dtype == np.float32
    assert all(g.dtype == np.float32 for g in (dq, dk, dv))
    n_out, n_lse, (n_dq, n_dk, n_dv, n_dbias) = naive32(p)
    assert_close_f32(out, r_out, n_out, "out")
    assert_close_f32(lse, r_lse, n_lse, "lse")
    for name, g, r, n in [("dq", dq, r_dq, n_dq), ("dk", dk, r_dk, n_dk), ("dv", dv, r_dv, n_dv)]:
        assert_close_f32(g, r, n, name)
    if p["opts"].bias is None:
        assert dbias is None
    else:
        assert dbias.dtype == np.float32
        # Σ |dS| over the bias's broadcast dims: the scale of the cancelling sum dbias is
        bias = p["opts"].bias
        b, s_q, h, _ = p["q"].shape
        full = np.broadcast_to(bias, (b, h, s_q, p["k"].shape[1]))
        ds = ref.attention_backward(p["dout"], p["q"], p["k"], p["v"],
                                    **{**p["kw"], "bias": np.ascontiguousarray(full)})[3]
        red = tuple(a for a in range(4) if bias.shape[a] == 1)
        mag = np.abs(ds).sum(axis=red).max() if ds.size else 0.0
        assert_close_f32(dbias, r_dbias, n_dbias, "dbias", magnitude=mag)


# ---------------------------------------------------------------------------- targeted cases

def make(rng, b, s_q, s_k, h, h_k, d, d_v, dtype=np.float64):
    q = rng.standard_normal((b, s_q, h, d)).astype(dtype)
    k = rng.standard_normal((b, s_k, h_k, d)).astype(dtype)
    v = rng.standard_normal((b, s_k, h_k, d_v)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_low_precision_inputs_give_their_dtype_back(rng, dtype):
    q, k, v = make(rng, 2, 37, 45, 4, 2, 24, 16, dtype)
    bias = rng.standard_normal((1, 4, 37, 45)).astype(dtype)
    opts = Options(scale=1 / math.sqrt(24), window_right=0, bias=bias, bias_shape=bias.shape)
    out, lse = cpu.forward(q, k, v, opts, block_k=16)
    assert out.dtype == dtype and out.shape == (2, 37, 4, 16)
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 37)
    r_out, r_lse = ref.attention(q, k, v, causal=True, bias=bias, return_lse=True)
    tol = 1e-2 if dtype == ml_dtypes.bfloat16 else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), r_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dq, dk, dv, dbias = cpu.backward(dout, q, k, v, out, lse, opts, block_k=16)
    assert (dq.dtype, dk.dtype, dv.dtype, dbias.dtype) == (dtype,) * 4
    r = ref.attention_backward(dout, q, k, v, causal=True, bias=bias)
    for g, rg in zip((dq, dk, dv, dbias), r):
        g = g.astype(np.float64)
        assert np.abs(g - rg).max() <= 3 * tol * (1 + np.abs(rg).max())


@pytest.mark.parametrize("b,s_q,s_k,h", [(0, 5, 6, 2), (2, 0, 6, 2), (2, 5, 0, 2), (2, 0, 0, 2)],
                         ids=["batch0", "sq0", "sk0", "sq0_sk0"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_empty_inputs(rng, b, s_q, s_k, h, dtype):
    q, k, v = make(rng, b, s_q, s_k, h, 1, 8, 3, dtype)
    bias = rng.standard_normal((1, h, s_q, s_k)).astype(dtype)
    opts = Options(scale=0.3, bias=bias, bias_shape=bias.shape)
    out, lse = cpu.forward(q, k, v, opts)
    assert out.shape == (b, s_q, h, 3) and out.dtype == dtype
    assert lse.shape == (b, h, s_q) and lse.dtype == dtype
    np.testing.assert_array_equal(out, 0.0)
    assert np.all(lse == -np.inf)
    dq, dk, dv, dbias = cpu.backward(np.zeros_like(out), q, k, v, out, lse, opts)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dbias.shape == bias.shape
    for g in (dq, dk, dv, dbias):
        np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_nan_propagates(rng, dtype):
    q, k, v = make(rng, 1, 9, 11, 2, 2, 4, 3, dtype)
    q[0, 3, 1, 2] = np.nan          # one query row of head 1
    v[0, 5, 0, 1] = np.inf          # one key's value of kv head 0
    opts = Options(scale=0.5)
    with np.errstate(all="ignore"):
        out, lse = cpu.forward(q, k, v, opts, block_k=4)
        grads = cpu.backward(np.ones_like(out), q, k, v, out, lse, opts, block_k=4)
    assert np.all(np.isnan(out[0, 3, 1])) and np.isnan(lse[0, 1, 3])
    rows = np.ones(9, bool)
    rows[3] = False
    assert np.all(np.isfinite(out[0, rows, 1])) and np.all(np.isfinite(lse[0, 1, rows]))
    assert np.all(~np.isfinite(out[0, :, 0, 1]))     # every row of head 0 sees v = inf
    assert np.all(np.isfinite(out[0, :, 0, [0, 2]]))
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


@pytest.mark.parametrize("how", ["mask", "causal_sq_gt_sk", "window_top_left", "neg_inf_bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_fully_masked_rows(rng, how, dtype):
    b, s_q, s_k, h = 2, 23, 17, 2
    q, k, v = make(rng, b, s_q, s_k, h, 1, 8, 5, dtype)
    kw, okw = {}, {}
    if how == "mask":
        mask = rng.random((b, h, s_q, s_k)) < 0.7
        mask[0, 1, 4] = mask[1, :, 20] = False
        kw["mask"] = okw["mask"] = mask
    elif how == "causal_sq_gt_sk":          # bottom-right: rows 0..5 see no key
        kw["causal"], okw["window_right"] = True, 0
    elif how == "window_top_left":          # key j == i only: rows 17..22 see no key
        kw.update(window=(0, 0), causal_align="top_left")
        okw.update(window_left=0, window_right=0, bottom_right=False)
    else:                                   # -inf additive bias acting as a mask
        bias = rng.standard_normal((1, h, s_q, s_k)).astype(dtype)
        bias[0, 0, 3:6] = -np.inf
        bias[0, 1, :, ::2] = -np.inf
        kw["bias"], okw["bias"], okw["bias_shape"] = bias, bias, bias.shape
    opts = Options(scale=0.4, **okw)
    out, lse = cpu.forward(q, k, v, opts, block_k=8)
    r_out, r_lse = ref.attention(q, k, v, scale=0.4, return_lse=True, **kw)
    empty = np.isneginf(r_lse)
    assert empty.any()
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_array_equal(out.transpose(0, 2, 1, 3)[empty], 0.0)
    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse))
    dout = rng.standard_normal(out.shape).astype(dtype)
    dq, dk, dv, _ = cpu.backward(dout, q, k, v, out, lse, opts, block_k=8)
    np.testing.assert_array_equal(dq.transpose(0, 2, 1, 3)[empty], 0.0)
    r_dq, r_dk, r_dv, _ = ref.attention_backward(dout, q, k, v, scale=0.4, **kw)
    tol = 1e-10 if dtype == np.float64 else 1e-4
    for g, r in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)


@pytest.mark.parametrize("view", ["step_slices", "bhsd_transposed", "reversed", "fortran"])
def test_strided_views(rng, view):
    b, s_q, s_k, h, h_k, d, d_v = 2, 19, 29, 4, 2, 12, 7

    def strided(shape):
        if view == "step_slices":
            big = rng.standard_normal(tuple(2 * n + 1 for n in shape))
            return big[::2, 1::2, ::2, ::2][:shape[0], :shape[1], :shape[2], :shape[3]]
        if view == "bhsd_transposed":
            return rng.standard_normal((shape[0], shape[2], shape[1], shape[3])).transpose(0, 2, 1, 3)
        if view == "reversed":
            return rng.standard_normal(shape)[:, ::-1, :, ::-1]
        return np.asfortranarray(rng.standard_normal(shape))

    q, k, v = strided((b, s_q, h, d)), strided((b, s_k, h_k, d)), strided((b, s_k, h_k, d_v))
    dout = strided((b, s_q, h, d_v))
    assert not q.flags.c_contiguous
    bias = rng.standard_normal((b, 1, s_k, s_q)).transpose(0, 1, 3, 2)   # strided bias too
    opts = Options(scale=0.3, window_right=0, bias=bias, bias_shape=bias.shape)
    out, lse = cpu.forward(q, k, v, opts, block_k=8)
    grads = cpu.backward(dout, q, k, v, out, lse, opts, block_k=8)
    c = [np.ascontiguousarray(x) for x in (q, k, v, dout)]
    copts = Options(scale=0.3, window_right=0, bias=np.ascontiguousarray(bias), bias_shape=bias.shape)
    out_c, lse_c = cpu.forward(*c[:3], copts, block_k=8)
    grads_c = cpu.backward(c[3], *c[:3], out_c, lse_c, copts, block_k=8)
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(lse, lse_c)
    for g, gc in zip(grads, grads_c):
        np.testing.assert_array_equal(g, gc)
    r_out = ref.attention(q, k, v, scale=0.3, causal=True, bias=bias)
    np.testing.assert_allclose(out, r_out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_k", [1, 3, 64, 128, 1000])
def test_block_size_does_not_change_the_result(rng, block_k):
    q, k, v = make(rng, 1, 40, 130, 6, 3, 16, 16)
    opts = Options(scale=0.25, softcap=3.0)
    out, lse = cpu.forward(q, k, v, opts, block_k=block_k)
    r_out, r_lse = ref.attention(q, k, v, scale=0.25, softcap=3.0, return_lse=True)
    np.testing.assert_allclose(out, r_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-12, atol=1e-12)


def test_large_scores_do_not_overflow(rng):
    # scores of several hundred: exp without the running max would overflow in float32
    q, k, v = make(rng, 1, 33, 70, 2, 2, 32, 8, np.float32)
    opts = Options(scale=20.0)
    out, lse = cpu.forward(q, k, v, opts, block_k=16)
    r_out, r_lse = ref.attention(q, k, v, scale=20.0, return_lse=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.abs(r_lse).max() > 200
    np.testing.assert_allclose(out, r_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5)
