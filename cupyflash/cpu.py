"""NumPy implementation: the seed's blocked online-softmax attention, forward and backward.

This is what NumPy users get without a GPU (and device="cpu" calls). It is FlashAttention-2
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

Threads: a call large enough (b·h·s_q·s_k >= 2^15 scores) is cut into (batch, kv head) blocks
(and query-row ranges in the forward when there are fewer blocks than threads) run by a pool of
``num_threads()`` threads (``CUPYFLASH_CPU_THREADS``, default the cores this process may use
plus up to four: see ``num_threads``),
with BLAS limited to one thread for the duration of the call (threadpoolctl; the limit is
process-wide, so BLAS calls of other threads meanwhile run single-threaded too). A given thread
count gives the same result on every run (blocks that share a broadcast bias add their dbias in a
fixed order); another thread count agrees to rounding.

GQA is handled without repeating K/V: q is viewed as [b, h_k, g, s_q, d] and the g query heads
of a group are stacked as extra rows of one matmul against their shared K/V block.

The module also holds the seed's softmax algorithms on single rows (``softmax_three_pass``,
``softmax_online_two_pass``, ``softmax_one_pass_delayed``, ``logsumexp``).
"""
from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from ._options import UNBOUNDED, Options

__all__ = [
    "forward",
    "backward",
    "softmax_three_pass",
    "softmax_online_two_pass",
    "softmax_one_pass_delayed",
    "logsumexp",
    "num_threads",
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
# threading: parallel over (batch, kv head) blocks, BLAS single-threaded inside them
# ----------------------------------------------------------------------------------------------
#
# Each tile's matmuls are small ([g·block_q, d] x [d, block_k]). Left to itself the BLAS library
# (OpenBLAS in NumPy's wheels) splits every one of them over all cores, and its threads
# spin-wait for each other between calls: on a loaded machine one descheduled thread stalls
# every product. Instead the work is split into independent (batch, kv-head[, query-row])
# blocks run by a pool of ``num_threads()`` Python threads (NumPy releases the GIL inside matmul
# and ufunc loops), with BLAS limited to one thread for the duration of the call
# (threadpoolctl). A busy core then slows one block, not every product. The pool has spare
# threads (``num_threads``) so that a fair scheduler leaves the call more than its share of
# contended cores.

#: Score elements (b · h · s_q · s_k) under which a call runs on the calling thread (the pool's
#: hand-off, about 1 ms on 2 cores, would cost more than it saves).
_PARALLEL_MIN_SCORES = 1 << 15
#: m·n·k under which OpenBLAS runs a product on one thread (SMP_THRESHOLD_MIN 65536 times
#: GEMM_MULTITHREAD_THRESHOLD 4): a call whose products are all smaller leaves BLAS untouched.
_BLAS_THREADED_MNK = 65536 * 4

_pool = None
_pool_size = 0
_pool_lock = threading.Lock()
_limit_lock = threading.Lock()
_limit_depth = 0
_limit_ctx = None
_controller = None


def num_threads() -> int:
    """Threads the CPU implementation uses: ``CUPYFLASH_CPU_THREADS`` when set (>= 1), else the
    cores this process may run on plus as many again, at most four more (2 cores: 4 threads).

    The spare threads are for shared machines: a fair scheduler gives every runnable thread an
    equal share, so beside two busy processes on 2 cores, 2 threads get half the cores (2x
    slower) and 4 threads two thirds (1.5x). Measured on a 2-core machine (1x4096x8x64 float32,
    lab/cpu_contention.py, medians of 5), slowdown beside two busy loops / one BLAS process:
    4 threads 1.53x / 1.65x, 2 threads 1.88x / 1.76x, textbook NumPy 1.72x / 1.68x; quiet,
    4 threads took 1278 ms and 2 threads 1536 ms."""
    env = os.environ.get("CUPYFLASH_CPU_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"CUPYFLASH_CPU_THREADS: got {env!r}; accepted: an int >= 1") from None
        if n < 1:
            raise ValueError(f"CUPYFLASH_CPU_THREADS: got {env!r}; accepted: an int >= 1")
        return n
    return _cores() + min(_cores(), 4)


def _cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _executor(n):
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="cupyflash-cpu")
            _pool_size = n
        return _pool


@contextmanager
def _blas_one_thread():
    """BLAS limited to one thread while any call of this module is inside (re-entrant across
    threads: the first call in sets the limit, the last one out restores it). Without
    threadpoolctl the BLAS settings are left as they are."""
    global _limit_depth, _limit_ctx, _controller
    with _limit_lock:
        if _limit_depth == 0:
            try:
                if _controller is None:
                    import threadpoolctl

                    _controller = threadpoolctl.ThreadpoolController()
                _limit_ctx = _controller.limit(limits=1, user_api="blas")
            except ImportError:
                _limit_ctx = None
        _limit_depth += 1
    try:
        yield
    finally:
        with _limit_lock:
            _limit_depth -= 1
            if _limit_depth == 0 and _limit_ctx is not None:
                _limit_ctx.restore_original_limits()
                _limit_ctx = None


def _run_blocks(fn, items, threads):
    """``[fn(item) for item in items]`` with BLAS single-threaded, on a pool of ``threads``
    threads (inline for one); ``threads=0`` runs inline with the BLAS settings untouched (small
    problems). Exceptions propagate."""
    if threads == 0:
        return [fn(item) for item in items]
    threads = min(threads, len(items))
    with _blas_one_thread():
        if threads <= 1:
            return [fn(item) for item in items]
        return list(_executor(threads).map(fn, items))


def _split(n, parts):
    """[lo, hi) ranges cutting range(n) into at most ``parts`` near-equal pieces."""
    parts = max(1, min(n, parts))
    edges = [n * i // parts for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts) if edges[i] < edges[i + 1]]


def _plan_threads(b, h, h_k, s_q, s_k, d, block_k, threads):
    """Threads for a call: ``threads`` when given; else for a small problem 0 (inline, BLAS
    untouched) when BLAS would run each product on one thread anyway, or 1 (inline, BLAS limited
    to one thread: threaded BLAS on small products is what collapses on shared cores); else
    :func:`num_threads`."""
    if threads is not None:
        return max(1, int(threads))
    if b * h * s_q * s_k < _PARALLEL_MIN_SCORES:
        rows = (h // max(h_k, 1)) * _block_q(b, h, s_q, block_k)
        mnk = rows * min(s_k, block_k) * d
        return 0 if mnk < _BLAS_THREADED_MNK else 1
    return num_threads()


def _blocks(b, h_k, s_q, threads, split_rows):
    """Work items ((b0, b1), (k0, k1), (r0, r1)): one per (batch, kv head) pair (merged when there
    are many more than 4 per thread); query rows split as well (forward only) when there are
    fewer pairs than threads."""
    if threads <= 1:
        return [((0, b), (0, h_k), (0, s_q))]
    pairs = [(bi, hi) for bi in range(b) for hi in range(h_k)]
    groups = _split(len(pairs), 4 * threads)
    items = []
    for lo, hi in groups:
        # a group of consecutive pairs: one batch row range when it spans whole batches,
        # else one (batch, head range) per batch touched
        sel = pairs[lo:hi]
        by_b = {}
        for bi, hk in sel:
            by_b.setdefault(bi, []).append(hk)
        whole = all(len(v) == h_k for v in by_b.values())
        if whole:
            bs = sorted(by_b)
            items.append(((bs[0], bs[-1] + 1), (0, h_k), (0, s_q)))
        else:
            for bi, hks in by_b.items():
                items.append(((bi, bi + 1), (hks[0], hks[-1] + 1), (0, s_q)))
    if split_rows and len(items) < threads:
        per = -(-threads // len(items))
        items = [(bb, kk, rr) for bb, kk, _ in items for rr in _split(s_q, per)]
    return items


def _slice_bh(x, b0, b1, h0, h1):
    """A [b|1, h|1, ...] array (bias, mask, ALiBi slopes) sliced to batches b0:b1, heads h0:h1
    (a dimension of size 1 is kept: it broadcasts)."""
    if x is None:
        return None
    sb = slice(b0, b1) if x.shape[0] != 1 else slice(None)
    sh = slice(h0, h1) if x.shape[1] != 1 else slice(None)
    return x[sb, sh]


def _block_opts(opts, b0, b1, h0, h1):
    if opts.bias is None and opts.mask is None and opts.alibi_slopes is None:
        return opts
    slopes = opts.alibi_slopes
    if slopes is not None:
        slopes = np.asarray(slopes)
        slopes = slopes[slice(b0, b1) if slopes.shape[0] != 1 else slice(None), h0:h1]
    return dataclasses.replace(opts, bias=_slice_bh(opts.bias, b0, b1, h0, h1),
                               mask=_slice_bh(opts.mask, b0, b1, h0, h1), alibi_slopes=slopes)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

def forward(q, k, v, opts: Options, *, block_k=128, threads=None):
    """Blocked online-softmax attention.

    Parameters
    ----------
    q : [b, s_q, h, d];  k : [b, s_k, h_k, d];  v : [b, s_k, h_k, d_v]   NumPy, any strides
    opts : Options (scale, window, alignment, softcap, alibi [b|1, h], bias / mask 4-D)
    block_k : keys per block of the inner loop.
    threads : threads to use (None: :func:`num_threads`); the work is split over (batch,
        kv head) blocks, and over query rows when there are fewer blocks than threads.

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
    threads = _plan_threads(b, h, h_k, s_q, s_k, max(d, d_v), block_k, threads)

    def run(item):
        (b0, b1), (k0, k1), (r0, r1) = item
        hq = slice(k0 * g, k1 * g)
        _forward_block(q[b0:b1, :, hq], k[b0:b1, :, k0:k1], v[b0:b1, :, k0:k1],
                       _block_opts(opts, b0, b1, k0 * g, k1 * g), out[b0:b1, :, hq],
                       lse[b0:b1, hq], r0, r1, block_k, cdt)

    _run_blocks(run, _blocks(b, h_k, s_q, threads, split_rows=True), threads)
    return out, lse


def _forward_block(q, k, v, opts, out, lse, r0, r1, block_k, cdt):
    """Rows [r0, r1) of one block's forward, written into the views ``out`` and ``lse``."""
    b, s_q, h, d = q.shape
    s_k, h_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_k
    qh = _heads_major(q[:, r0:r1], h_k, cdt, opts.scale)        # [b, h_k, g, r1-r0, d]  (· scale)
    kh = _heads_major(k, h_k, cdt)[:, :, 0]                      # [b, h_k, s_k, d]
    vh = _heads_major(v, h_k, cdt)[:, :, 0]                      # [b, h_k, s_k, d_v]
    block_q = _block_q(b, h, r1 - r0, block_k)

    for i0 in range(r0, r1, block_q):
        i1 = min(r1, i0 + block_q)
        bq = i1 - i0
        qb = qh[:, :, :, i0 - r0:i1 - r0].reshape(b, h_k, g * bq, d)   # [b, h_k, g*bq, d]
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


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------

def backward(dout, q, k, v, out, lse, opts: Options, *, block_k=128, threads=None):
    """Gradients of :func:`forward`, recomputing P per tile from q, k and lse (P never stored).

    Parameters
    ----------
    dout : [b, s_q, h, d_v];  q : [b, s_q, h, d];  k : [b, s_k, h_k, d];  v : [b, s_k, h_k, d_v]
    out : [b, s_q, h, d_v], lse : [b, h, s_q]   as returned by :func:`forward`
    opts : Options;  block_k : keys per block.
    threads : threads to use (None: :func:`num_threads`); the work is split over (batch,
        kv head) blocks, each owning its rows of dq, dk and dv.

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
    dq = np.zeros(q.shape, dtype=q.dtype)
    dk = np.zeros(k.shape, dtype=k.dtype)
    dv = np.zeros(v.shape, dtype=v.dtype)
    # dbias sums many tiles' dS (all of them for a scalar bias): accumulate in float64
    dbias = None if opts.bias is None else np.zeros(opts.bias.shape, dtype=np.float64)

    if b and h and s_q and s_k:
        threads = _plan_threads(b, h, h_k, s_q, s_k, max(d, d_v), block_k, threads)

        def run(item):
            (b0, b1), (k0, k1), _ = item
            hq = slice(k0 * g, k1 * g)
            return _backward_block(
                dout[b0:b1, :, hq], q[b0:b1, :, hq], k[b0:b1, :, k0:k1], v[b0:b1, :, k0:k1],
                out[b0:b1, :, hq], lse[b0:b1, hq], _block_opts(opts, b0, b1, k0 * g, k1 * g),
                dq[b0:b1, :, hq], dk[b0:b1, :, k0:k1], dv[b0:b1, :, k0:k1], block_k, cdt)

        items = _blocks(b, h_k, s_q, threads, split_rows=False)
        parts = _run_blocks(run, items, threads)
        if dbias is not None:
            # blocks that share a broadcast bias dimension add into one place: in item order
            for ((b0, b1), (k0, k1), _), part in zip(items, parts):
                _slice_bh(dbias, b0, b1, k0 * g, k1 * g)[...] += part
    if dbias is not None:
        dbias = dbias.astype(opts.bias.dtype)
    return dq, dk, dv, dbias


def _backward_block(dout, q, k, v, out, lse, opts, dq, dk, dv, block_k, cdt):
    """One block's gradients written into the views dq, dk, dv; returns its dbias (float64, the
    shape of its slice of the bias) or None."""
    b, s_q, h, d = q.shape
    s_k, h_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_k
    dq_h = np.zeros((b, h_k, g * s_q, d), dtype=cdt)             # [b, h_k, g*s_q, d]
    dk_h = np.zeros((b, h_k, s_k, d), dtype=cdt)                 # [b, h_k, s_k, d]
    dv_h = np.zeros((b, h_k, s_k, d_v), dtype=cdt)               # [b, h_k, s_k, d_v]
    dbias = None if opts.bias is None else np.zeros(opts.bias.shape, dtype=np.float64)

    qh = _heads_major(q, h_k, cdt, opts.scale)                   # [b, h_k, g, s_q, d]  (· scale)
    kh = _heads_major(k, h_k, cdt)[:, :, 0]                       # [b, h_k, s_k, d]
    vh = _heads_major(v, h_k, cdt)[:, :, 0]                       # [b, h_k, s_k, d_v]
    doh = _heads_major(dout, h_k, cdt)                            # [b, h_k, g, s_q, d_v]
    oh = _heads_major(out, h_k, cdt)                              # [b, h_k, g, s_q, d_v]
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

    # back to bshd in the output dtypes
    dq[...] = dq_h.reshape(b, h_k, g, s_q, d).transpose(0, 3, 1, 2, 4).reshape(b, s_q, h, d)
    dk[...] = dk_h.transpose(0, 2, 1, 3)
    dv[...] = dv_h.transpose(0, 2, 1, 3)
    return dbias


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
