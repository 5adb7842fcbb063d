"""NumPy implementation of ``attention_with_kvcache`` (docs/kvcache.md): the new rows written into
the cache in place (k rotated), q rotated, then each batch entry's keys gathered and attended by
``cpu.forward`` (the blocked online-softmax implementation).

Arrays (validated by cupyflash/kvcache.py):

- q        [b, s_q, h, d]
- k_cache  [b, seqlen_cache, h_k, d] (contiguous) or [num_blocks, page, h_k, d] (paged)
- k, v     [b, s_new, h_k, d] or None
- lens     int64 [b]: keys in the cache before the append
- block_table  [b, max_blocks] integers or None
- rot      (cos, sin [seqlen_ro, rd / 2], interleaved, q_per_row) or None

Rotation is computed in the compute dtype (float32; float64 for float64 inputs): the new keys are
rounded once into the cache's dtype, the rotated q stays in the compute dtype.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import cpu

__all__ = ["apply_rotary", "append", "gather", "forward"]


def apply_rotary(x, cos, sin, interleaved):
    """x [..., d] rotated on its first rd = 2 * cos.shape[-1] columns; cos, sin [..., rd / 2]
    broadcastable against x[..., :rd / 2]. Pairs (2j, 2j + 1) when ``interleaved`` (GPT-J),
    else (j, j + rd / 2) (GPT-NeoX):  (x1, x2) -> (x1 cos − x2 sin, x1 sin + x2 cos)."""
    half = cos.shape[-1]
    rd = 2 * half
    out = np.array(x, copy=True)
    if interleaved:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = x1 * cos - x2 * sin
        out[..., 1:rd:2] = x1 * sin + x2 * cos
    else:
        x1, x2 = x[..., :half], x[..., half:rd]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rd] = x1 * sin + x2 * cos
    return out


def _slots(lens, i, positions, block_table, page):
    """Index tuple of cache rows ``positions`` of batch entry i: (i, positions) for a contiguous
    cache, (pages, offsets) for a paged one."""
    if block_table is None:
        return i, positions
    return block_table[i, positions // page], positions % page


def append(k_cache, v_cache, k, v, lens, block_table, rot, cdt):
    """Write k (rotated when ``rot``) and v at positions lens[i] + 0.. of each batch entry."""
    b, s_new = k.shape[:2]
    page = k_cache.shape[1]
    for i in range(b):
        pos = int(lens[i]) + np.arange(s_new)
        kn = k[i]
        if rot is not None:
            cos, sin, interleaved, _ = rot
            c = np.asarray(cos, dtype=cdt)[pos][:, None, :]          # [s_new, 1, rd / 2]
            s = np.asarray(sin, dtype=cdt)[pos][:, None, :]
            kn = apply_rotary(np.asarray(kn, dtype=cdt), c, s, interleaved)
        idx = _slots(lens, i, pos, block_table, page)
        k_cache[idx] = kn.astype(k_cache.dtype, copy=False)
        v_cache[idx] = v[i]


def gather(cache, i, n, block_table):
    """The first n key rows of batch entry i: [1, n, h_k, d] (a view for a contiguous cache)."""
    if block_table is None:
        return cache[i:i + 1, :n]
    page = cache.shape[1]
    pages = block_table[i, :-(-n // page)] if n else block_table[i, :0]
    return cache[pages].reshape(1, -1, *cache.shape[2:])[:, :n]


def _rotated_q(q, lens, rot, cdt):
    cos, sin, interleaved, per_row = rot
    b, s_q = q.shape[:2]
    pos = lens[:, None] + (np.arange(s_q)[None, :] if per_row else 0)   # [b, s_q] (or [b, 1])
    pos = np.broadcast_to(pos, (b, s_q))
    c = np.asarray(cos, dtype=cdt)[pos][:, :, None, :]                   # [b, s_q, 1, rd / 2]
    s = np.asarray(sin, dtype=cdt)[pos][:, :, None, :]
    return apply_rotary(np.asarray(q, dtype=cdt), c, s, interleaved)


def forward(q, k_cache, v_cache, k, v, lens, block_table, rot, opts):
    """Append (when k is given), rotate, attend; returns (out [b, s_q, h, d] in q's dtype,
    lse [b, h, s_q] float32 or float64). ``opts``: the validated Options (bottom-right causal /
    window per batch entry against its own key count lens[i] + s_new)."""
    dtype = q.dtype
    cdt = np.float64 if dtype == np.float64 else np.float32
    lens = np.asarray(lens, dtype=np.int64)
    bt = None if block_table is None else np.asarray(block_table, dtype=np.int64)
    s_new = 0
    if k is not None:
        append(k_cache, v_cache, k, v, lens, bt, rot, cdt)
        s_new = k.shape[1]
    q_att = _rotated_q(q, lens, rot, cdt) if rot is not None else q
    b, s_q, h, _ = q.shape
    out = np.zeros((b, s_q, h, v_cache.shape[3]), dtype=dtype)
    lse = np.full((b, h, s_q), -np.inf, dtype=cdt)
    slopes = opts.alibi_slopes
    for i in range(b):
        n = int(lens[i]) + s_new
        o_i = opts
        if slopes is not None and slopes.shape[0] > 1:
            o_i = dataclasses.replace(opts, alibi_slopes=slopes[i:i + 1])
        kk = gather(k_cache, i, n, bt)
        vv = gather(v_cache, i, n, bt)
        o, l = cpu.forward(q_att[i:i + 1], kk, vv, o_i)
        out[i] = o[0]
        lse[i] = l[0]
    return out, lse
