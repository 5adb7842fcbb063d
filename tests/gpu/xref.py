"""Extended-precision attention (forward and gradients) for the float64 GPU tests.

Every elementwise step (scale, softcap tanh, bias, ALiBi, max, exp, sums, log, the softmax
gradient) is numpy.longdouble (x86: a 64-bit significand, 2^-64 relative). The matrix products
are exact splittings run as float64 matmuls (Ozaki's scheme): each operand row (A) or column (B)
is cut into SLICES pieces of at most 2^BETA times a power of two 2^(e_row - BETA·(s + 1)); a
product of two pieces summed over k <= 2^(53 - 2·BETA) terms is then an integer of at most
2^53, exact in float64 whatever the order of the sums (cuBLAS / BLAS DGEMM). A longdouble operand (P, dS) is first written as float64 hi + lo. A product is then
exact to about 2^-78 of max|A_row|·max|B_col| per term, below longdouble's own rounding of the
result; k (head dim, or the sequence for P V, dS K, ...) may be up to MAX_K = 4096.

``xp``: the module running the float64 matmuls (cupy on the device, numpy elsewhere; both exact).
"""
from __future__ import annotations

import numpy as np

LD = np.longdouble
BETA = 20
SLICES = 4                         # 80 bits below the row maximum: float64 rows split exactly
MAX_K = 2 ** (52 - 2 * BETA - 1)   # 4096: below the 2^(53 - 2·BETA) terms that stay exact


def _split(x, axis, xp):
    """Pieces p_0 .. p_3 (float64, module ``xp``) of float64 ``x`` with x = Σ p_s to within
    2^(e - 80): along ``axis`` (the contracted one) each row shares e = ceil(log2 max|x|), and
    p_s is an integer of magnitude at most 2^BETA times 2^(e - BETA·(s + 1))."""
    amax = xp.max(xp.abs(x), axis=axis, keepdims=True)
    e = xp.ceil(xp.log2(xp.where(amax > 0, amax, 1.0)))
    rest = x
    pieces = []
    for s in range(SLICES):
        unit = xp.ldexp(1.0, (e - BETA * (s + 1)).astype(xp.int32))
        p = xp.trunc(rest / unit) * unit      # exact: power-of-two scaling, truncation
        rest = rest - p                       # exact
        pieces.append(p)
    return pieces


def _hi_lo(x):
    """longdouble (or float64) ``x`` as float64 hi + lo (exact for a 64-bit significand)."""
    hi = np.asarray(x, np.float64)
    if np.asarray(x).dtype != LD:
        return hi, None
    lo = np.asarray(x - hi.astype(LD), np.float64)
    return hi, (lo if lo.any() else None)


def matmul(a, b, xp=np):
    """a [..., m, k] @ b [..., k, n] of longdouble (or float64) NumPy arrays, in longdouble.

    a = a_hi + a_lo and b = b_hi + b_lo in float64; a_hi b_hi + a_hi b_lo + a_lo b_hi as sums of
    exact piece products (a_lo b_lo, below 2^-106 of the result, is left out). The leading piece
    product is returned in longdouble plus the sum of the others, made in float64 (their
    rounding is 2^-53 of terms already 2^-20 below the result)."""
    k = a.shape[-1]
    assert k <= MAX_K, f"contracted length {k} > {MAX_K}: the piece products would round"
    (ahi, alo), (bhi, blo) = _hi_lo(a), _hi_lo(b)
    dev = (lambda t: t) if xp is np else xp.asarray
    host = (lambda t: t) if xp is np else xp.asnumpy
    pa = [_split(dev(x), -1, xp) if x is not None else None for x in (ahi, alo)]
    pb = [_split(dev(x), -2, xp) if x is not None else None for x in (bhi, blo)]
    lead = rest = None
    for ia, ib in ((0, 0), (0, 1), (1, 0)):   # hi·hi, hi·lo, lo·hi
        if pa[ia] is None or pb[ib] is None:
            continue
        for i in range(SLICES):
            for j in range(SLICES - i):
                c = xp.matmul(pa[ia][i], pb[ib][j])
                if (ia, ib, i, j) == (0, 0, 0, 0):
                    lead = c
                else:
                    rest = c if rest is None else rest + c
    out = host(lead).astype(LD)
    if rest is not None:
        out += host(rest).astype(LD)
    return out


