"""float64 materialized attention: the tests' ground truth.

Deliberately simple and deliberately independent of ``_options`` / ``_checks``: it takes the
public keyword names (docs/semantics.md §1) and computes everything in float64 with the full
[b, h, s_q, s_k] score matrix, so it can catch bugs in the validation and in every backend.

Layout is "bshd" throughout:

- q    [b, s_q, h,   d]
- k    [b, s_k, h_k, d]
- v    [b, s_k, h_k, d_v]       h % h_k == 0; query head i uses kv head i // (h // h_k)
- out  [b, s_q, h,   d_v]
- lse  [b, h, s_q]              natural log; -inf for a row that attends to nothing

Scores, in this order::

    s = scale * q @ k.T                        # [b, h, s_q, s_k], scale default 1/sqrt(d)
    s = softcap * tanh(s / softcap)            # when softcap is set (None or 0 = off)
    s = s + bias                               # bias broadcastable to [b, h, s_q, s_k]
    s = s - slope[b, h] * |diag(i) - j|        # ALiBi, slopes (h,) or (b, h)
    s = -inf where the window or the mask drops (i, j)

``diag(i) = i + s_k - s_q`` (causal_align="bottom_right") or ``i`` ("top_left"); key j is kept
when ``diag(i) - left <= j <= diag(i) + right`` (None or -1 = unbounded side); causal=True sets
right = 0. ``mask`` is boolean, broadcastable like bias, True = attend.
"""
from __future__ import annotations

import numpy as np

__all__ = ["scores", "attention", "attention_backward"]


def _f64(x):
    """Any float array (ml_dtypes.bfloat16 included) -> float64 ndarray."""
    return np.asarray(x).astype(np.float64)


def _window_sides(causal, window):
    """(left, right) with None meaning unbounded."""
    left = right = None
    if window is not None:
        left, right = window
        left = None if left is None or left < 0 else int(left)
        right = None if right is None or right < 0 else int(right)
    if causal:
        right = 0
    return left, right


def _expand_kv(x, h):
    """[b, s_k, h_k, e] -> [b, h, s_k, e] (query head i reads kv head i // (h // h_k))."""
    h_k = x.shape[2]
    idx = np.arange(h) // (h // h_k)
    return x.transpose(0, 2, 1, 3)[:, idx]


def _slopes(alibi_slopes, b, h):
    """(h,) or (b, h) -> float64 [b, h, 1, 1]."""
    a = _f64(alibi_slopes)
    if a.ndim == 1:
        a = a[None, :]
    return np.broadcast_to(a, (b, h))[:, :, None, None]


def _parts(q, k, scale, causal, causal_align, window, bias, mask, softcap, alibi_slopes):
    """Everything the forward and the backward share.

    Returns (s, s_raw, keep) with s the final scores [b, h, s_q, s_k] (-inf where dropped),
    s_raw = scale * q k^T [b, h, s_q, s_k] before softcap, keep the bool [b, h, s_q, s_k].
    """
    q, k = _f64(q), _f64(k)
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    kh = _expand_kv(k, h)                                    # [b, h, s_k, d]
    s_raw = scale * np.einsum("bihd,bhjd->bhij", q, kh)     # [b, h, s_q, s_k]
    s = s_raw
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + _f64(bias)
    i = np.arange(s_q)[:, None]
    j = np.arange(s_k)[None, :]
    if causal_align == "bottom_right":
        diag = i + (s_k - s_q)
    elif causal_align == "top_left":
        diag = i
    else:
        raise ValueError(f"causal_align must be 'bottom_right' or 'top_left', got {causal_align!r}")
    if alibi_slopes is not None:
        s = s - _slopes(alibi_slopes, b, h) * np.abs(diag - j)
    s = np.broadcast_to(s, (b, h, s_q, s_k))
    left, right = _window_sides(causal, window)
    keep = np.ones((s_q, s_k), dtype=bool)
    if left is not None:
        keep &= j >= diag - left
    if right is not None:
        keep &= j <= diag + right
    keep = np.broadcast_to(keep, (b, h, s_q, s_k))
    if mask is not None:
        keep = keep & np.asarray(mask, dtype=bool)
    s = np.where(keep, s, -np.inf)
    return s, np.broadcast_to(s_raw, (b, h, s_q, s_k)), keep


def scores(q, k, *, scale=None, causal=False, causal_align="bottom_right", window=None,
           bias=None, mask=None, softcap=None, alibi_slopes=None):
    """The final attention scores, materialized.

    Parameters
    ----------
    q : [b, s_q, h, d];  k : [b, s_k, h_k, d]  (any float dtype)
    bias : float, broadcastable to [b, h, s_q, s_k];  mask : bool, likewise (True = attend)
    alibi_slopes : (h,) or (b, h);  window : (left, right), None / -1 = unbounded side

    Returns
    -------
    float64 [b, h, s_q, s_k], -inf where the window / causal / mask drops the key.
    """
    s, _, _ = _parts(q, k, scale, causal, causal_align, window, bias, mask, softcap, alibi_slopes)
    return s


def _softmax_lse(s):
    """s [..., s_k] -> (p, lse): p = exp(s - lse), rows of all -inf give p = 0, lse = -inf."""
    m = s.max(axis=-1, initial=-np.inf, keepdims=True)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    # NaN in the scores propagates through both.
    nan_row = np.isnan(l)
    p = np.where(nan_row, np.nan, p)
    lse = np.where(nan_row, np.nan, lse)
    return p, lse[..., 0]


