"""The float64 ground truth itself: against a hand-written loop, finite differences, and pictures."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cupyflash import reference as ref

B, H, HK, D, DV = 2, 4, 2, 3, 2


def make_qkv(rng, s_q, s_k, b=B, h=H, h_k=HK, d=D, d_v=DV):
    q = rng.standard_normal((b, s_q, h, d))
    k = rng.standard_normal((b, s_k, h_k, d))
    v = rng.standard_normal((b, s_k, h_k, d_v))
    return q, k, v


def options(name, rng, s_q, s_k, b=B, h=H):
    """Keyword options of the case ``name`` (fresh random bias / mask / slopes)."""
    r = rng
    return {
        "plain": {},
        "scale": {"scale": 0.37},
        "causal": {"causal": True},
        "causal_top_left": {"causal": True, "causal_align": "top_left"},
        "window": {"window": (2, 1)},
        "window_left_only": {"window": (1, None)},
        "window_right_only_top_left": {"window": (-1, 2), "causal_align": "top_left"},
        "causal_window": {"causal": True, "window": (2, 5)},
        "softcap": {"softcap": 1.5},
        "bias_full": {"bias": r.standard_normal((b, h, s_q, s_k))},
        "bias_heads_keys": {"bias": r.standard_normal((h, 1, s_k))},
        "bias_keys": {"bias": r.standard_normal((s_k,))},
        "bias_batch_rows": {"bias": r.standard_normal((b, 1, s_q, 1))},
        "mask": {"mask": r.random((b, 1, s_q, s_k)) < 0.7},
        "alibi_h": {"alibi_slopes": r.random(h)},
        "alibi_bh": {"alibi_slopes": r.random((b, h))},
        "all": {"causal": True, "window": (3, None), "softcap": 2.0,
                "bias": r.standard_normal((1, h, s_q, s_k)), "alibi_slopes": r.random((b, h)),
                "mask": r.random((s_q, s_k)) < 0.8, "scale": 0.6},
    }[name]


CASES = ["plain", "scale", "causal", "causal_top_left", "window", "window_left_only",
         "window_right_only_top_left", "causal_window", "softcap", "bias_full", "bias_heads_keys",
         "bias_keys", "bias_batch_rows", "mask", "alibi_h", "alibi_bh", "all"]
SHAPES = [(4, 4), (3, 6), (6, 3), (1, 5), (5, 1)]


def loop_attention(q, k, v, scale=None, causal=False, causal_align="bottom_right", window=None,
                   bias=None, mask=None, softcap=None, alibi_slopes=None):
    """The score semantics of docs/semantics.md §2, one score at a time with Python floats."""
    b, s_q, h, d = q.shape
    s_k, h_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    left, right = window if window is not None else (None, None)
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    if causal:
        right = 0
    bias4 = None if bias is None else np.broadcast_to(bias, (b, h, s_q, s_k))
    mask4 = None if mask is None else np.broadcast_to(mask, (b, h, s_q, s_k))
    slopes = None
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.reshape(alibi_slopes, (-1, h)), (b, h))
    out = np.zeros((b, s_q, h, d_v))
    lse = np.full((b, h, s_q), -np.inf)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // h_k)
            for i in range(s_q):
                diag = i + s_k - s_q if causal_align == "bottom_right" else i
                kept = []
                for j in range(s_k):
                    if left is not None and j < diag - left:
                        continue
                    if right is not None and j > diag + right:
                        continue
                    if mask4 is not None and not mask4[bi, hi, i, j]:
                        continue
                    s = scale * sum(float(q[bi, i, hi, t]) * float(k[bi, j, kv, t]) for t in range(d))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if bias4 is not None:
                        s += float(bias4[bi, hi, i, j])
                    if slopes is not None:
                        s -= float(slopes[bi, hi]) * abs(diag - j)
                    kept.append((j, s))
                if not kept:
                    continue
                m = max(s for _, s in kept)
                w = [(j, math.exp(s - m)) for j, s in kept]
                tot = math.fsum(e for _, e in w)
                lse[bi, hi, i] = m + math.log(tot)
                for e_ in range(d_v):
                    out[bi, i, hi, e_] = math.fsum(e * float(v[bi, j, kv, e_]) for j, e in w) / tot
    return out, lse


@pytest.mark.parametrize("s_q,s_k", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_loop(rng, case, s_q, s_k):
    q, k, v = make_qkv(rng, s_q, s_k)
    kw = options(case, rng, s_q, s_k)
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    out_l, lse_l = loop_attention(q, k, v, **kw)
    assert out.shape == (B, s_q, H, DV) and out.dtype == np.float64
    assert lse.shape == (B, H, s_q) and lse.dtype == np.float64
    np.testing.assert_allclose(out, out_l, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_l))
    fin = np.isfinite(lse_l)
    np.testing.assert_allclose(lse[fin], lse_l[fin], rtol=1e-12, atol=1e-13)
    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=lambda t: np.dtype(t).name)
def test_accepts_any_float_dtype(rng, dtype):
    q, k, v = make_qkv(rng, 5, 7)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out, lse = ref.attention(q, k, v, return_lse=True, causal=True)
    want = loop_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)[0]
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------------------- finite differences

def numerical_grad(f, x, eps=1e-6):
    """Central differences of the scalar f() with respect to every element of x (in place)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        fp = f()
        x[idx] = old - eps
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


