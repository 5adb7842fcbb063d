"""attention_with_kvcache on the CPU implementation against cupyflash.reference, with the cache
gathered and the rotary applied in float64 (tests/kvcache_cases.py).

float64 inputs must match to 1e-10; float32 and bfloat16 within the float32 / bfloat16 bounds of
docs/semantics.md §9 (the computation in float32 of the same inputs). Caches are poisoned with
NaN outside the keys a call may read; after the call the new rows must sit where they belong and
everything else be unchanged.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import reference

from tests.kvcache_cases import appended_caches, entry_kv, make_case, q_positions, rotate64

BF16 = np.dtype(ml_dtypes.bfloat16)


def expected(q, kc, vc, k, v, bt, tabs, lens, *, interleaved=False, **opts):
    """(caches after the append, out and lse of every entry) in float64."""
    dtype = q.dtype if k is None else k.dtype
    kc2, vc2 = appended_caches(kc, vc, k, v, lens, bt, tabs, interleaved, dtype)
    b, s_q = q.shape[:2]
    s_new = 0 if k is None else k.shape[1]
    per_row = opts.get("causal", False) or opts.get("window") is not None
    outs, lses = [], []
    for i in range(b):
        K, V = entry_kv(kc2, vc2, bt, i, int(lens[i]) + s_new)
        qi = np.asarray(q[i], np.float64)
        if tabs is not None:
            qi = rotate64(qi, *tabs, q_positions(lens[i], s_q, per_row), interleaved)
        o_i = dict(opts)
        if np.ndim(opts.get("alibi_slopes")) == 2:
            o_i["alibi_slopes"] = opts["alibi_slopes"][i:i + 1]      # (batch, heads): this entry's row
        o, l = reference.attention(qi[None], K, V, return_lse=True, **o_i)
        outs.append(o[0])
        lses.append(l[0])
    return kc2, vc2, np.stack(outs), np.stack(lses)


CASES = {
    "contiguous_decode_gqa32_8": (dict(b=3, s_q=1, h=32, hk=8, d=16, lens=[0, 40, 99], s_new=1,
                                       cache_len=100), dict(causal=True)),
    "contiguous_full_no_append": (dict(b=2, s_q=3, h=4, hk=2, d=8, lens=[50, 50], s_new=0,
                                       cache_len=50), dict()),
    "paged16_shuffled_cross_q7": (dict(b=3, s_q=7, h=8, hk=2, d=16, lens=[12, 33, 0], s_new=7,
                                       page=16), dict(causal=True)),
    "paged32_mqa": (dict(b=2, s_q=1, h=8, hk=1, d=16, lens=[31, 64], s_new=1, page=32), dict()),
    "window_q7": (dict(b=2, s_q=7, h=4, hk=2, d=16, lens=[90, 5], s_new=7, page=16),
                  dict(window=(20, 0))),
    "window_both_sides": (dict(b=2, s_q=4, h=4, hk=4, d=8, lens=[60, 30], s_new=4, cache_len=64),
                          dict(window=(9, 3))),
    "q128_prefill_chunk": (dict(b=2, s_q=128, h=4, hk=1, d=16, lens=[100, 0], s_new=128, page=64),
                           dict(causal=True)),
    "rotary_half_causal": (dict(b=2, s_q=3, h=4, hk=2, d=16, lens=[17, 60], s_new=3, rotary_dim=8,
                                page=16), dict(causal=True)),
    "rotary_interleaved_causal": (dict(b=2, s_q=3, h=4, hk=2, d=16, lens=[17, 60], s_new=3,
                                       rotary_dim=16, cache_len=70), dict(causal=True, interleaved=True)),
    "rotary_noncausal_q_at_len": (dict(b=2, s_q=2, h=4, hk=2, d=16, lens=[9, 0], s_new=2,
                                       rotary_dim=12, cache_len=20), dict()),
    "softcap_alibi_scale": (dict(b=2, s_q=2, h=4, hk=2, d=16, lens=[40, 3], s_new=2, cache_len=50),
                            dict(causal=True, softcap=5.0, alibi=True, scale=0.3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference(rng, name):
    sizes, opts = dict(CASES[name][0]), dict(CASES[name][1])
    interleaved = opts.pop("interleaved", False)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.01, 0.5, (sizes["b"], sizes["h"]))
    q, kc, vc, k, v, bt, tabs, lens = make_case(rng, **sizes)
    kc2, vc2, ro, rl = expected(q, kc, vc, k, v, bt, tabs, lens, interleaved=interleaved, **opts)
    rot = {} if tabs is None else dict(rotary_cos=tabs[0], rotary_sin=tabs[1],
                                       rotary_interleaved=interleaved)
    cs = lens.astype(np.int32) if k is not None else None
    if name == "contiguous_full_no_append":
        cs = None          # the whole cache
    out, lse = cf.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=cs, block_table=bt,
                                         return_lse=True, **rot, **opts)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(out, ro, rtol=1e-10, atol=1e-10)
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rl))
    np.testing.assert_allclose(lse[fin], rl[fin], rtol=1e-10, atol=1e-10)
    for got, want in ((kc, kc2), (vc, vc2)):
        np.testing.assert_array_equal(got, want)          # NaN poison where nothing was written


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_lower_precision(rng, dtype):
    q, kc, vc, k, v, bt, tabs, lens = make_case(rng, b=2, s_q=3, h=8, hk=2, d=32, lens=[70, 0],
                                                s_new=3, page=16, rotary_dim=16, dtype=dtype)
    kc2, vc2, ro, rl = expected(q, kc, vc, k, v, bt, tabs, lens, causal=True)
    out, lse = cf.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens.astype(np.int32),
                                         block_table=bt, rotary_cos=tabs[0].astype(dtype),
                                         rotary_sin=tabs[1].astype(dtype), causal=True, return_lse=True)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    # float32: the float32 computation's error; bfloat16: out rounding plus the bf16 rotary tables
    tol = 1e-5 if dtype == np.float32 else 4e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), ro, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, rl, rtol=tol, atol=tol)


def test_int_and_array_lengths_agree(rng):
    q, kc, vc, k, v, bt, _, lens = make_case(rng, b=2, s_q=1, h=4, hk=2, d=8, lens=[20, 20],
                                             s_new=1, page=16)
    kc_b, vc_b = kc.copy(), vc.copy()
    a = cf.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=20, block_table=bt)
    b = cf.attention_with_kvcache(q, kc_b, vc_b, k, v, cache_seqlens=np.array([20, 20], np.int64),
                                  block_table=bt)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kc, kc_b)


def test_decode_loop_equals_one_call(rng):
    """Four decode steps (append one row each) give the attention of the full sequence."""
    b, h, hk, d, n = 2, 4, 2, 16, 4
    kc = np.zeros((b, 10 + n, hk, d))
    vc = np.zeros((b, 10 + n, hk, d))
    kc[:, :10] = rng.standard_normal((b, 10, hk, d))
    vc[:, :10] = rng.standard_normal((b, 10, hk, d))
    ks = rng.standard_normal((b, n, hk, d))
    vs = rng.standard_normal((b, n, hk, d))
    qs = rng.standard_normal((b, n, h, d))
    for t in range(n):
        out = cf.attention_with_kvcache(qs[:, t:t + 1], kc, vc, ks[:, t:t + 1], vs[:, t:t + 1],
                                        cache_seqlens=10 + t, causal=True)
        want = reference.attention(qs[:, t:t + 1], kc[:, :11 + t], vc[:, :11 + t], causal=True)
        np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(kc[:, 10:], ks)


def test_empty_cache_rows_give_zero_and_neg_inf(rng):
    q = rng.standard_normal((2, 1, 4, 8))
    kc = rng.standard_normal((2, 5, 2, 8))
    out, lse = cf.attention_with_kvcache(q, kc, kc.copy(), cache_seqlens=np.array([0, 3], np.int32),
                                         return_lse=True)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.all(np.isfinite(lse[1]))