def attention(q, k, v, *, scale=None, causal=False, causal_align="bottom_right", window=None,
              bias=None, mask=None, softcap=None, alibi_slopes=None, return_lse=False):
    """softmax(scores) @ v in float64.

    Parameters
    ----------
    q : [b, s_q, h, d];  k : [b, s_k, h_k, d];  v : [b, s_k, h_k, d_v]
    other options: see :func:`scores`.

    Returns
    -------
    out : float64 [b, s_q, h, d_v] (0 for a row that attends to nothing)
    lse : float64 [b, h, s_q], natural log (-inf for such a row); only when return_lse.
    """
    s = scores(q, k, scale=scale, causal=causal, causal_align=causal_align, window=window,
               bias=bias, mask=mask, softcap=softcap, alibi_slopes=alibi_slopes)
    h = s.shape[1]
    p, lse = _softmax_lse(s)                                    # [b, h, s_q, s_k], [b, h, s_q]
    vh = _expand_kv(_f64(v), h)                                 # [b, h, s_k, d_v]
    out = np.einsum("bhij,bhje->bihe", p, vh)                   # [b, s_q, h, d_v]
    return (out, lse) if return_lse else out


def _reduce_to(x, shape):
    """Sum x [b, h, s_q, s_k] down to a NumPy-broadcastable shape (the bias's own shape)."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


def attention_backward(dout, q, k, v, *, scale=None, causal=False, causal_align="bottom_right",
                       window=None, bias=None, mask=None, softcap=None, alibi_slopes=None,
                       out=None):
    """Closed-form gradients of :func:`attention` in float64.

    Parameters
    ----------
    dout : [b, s_q, h, d_v];  q : [b, s_q, h, d];  k : [b, s_k, h_k, d];  v : [b, s_k, h_k, d_v]
    out : [b, s_q, h, d_v] or None
        The forward output a backward is handed (e.g. a float16 one), shaped as dout. None: the
        exact O. Given, D = rowsum(dO ∘ out) uses it: the backward's formulas applied exactly to
        that output. The difference to the exact gradients is the error out's rounding puts into
        D; where one key dominates thousands of rows, a dbias element sums those rows' D errors
        (docs/hopper.md, "Where it stands"). (A bias constant along the keys still has exact
        dbias 0, which this formula does not give: the GPU tests use it as an allowance.)
    other options: see :func:`scores`.

    Returns
    -------
    dq : float64 [b, s_q, h, d];  dk : float64 [b, s_k, h_k, d];  dv : float64 [b, s_k, h_k, d_v]
        (dk, dv summed over the query heads of each kv group)
    dbias : float64 of bias's own shape, or None when bias is None.

    Math: P = softmax(s); dV = Pᵀ dO; dP = dO Vᵀ; dS = P ∘ (dP − rowsum(dO ∘ O));
    through softcap dS_raw = dS ∘ (1 − tanh²(s_raw / c)); dQ = scale · dS_raw K; dK = scale ·
    dS_rawᵀ Q; dbias = dS summed to the bias's shape. Rows attending to nothing get zeros.
    """
    q64, k64, v64, do = _f64(q), _f64(k), _f64(v), _f64(dout)
    b, s_q, h, d = q64.shape
    h_k = k64.shape[2]
    g = h // h_k
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    s, s_raw, _ = _parts(q64, k64, scale, causal, causal_align, window, bias, mask, softcap,
                         alibi_slopes)
    p, _ = _softmax_lse(s)                                      # [b, h, s_q, s_k]
    vh = _expand_kv(v64, h)                                     # [b, h, s_k, d_v]
    kh = _expand_kv(k64, h)                                     # [b, h, s_k, d]
    doh = do.transpose(0, 2, 1, 3)                              # [b, h, s_q, d_v]
    if out is None:
        o = np.einsum("bhij,bhje->bhie", p, vh)                 # [b, h, s_q, d_v]
    else:                                                       # the O the backward is given
        if np.shape(out) != np.shape(dout):
            raise ValueError(f"out: shape {np.shape(out)}, expected dout's {np.shape(dout)} "
                             "[b, s_q, h, d_v]")
        o = _f64(out).transpose(0, 2, 1, 3)
    dv_h = np.einsum("bhij,bhie->bhje", p, doh)                 # [b, h, s_k, d_v]
    dp = np.einsum("bhie,bhje->bhij", doh, vh)                  # dP = dO Vᵀ
    D = (doh * o).sum(-1, keepdims=True)                        # rowsum(dO ∘ O)
    ds = p * (dp - D)                                           # dS = P ∘ (dP − D)
    ds_raw = ds
    if softcap:
        t = np.tanh(s_raw / softcap)
        ds_raw = ds * (1.0 - t * t)                             # d/ds c·tanh(s/c) = 1 − tanh²
    dq = scale * np.einsum("bhij,bhjd->bihd", ds_raw, kh)       # [b, s_q, h, d]
    dk_h = scale * np.einsum("bhij,bihd->bhjd", ds_raw, q64)    # [b, h, s_k, d]
    # sum each kv group's query heads: [b, h_k, g, s_k, e] -> [b, s_k, h_k, e]
    dk = dk_h.reshape(b, h_k, g, *dk_h.shape[2:]).sum(2).transpose(0, 2, 1, 3)
    dv = dv_h.reshape(b, h_k, g, *dv_h.shape[2:]).sum(2).transpose(0, 2, 1, 3)
    dbias = None if bias is None else _reduce_to(ds, np.shape(bias))
    return dq, dk, dv, dbias