def attention(q, k, v, do=None, *, scale, keep=None, bias=None, softcap=0.0, slopes=None,
              diag=None, xp=np):
    """Attention and its gradients in longdouble (docs/semantics.md §2 order).

    q [b, s_q, h, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v], do [b, s_q, h, d_v] or None:
    float64 NumPy arrays (bshd). keep: bool broadcastable to [b, h, s_q, s_k] (window, causal,
    mask) or None; bias: float array broadcastable to [b, h, s_q, s_k] (4-D) or None; slopes
    [b or 1, h] with diag [s_q] (ALiBi). Returns (out [b, s_q, h, d_v], lse [b, h, s_q]) without
    do, else (out, lse, dq, dk, dv, dbias) with dbias in bias's 4-D shape (None without a bias).
    Rows that keep no key: out 0, lse -inf, zero gradients."""
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    grp = h // h_k
    idx = np.arange(h) // grp
    qt = q.transpose(0, 2, 1, 3).astype(LD)                    # [b, h, s_q, d]
    kt = k.transpose(0, 2, 1, 3)[:, idx].astype(LD)            # [b, h, s_k, d]
    vt = v.transpose(0, 2, 1, 3)[:, idx].astype(LD)            # [b, h, s_k, d_v]
    sc = LD(scale)
    raw = matmul(qt, kt.swapaxes(-1, -2), xp) * sc             # scale · q kᵀ
    if softcap:
        cap = LD(softcap)
        th = np.tanh(raw / cap)
        s = cap * th
    else:
        s = raw.copy()
    if bias is not None:
        s = s + np.asarray(bias).astype(LD)
    if slopes is not None:
        dist = np.abs(np.asarray(diag)[:, None] - np.arange(s_k)[None, :]).astype(LD)
        s = s - np.asarray(slopes).astype(LD)[:, :, None, None] * dist
    if keep is not None:
        s = np.where(np.asarray(keep), s, LD(-np.inf))
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, LD(0))
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    live = l > 0
    lse = np.where(live[..., 0], np.log(np.where(live, l, 1))[..., 0] + m[..., 0], LD(-np.inf))
    p = np.where(live, e / np.where(live, l, 1), LD(0))
    o = matmul(p, vt, xp)                                      # [b, h, s_q, d_v]
    out = o.transpose(0, 2, 1, 3)
    if do is None:
        return out, lse
    dot = do.transpose(0, 2, 1, 3).astype(LD)
    dp = matmul(dot, vt.swapaxes(-1, -2), xp)
    dsum = (dot * o).sum(-1, keepdims=True)
    ds = p * (dp - dsum)                                       # d loss / d score
    dbias = None
    if bias is not None:
        bshape = np.shape(bias)
        red = tuple(a for a in range(4) if bshape[a] == 1 and ds.shape[a] != 1)
        dbias = ds.sum(axis=red, keepdims=True) if red else ds
    if softcap:
        ds = ds * (1 - th * th)
    dq = matmul(ds, kt, xp) * sc
    dk = matmul(ds.swapaxes(-1, -2), qt, xp) * sc
    dv = matmul(p.swapaxes(-1, -2), dot, xp)
    dk = dk.reshape(b, h_k, grp, s_k, d).sum(2)
    dv = dv.reshape(b, h_k, grp, s_k, -1).sum(2)
    return (out, lse, dq.transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3),
            dv.transpose(0, 2, 1, 3), dbias)
