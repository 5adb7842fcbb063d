"""NumPy implementation: the seed's blocked online-softmax attention, forward and backward.

This is what NumPy users get without a GPU, and what float64 inputs use. It is FlashAttention-2
written with NumPy: the outer loop walks query blocks, the inner loop walks key blocks, and each
step works on one score tile ``[b, h, block_q, block_k]`` vectorized over batch, heads and rows.
The full [s_q, s_k] score matrix is never formed, so memory is O(N · block), not O(N²).

Layout is "bshd" (see docs/internals.md):

- q    [b, s_q, h,   d]          any strides
- k    [b, s_k, h_k, d]          h % h_k == 0, query head i reads kv head i // (h // h_k)
- v    [b, s_k, h_k, d_v]
- out  [b, s_q, h,   d_v]
- lse  [b, h, s_q]               natural log, -inf for a row that attends to nothing

Dtypes: float64 inputs are computed in float64 and give float64 out and lse; float16, bfloat16
(ml_dtypes) and float32 are computed in float32 and give out in q's dtype and lse float32.
The backward returns dq, dk, dv in the dtypes of q, k, v, and dbias (reduced to
``opts.bias.shape``, accumulated in float64) in the bias's own dtype.

GQA is handled without repeating K/V: q is viewed as [b, h_k, g, s_q, d] and the g query heads
of a group are stacked as extra rows of one matmul against their shared K/V block.

The module also holds the seed's softmax algorithms on single rows (``softmax_three_pass``,
``softmax_online_two_pass``, ``softmax_one_pass_delayed``, ``logsumexp``).
"""
from __future__ import annotations

import numpy as np

from ._options import UNBOUNDED, Options

__all__ = [
    "forward",
    "backward",
    "softmax_three_pass",
    "softmax_online_two_pass",
    "softmax_one_pass_delayed",
    "logsumexp",
]

#: Elements of one score tile [b, h, block_q, block_k] the query blocking aims for: big enough
#: for the matmuls to run at BLAS speed, small enough for the tile to stay in cache.
_TILE_ELEMS = 1 << 19


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _compute_dtype(*arrays):
    """float64 when any input is float64, else float32."""
    return np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32