GRAD_CASES = ["plain", "causal", "causal_top_left", "window", "softcap", "bias_full",
              "bias_heads_keys", "bias_keys", "bias_batch_rows", "mask", "alibi_h", "alibi_bh",
              "all"]


@pytest.mark.parametrize("s_q,s_k", [(3, 4), (4, 2)], ids=str)
@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_backward_matches_finite_differences(rng, case, s_q, s_k, gqa):
    h, h_k = (4, 2) if gqa else (2, 2)
    q, k, v = make_qkv(rng, s_q, s_k, b=2, h=h, h_k=h_k, d=3, d_v=2)
    kw = options(case, rng, s_q, s_k, b=2, h=h)
    dout = rng.standard_normal((2, s_q, h, 2))

    def loss():
        return float(np.sum(ref.attention(q, k, v, **kw) * dout))

    dq, dk, dv, dbias = ref.attention_backward(dout, q, k, v, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for name, x, g in [("q", q, dq), ("k", k, dk), ("v", v, dv)]:
        np.testing.assert_allclose(g, numerical_grad(loss, x), rtol=1e-6, atol=1e-8, err_msg=name)
    if "bias" in kw:
        bias = kw["bias"]
        assert dbias.shape == bias.shape
        np.testing.assert_allclose(dbias, numerical_grad(loss, bias), rtol=1e-6, atol=1e-8)
    else:
        assert dbias is None


@pytest.mark.parametrize("case", ["plain", "causal", "bias_keys", "softcap"])
def test_backward_given_out(rng, case):
    """out= takes D = rowsum(dO ∘ out) from the output a backward is handed: the exact O gives
    the same gradients; an O off by e changes dS by -P·rowsum(dO ∘ e) and leaves dV alone."""
    s_q, s_k = 5, 7
    q, k, v = make_qkv(rng, s_q, s_k)
    kw = options(case, rng, s_q, s_k)
    dout = rng.standard_normal((B, s_q, H, DV))
    exact = ref.attention_backward(dout, q, k, v, **kw)
    o = ref.attention(q, k, v, **kw)
    same = ref.attention_backward(dout, q, k, v, out=o, **kw)
    for g, g0 in zip(same, exact):
        if g0 is not None:
            np.testing.assert_allclose(g, g0, rtol=1e-12, atol=1e-14)
    e = 1e-3 * rng.standard_normal(o.shape)
    off = ref.attention_backward(dout, q, k, v, out=o + e, **kw)
    np.testing.assert_array_equal(off[2], exact[2])           # dV = Pᵀ dO: no D in it
    assert np.abs(off[0] - exact[0]).max() > 1e-6            # dQ moves with D
    if kw.get("bias") is not None:                           # dbias = Σ dS: moves by -Σ P·dD
        s = ref.scores(q, k, **kw)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        dd = (dout * e).sum(-1).transpose(0, 2, 1)[..., None]   # [b, h, s_q, 1]
        want = exact[3] - ref._reduce_to(p * dd, np.shape(kw["bias"]))
        np.testing.assert_allclose(off[3], want, rtol=1e-10, atol=1e-12)


def test_backward_given_out_of_another_shape_is_refused(rng):
    q, k, v = make_qkv(rng, 5, 7)
    dout = rng.standard_normal((B, 5, H, DV))
    o = ref.attention(q, k, v)
    for bad in (o[:, :4], o[..., :1], o.transpose(0, 2, 1, 3)):   # broadcastable ones too
        with pytest.raises(ValueError, match=r"out: shape .* expected dout's"):
            ref.attention_backward(dout, q, k, v, out=bad)


# ------------------------------------------------------------------------------ mask semantics

def test_fully_masked_rows_give_zero_and_neg_inf(rng):
    s_q, s_k = 4, 6
    q, k, v = make_qkv(rng, s_q, s_k)
    mask = rng.random((B, H, s_q, s_k)) < 0.7
    mask[0, 1, 2] = False          # one row of one head
    mask[1, :, 0] = False          # row 0 of every head of batch 1
    out, lse = ref.attention(q, k, v, mask=mask, return_lse=True)
    assert lse[0, 1, 2] == -np.inf and np.all(lse[1, :, 0] == -np.inf)
    np.testing.assert_array_equal(out[0, 2, 1], 0.0)
    np.testing.assert_array_equal(out[1, 0], 0.0)
    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse))
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, _ = ref.attention_backward(dout, q, k, v, mask=mask)
    np.testing.assert_array_equal(dq[0, 2, 1], 0.0)
    np.testing.assert_array_equal(dq[1, 0], 0.0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


def test_everything_masked(rng):
    q, k, v = make_qkv(rng, 3, 4)
    out, lse = ref.attention(q, k, v, mask=np.zeros((3, 4), bool), return_lse=True)
    np.testing.assert_array_equal(out, 0.0)
    assert np.all(lse == -np.inf)
    grads = ref.attention_backward(rng.standard_normal(out.shape), q, k, v,
                                   mask=np.zeros((3, 4), bool))
    for g in grads[:3]:
        np.testing.assert_array_equal(g, 0.0)


def test_mask_equals_neg_inf_bias(rng):
    q, k, v = make_qkv(rng, 5, 7)
    mask = rng.random((1, H, 5, 7)) < 0.6
    mask[..., 0] = True
    a = ref.attention(q, k, v, mask=mask)
    b = ref.attention(q, k, v, bias=np.where(mask, 0.0, -np.inf))
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------------- causal / window pictures

def picture(rows):
    return np.array([[c == "x" for c in r] for r in rows.split()])


def kept(s_q, s_k, **kw):
    rng = np.random.default_rng(0)
    q, k, _ = make_qkv(rng, s_q, s_k, b=1, h=1, h_k=1)
    return np.isfinite(ref.scores(q, k, **kw))[0, 0]


@pytest.mark.parametrize("s_q,s_k,align,rows", [
    (2, 5, "bottom_right", "xxxx. xxxxx"),
    (2, 5, "top_left", "x.... xx..."),
    (5, 2, "bottom_right", ".. .. .. x. xx"),
    (5, 2, "top_left", "x. xx xx xx xx"),
    (3, 3, "bottom_right", "x.. xx. xxx"),
    (3, 3, "top_left", "x.. xx. xxx"),
], ids=lambda x: str(x))
def test_causal_alignment_pictures(s_q, s_k, align, rows):
    np.testing.assert_array_equal(kept(s_q, s_k, causal=True, causal_align=align), picture(rows))


@pytest.mark.parametrize("s_q,s_k,kw,rows", [
    (4, 6, {"window": (1, 1)}, ".xxx.. ..xxx. ...xxx ....xx"),
    (4, 6, {"window": (1, 1), "causal_align": "top_left"}, "xx.... xxx... .xxx.. ..xxx."),
    (4, 6, {"window": (0, -1)}, "..xxxx ...xxx ....xx .....x"),
    (4, 6, {"window": (1, None), "causal": True}, ".xx... ..xx.. ...xx. ....xx"),
    (6, 3, {"window": (1, 0)}, "... ... ... x.. xx. .xx"),
], ids=["lr1", "lr1_top_left", "left0", "causal_left1", "sq_gt_sk_left1"])
def test_window_pictures(s_q, s_k, kw, rows):
    np.testing.assert_array_equal(kept(s_q, s_k, **kw), picture(rows))
