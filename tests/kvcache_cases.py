"""Inputs and float64 expectations for the attention_with_kvcache tests (tests/unit/test_kvcache_cpu.py
on the CPU, tests/gpu/test_gpu_kvcache.py on the GPU): NumPy only.

Caches are poisoned with NaN outside the keys a call may read (past each entry's keys in a
contiguous cache, every unused slot of a paged one); pages are shuffled.
"""
from __future__ import annotations

import numpy as np


def rotate64(x, cos, sin, pos, interleaved):
    """x [n, heads, d] rotated in float64 at positions pos [n] on its first 2 * cos.shape[1]
    columns (interleaved pairs (0, 1), (2, 3), ... or halves [0, r/2), [r/2, r))."""
    x = np.array(x, np.float64)
    half = cos.shape[1]
    c, s = np.float64(cos)[pos][:, None, :], np.float64(sin)[pos][:, None, :]
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def make_case(rng, *, b, s_q, h, hk, d, lens, s_new, dtype=np.float64, page=None, cache_len=None,
              rotary_dim=0, extra_pages=2, table_dtype=np.float64):
    """(q, k_cache, v_cache, k, v, block_table or None, (cos, sin) or None, lens int64) of one
    case: a contiguous cache of cache_len (default: what the append needs) or a paged one of
    page-size pages (extra_pages more than the block table uses)."""
    lens = np.asarray(lens, np.int64)
    need = lens + s_new
    if page is None:
        cap = cache_len or int(need.max())
        kc = rng.standard_normal((b, cap, hk, d)).astype(dtype)
        vc = rng.standard_normal((b, cap, hk, d)).astype(dtype)
        for i in range(b):
            kc[i, lens[i]:] = np.nan
            vc[i, lens[i]:] = np.nan
        bt = None
    else:
        mb = int(-(-max(int(need.max()), 1) // page))
        nb = b * mb + extra_pages
        kc = rng.standard_normal((nb, page, hk, d)).astype(dtype)
        vc = rng.standard_normal((nb, page, hk, d)).astype(dtype)
        bt = rng.permutation(nb)[:b * mb].reshape(b, mb).astype(np.int32)
        used = np.zeros((nb, page), bool)
        for i in range(b):
            for j in range(lens[i]):
                used[bt[i, j // page], j % page] = True
        kc[~used] = np.nan
        vc[~used] = np.nan
    q = rng.standard_normal((b, s_q, h, d)).astype(dtype)
    k = v = None
    if s_new:
        k = rng.standard_normal((b, s_new, hk, d)).astype(dtype)
        v = rng.standard_normal((b, s_new, hk, d)).astype(dtype)
    tabs = None
    if rotary_dim:
        ang = rng.uniform(0, 2 * np.pi, (int(need.max()) + s_q + 4, rotary_dim // 2))
        tabs = (np.cos(ang).astype(table_dtype), np.sin(ang).astype(table_dtype))
    return q, kc, vc, k, v, bt, tabs, lens


def appended_caches(kc, vc, k, v, lens, bt, tabs, interleaved, dtype):
    """The caches after the append, float64 with the NaN poison kept: new keys rotated (when
    tabs) and rounded to ``dtype`` as the cache stores them, new values as given."""
    kc2, vc2 = np.array(kc, np.float64), np.array(vc, np.float64)
    if k is None:
        return kc2, vc2
    page = kc.shape[1]
    for i in range(k.shape[0]):
        pos = lens[i] + np.arange(k.shape[1])
        kn = np.asarray(k[i], np.float64)
        if tabs is not None:
            kn = rotate64(kn, *tabs, pos, interleaved)
        kn = kn.astype(dtype).astype(np.float64)
        idx = (i, pos) if bt is None else (bt[i, pos // page], pos % page)
        kc2[idx], vc2[idx] = kn, np.asarray(v[i], np.float64)
    return kc2, vc2


def entry_kv(kc2, vc2, bt, i, n):
    """K, V [1, n, heads_k, d] of batch entry i's first n keys (gathered through bt if paged);
    asserts that none of them is poison."""
    if bt is None:
        K, V = kc2[i:i + 1, :n], vc2[i:i + 1, :n]
    else:
        K = kc2[bt[i]].reshape(1, -1, *kc2.shape[2:])[:, :n]
        V = vc2[bt[i]].reshape(1, -1, *vc2.shape[2:])[:, :n]
    assert not np.isnan(K).any(), "test setup: poisoned keys inside the attended range"
    return K, V


def q_positions(len_i, s_q, per_row):
    """Rotary positions of an entry's query rows: len_i + row with a causal mask or a window,
    else all at len_i (FlashAttention's rule)."""
    return len_i + (np.arange(s_q) if per_row else np.zeros(s_q, np.int64))