def _heads_major(x, h_k, cdt, scale=None):
    """bshd [b, s, h, e] -> contiguous [b, h_k, g, s, e] in the compute dtype (times scale)."""
    b, s, h, e = x.shape
    y = np.empty((b, h_k, h // h_k, s, e), dtype=cdt)
    src = x.reshape(b, s, h_k, h // h_k, e).transpose(0, 2, 3, 1, 4)
    y[...] = src                      # cast first: scaling in float16 / bfloat16 would round
    if scale is not None:
        y *= scale
    return y


def _tile(arr, i0, i1, j0, j1):
    """Slice the [.., .., s_q, s_k] tile of a 4-D broadcastable array (dims of size 1 kept)."""
    si = slice(i0, i1) if arr.shape[2] != 1 else slice(None)
    sj = slice(j0, j1) if arr.shape[3] != 1 else slice(None)
    return arr[:, :, si, sj]


def _key_range(opts, i0, i1, s_q, s_k):
    """Keys [lo, hi) some row of the query block [i0, i1) may keep under the window."""
    off = opts.diag_offset(s_q, s_k)
    lo, hi = 0, s_k
    if opts.window_left != UNBOUNDED:
        lo = max(lo, i0 + off - opts.window_left)
    if opts.window_right != UNBOUNDED:
        hi = min(hi, i1 - 1 + off + opts.window_right + 1)
    return lo, max(lo, hi)


def _block_q(b, h, s_q, block_k):
    """Query rows per block so one [b, h, block_q, block_k] tile holds about _TILE_ELEMS."""
    rows = _TILE_ELEMS // max(1, b * h * block_k)
    return int(min(max(s_q, 1), max(16, rows)))


def _scores_tile(qb, kb, opts, i0, i1, j0, j1, s_q, s_k, b, h, cdt):
    """Scores of one tile.

    qb [b, h_k, g*bq, d] (already times scale), kb [b, h_k, bk, d] ->
    (s [b, h, bq, bk] final scores with -inf where dropped, t = tanh(s_raw / softcap) or None).
    """
    bq, bk = i1 - i0, j1 - j0
    # S = (scale Q) Kᵀ  [b, h_k, g*bq, bk] viewed as [b, h, bq, bk]
    s = np.matmul(qb, kb.swapaxes(-1, -2)).reshape(b, h, bq, bk)
    t = None
    if opts.softcap:
        # S = c · tanh(S / c)
        t = np.multiply(s, 1.0 / opts.softcap, out=s)
        np.tanh(t, out=t)
        s = t * opts.softcap
    if opts.bias is not None:
        # S += bias tile (a broadcast view, never expanded)
        s += _tile(opts.bias, i0, i1, j0, j1).astype(cdt, copy=False)
    diag = np.arange(i0, i1)[:, None] + opts.diag_offset(s_q, s_k)        # [bq, 1]
    j = np.arange(j0, j1)[None, :]                                        # [1, bk]
    if opts.alibi_slopes is not None:
        # S -= slope[b, h] · |diag − j|
        slopes = np.asarray(opts.alibi_slopes, dtype=cdt).reshape(-1, h)[:, :, None, None]
        s -= slopes * np.abs(diag - j).astype(cdt)
    # masks: the window / causal band (only where it cuts this tile), then the bool mask
    keep = None
    if opts.window_left != UNBOUNDED:
        band = j >= diag - opts.window_left                                 # [bq, bk]
        keep = None if band.all() else band
    if opts.window_right != UNBOUNDED:
        band = j <= diag + opts.window_right                                # [bq, bk]
        if not band.all():
            keep = band if keep is None else keep & band
    if opts.mask is not None:
        m = _tile(opts.mask, i0, i1, j0, j1)
        keep = m if keep is None else keep & m
    if keep is not None:
        np.copyto(s, -np.inf, where=~keep)
    return s, t


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def forward(q, k, v, opts: Options, *, block_k=128):
    """Blocked online-softmax attention.

    Parameters
    ----------
    q : [b, s_q, h, d];  k : [b, s_k, h_k, d];  v : [b, s_k, h_k, d_v]   NumPy, any strides
    opts : Options (scale, window, alignment, softcap, alibi [b|1, h], bias / mask 4-D)
    block_k : keys per block of the inner loop.

    Returns
    -------
    out : [b, s_q, h, d_v] in q's dtype (float64 for float64 inputs)
    lse : [b, h, s_q] float32 (float64 for float64 inputs); -inf for rows attending to nothing.
    """
    b, s_q, h, d = q.shape
    s_k, h_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_k if h_k else 1
    cdt = _compute_dtype(q, k, v)
    block_k = max(1, int(block_k))
    out = np.zeros((b, s_q, h, d_v), dtype=q.dtype)
    lse = np.full((b, h, s_q), -np.inf, dtype=cdt)
    if b == 0 or h == 0 or s_q == 0:
        return out, lse

    qh = _heads_major(q, h_k, cdt, opts.scale)                  # [b, h_k, g, s_q, d]  (· scale)
    kh = _heads_major(k, h_k, cdt)[:, :, 0]                      # [b, h_k, s_k, d]
    vh = _heads_major(v, h_k, cdt)[:, :, 0]                      # [b, h_k, s_k, d_v]
    block_q = _block_q(b, h, s_q, block_k)

    for i0 in range(0, s_q, block_q):
        i1 = min(s_q, i0 + block_q)
        bq = i1 - i0
        qb = qh[:, :, :, i0:i1].reshape(b, h_k, g * bq, d)      # [b, h_k, g*bq, d]
        m = np.full((b, h, bq, 1), -np.inf, dtype=cdt)           # running max
        l = np.zeros((b, h, bq, 1), dtype=cdt)                   # running denominator
        acc = np.zeros((b, h_k, g * bq, d_v), dtype=cdt)          # unnormalized O
        acc4 = acc.reshape(b, h, bq, d_v)
        lo, hi = _key_range(opts, i0, i1, s_q, s_k)               # skip tiles the window drops
        for j0 in range(lo, hi, block_k):
            j1 = min(hi, j0 + block_k)
            s, _ = _scores_tile(qb, kh[:, :, j0:j1], opts, i0, i1, j0, j1, s_q, s_k, b, h, cdt)
            # running max m_new = max(m, rowmax(S)); rows still all -inf use 0 to avoid inf − inf
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = np.where(m_new == -np.inf, 0.0, m_new).astype(cdt, copy=False)
            # P = exp(S − m_new)  (in place on the tile)
            s -= m_safe
            p = np.exp(s, out=s)
            # rescale factor alpha = exp(m_old − m_new) for l and O
            alpha = np.exp(m - m_safe)
            # l = alpha · l + rowsum(P)
            l *= alpha
            l += p.sum(axis=-1, keepdims=True)
            # O = alpha · O + P V   (the g heads of a group share one V block)
            acc4 *= alpha
            acc += np.matmul(p.reshape(b, h_k, g * bq, j1 - j0), vh[:, :, j0:j1])
            m = m_new
        # final O / l (once), 0 and lse = −inf where nothing was attended
        with np.errstate(divide="ignore", invalid="ignore"):
            empty = l == 0
            l_safe = np.where(empty, 1.0, l).astype(cdt, copy=False)
            o = np.where(empty, 0.0, acc4 / l_safe)              # [b, h, bq, d_v]
            m_fin = np.where(m == -np.inf, 0.0, m)
            lse_b = np.where(empty, -np.inf, m_fin + np.log(l_safe))
        out[:, i0:i1] = o.transpose(0, 2, 1, 3)                   # -> [b, bq, h, d_v]
        lse[:, :, i0:i1] = lse_b[..., 0]
    return out, lse


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------

def backward(dout, q, k, v, out, lse, opts: Options, *, block_k=128):
    """Gradients of :func:`forward`, recomputing P per tile from q, k and lse (P never stored).

    Parameters
    ----------
    dout : [b, s_q, h, d_v];  q : [b, s_q, h, d];  k : [b, s_k, h_k, d];  v : [b, s_k, h_k, d_v]
    out : [b, s_q, h, d_v], lse : [b, h, s_q]   as returned by :func:`forward`
    opts : Options;  block_k : keys per block.

    Returns
    -------
    dq : [b, s_q, h, d] in q's dtype;  dk : [b, s_k, h_k, d] in k's dtype (summed over the
    query heads of each kv group);  dv : [b, s_k, h_k, d_v] in v's dtype;
    dbias : ``opts.bias.shape`` in the bias's dtype (accumulated in float64), or None when
    opts.bias is None.

    Math per tile: P = exp(S − lse); dV += Pᵀ dO; dP = dO Vᵀ; dS = P ∘ (dP − D) with
    D = rowsum(dO ∘ O); through softcap dS_raw = dS ∘ (1 − tanh²); dQ += scale · dS_raw K;
    dK += dS_raw ᵀ (scale · Q); dbias += dS summed over the bias's broadcast dims.
    """
    b, s_q, h, d = q.shape
    s_k, h_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_k if h_k else 1
    cdt = _compute_dtype(q, k, v)
    block_k = max(1, int(block_k))
    dq_h = np.zeros((b, h_k, g * s_q, d), dtype=cdt)             # [b, h_k, g*s_q, d]
    dk_h = np.zeros((b, h_k, s_k, d), dtype=cdt)                 # [b, h_k, s_k, d]
    dv_h = np.zeros((b, h_k, s_k, d_v), dtype=cdt)               # [b, h_k, s_k, d_v]
    # dbias sums many tiles' dS (all of them for a scalar bias): accumulate in float64
    dbias = None if opts.bias is None else np.zeros(opts.bias.shape, dtype=np.float64)

    if b and h and s_q and s_k:
        qh = _heads_major(q, h_k, cdt, opts.scale)               # [b, h_k, g, s_q, d]  (· scale)
        kh = _heads_major(k, h_k, cdt)[:, :, 0]                   # [b, h_k, s_k, d]
        vh = _heads_major(v, h_k, cdt)[:, :, 0]                   # [b, h_k, s_k, d_v]
        doh = _heads_major(dout, h_k, cdt)                        # [b, h_k, g, s_q, d_v]
        oh = _heads_major(out, h_k, cdt)                          # [b, h_k, g, s_q, d_v]
        # D = rowsum(dO ∘ O)  [b, h, s_q, 1]
        D = (doh * oh).sum(axis=-1).reshape(b, h, s_q, 1)
        # lse = −inf rows attend to nothing: +inf makes their P = exp(S − lse) exactly 0
        lse_c = np.asarray(lse, dtype=cdt).reshape(b, h, s_q, 1)
        lse_c = np.where(lse_c == -np.inf, np.inf, lse_c)
        dq5 = dq_h.reshape(b, h_k, g, s_q, d)
        block_q = _block_q(b, h, s_q, block_k)
        for i0 in range(0, s_q, block_q):
            i1 = min(s_q, i0 + block_q)
            bq = i1 - i0
            qb = qh[:, :, :, i0:i1].reshape(b, h_k, g * bq, d)
            dob = doh[:, :, :, i0:i1].reshape(b, h_k, g * bq, d_v)
            dqb = np.zeros((b, h_k, g * bq, d), dtype=cdt)
            lo, hi = _key_range(opts, i0, i1, s_q, s_k)
            for j0 in range(lo, hi, block_k):
                j1 = min(hi, j0 + block_k)
                bk = j1 - j0
                s, t = _scores_tile(qb, kh[:, :, j0:j1], opts, i0, i1, j0, j1, s_q, s_k, b, h, cdt)
                # P = exp(S − lse)  [b, h, bq, bk]
                s -= lse_c[:, :, i0:i1]
                p = np.exp(s, out=s)
                p3 = p.reshape(b, h_k, g * bq, bk)
                # dV += Pᵀ dO  (sums the g query heads of each group)
                dv_h[:, :, j0:j1] += np.matmul(p3.swapaxes(-1, -2), dob)
                # dP = dO Vᵀ
                dp = np.matmul(dob, vh[:, :, j0:j1].swapaxes(-1, -2)).reshape(b, h, bq, bk)
                # dS = P ∘ (dP − D)
                dp -= D[:, :, i0:i1]
                ds = np.multiply(p, dp, out=dp)
                if dbias is not None:
                    # dbias += dS summed over the bias's broadcast dims
                    red = tuple(a for a in range(4) if opts.bias.shape[a] == 1 and ds.shape[a] != 1)
                    _tile(dbias, i0, i1, j0, j1)[...] += (
                        ds.sum(axis=red, keepdims=True, dtype=np.float64) if red else ds)
                if t is not None:
                    # through softcap: d/ds c·tanh(s/c) = 1 − tanh²(s/c)
                    ds = ds * (1.0 - t * t)
                ds3 = ds.reshape(b, h_k, g * bq, bk)
                # dQ += dS K   (scale applied once at the end)
                dqb += np.matmul(ds3, kh[:, :, j0:j1])
                # dK += dSᵀ (scale · Q)
                dk_h[:, :, j0:j1] += np.matmul(ds3.swapaxes(-1, -2), qb)
            dq5[:, :, :, i0:i1] = dqb.reshape(b, h_k, g, bq, d)
        dq_h *= opts.scale

    # back to bshd in the input dtypes
    dq = dq_h.reshape(b, h_k, g, s_q, d).transpose(0, 3, 1, 2, 4).reshape(b, s_q, h, d)
    dk = dk_h.transpose(0, 2, 1, 3)
    dv = dv_h.transpose(0, 2, 1, 3)
    dq, dk, dv = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    if dbias is not None:
        dbias = dbias.astype(opts.bias.dtype)
    return dq, dk, dv, dbias


# ----------------------------------------------------------------------------------------------
# the seed's softmax algorithms on single rows (last axis), vectorized over leading axes
# ----------------------------------------------------------------------------------------------

def logsumexp(x, axis=-1):
    """Stable log(sum(exp(x))) over ``axis``; −inf for a row of all −inf (or an empty row).

    x : [..., n] -> [...]
    """
    x = np.asarray(x)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)                      # no (−inf) − (−inf)
    with np.errstate(divide="ignore"):
        r = np.log(np.sum(np.exp(x - m_safe), axis=axis, keepdims=True)) + m_safe
    return np.squeeze(r, axis=axis)


def softmax_three_pass(x, axis=-1):
    """Safe softmax in three passes: m = max(x); l = Σ exp(x − m); y = exp(x − m) / l.

    x : [..., n] -> [..., n]. A row of all −inf gives zeros (not NaN).
    """
    x = np.asarray(x)
    # pass 1: row max
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    # pass 2: denominator
    e = np.exp(x - m)
    l = np.sum(e, axis=axis, keepdims=True)
    # pass 3: normalize
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(l == 0, 0.0, e / np.where(l == 0, 1, l))


def softmax_online_two_pass(x):
    """Online softmax (Milakov & Gimelshein): one pass keeps a running max m and a denominator
    l rescaled whenever m grows, l = l · exp(m_old − m_new) + exp(x_j − m_new); a second pass
    normalizes y = exp(x − m) / l.

    x : [..., n] -> [..., n] (last axis). A row of all −inf gives zeros.
    """
    x = np.asarray(x)
    shape = x.shape[:-1]
    m = np.full(shape, -np.inf, dtype=x.dtype)
    l = np.zeros(shape, dtype=x.dtype)
    # pass 1: running max and rescaled denominator
    for j in range(x.shape[-1]):
        xj = x[..., j]
        m_new = np.maximum(m, xj)
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
        l = l * np.exp(m - m_safe) + np.exp(xj - m_safe)
        m = m_new
    # pass 2: normalize
    m_safe = np.where(np.isneginf(m), 0.0, m)[..., None]
    l = l[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(l == 0, 0.0, np.exp(x - m_safe) / np.where(l == 0, 1, l))


def softmax_one_pass_delayed(x, values):
    """Σ_j softmax(x)_j · values_j in one pass, normalizing once at the end.

    Running max m, denominator l and unnormalized accumulator a; for each j:
    m_new = max(m, x_j); c = exp(m − m_new); l = c·l + exp(x_j − m_new);
    a = c·a + exp(x_j − m_new)·values_j; finally a / l (0 for a row of all −inf).

    x : [..., n];  values : [..., n] or [..., n, e]  ->  [...] or [..., e]
    """
    x = np.asarray(x)
    values = np.asarray(values)
    vec = values.ndim == x.ndim + 1
    dt = np.result_type(x, values)
    shape = x.shape[:-1]
    m = np.full(shape, -np.inf, dtype=dt)
    l = np.zeros(shape, dtype=dt)
    a = np.zeros(shape + ((values.shape[-1],) if vec else ()), dtype=dt)
    for j in range(x.shape[-1]):
        xj = x[..., j]
        # running max and the rescale factor for l and a
        m_new = np.maximum(m, xj)
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
        c = np.exp(m - m_safe)
        pj = np.exp(xj - m_safe)
        l = c * l + pj
        vj = values[..., j, :] if vec else values[..., j]
        a = (c[..., None] * a + pj[..., None] * vj) if vec else (c * a + pj * vj)
        m = m_new
    # one final division
    ll = l[..., None] if vec else l
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ll == 0, 0.0, a / np.where(ll == 0, 1, ll))
