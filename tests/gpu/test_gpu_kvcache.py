"""attention_with_kvcache on the GPU (split-KV decode kernels and the gather path) against the
float64 reference with the cache gathered and the rotary applied in float64.

Each case poisons the cache outside the keys a call may read (NaN past every entry's keys, in
unused pages) and checks, after the call, that the new rows landed where they belong and that
nothing else in the cache changed. Bound per case (docs/semantics.md §9): max |got − ref| <=
2 · max |naive − ref| + floor, the naive computation taking the same rounded inputs (the rotated
q and keys rounded to the dtype, as the kernels store them).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_util import BF16, DTYPES, FLOOR, cp, naive_attention

import cupyflash as cf
from cupyflash import reference
from cupyflash.kvcache import set_device_checks
from tests.kvcache_cases import appended_caches, entry_kv, make_case, q_positions, rotate64

pytestmark = pytest.mark.gpu


def _make(rng, *, rot=None, extra_pages=3, **sizes):
    """Host inputs of one case (tests/kvcache_cases.make_case; rot: the rotary dim, float32
    tables)."""
    return make_case(rng, rotary_dim=rot or 0, extra_pages=extra_pages, table_dtype=np.float32,
                     **sizes)


def _check(out, lse, q, kc2, vc2, lens, s_new, bt, tabs, interleaved, dtype, dtype_name, opts):
    """out / lse of every batch entry against the float64 reference and the naive bound."""
    b, s_q, h, d = q.shape
    causal = opts.get("causal", False)
    window = opts.get("window")
    per_row = causal or window is not None
    for i in range(b):
        n = int(lens[i]) + s_new
        K, V = entry_kv(kc2, vc2, bt, i, n)
        q_r = np.asarray(q[i:i + 1], np.float64)
        if tabs is not None:
            q_r = rotate64(q_r[0], *tabs, q_positions(lens[i], s_q, per_row), interleaved)[None]
        ro, rl = reference.attention(q_r, K, V, causal=causal, window=window,
                                     softcap=opts.get("softcap"), scale=opts.get("scale"),
                                     alibi_slopes=opts.get("alibi_slopes"), return_lse=True)
        got_o = np.asarray(out[i:i + 1], np.float64)
        got_l = np.asarray(lse[i:i + 1], np.float64)
        if dtype_name == "float32":
            tol_o = 2e-5 * max(1.0, np.abs(ro).max())
            tol_l = 2e-5 * max(1.0, np.abs(rl[np.isfinite(rl)]).max(initial=0))
        else:
            # naive: the same rounded inputs (q rotated then rounded, as the kernels do)
            qd = cp.asarray(q_r.astype(dtype))
            Kd, Vd = cp.asarray(K.astype(dtype)), cp.asarray(V.astype(dtype))
            sc = opts.get("scale") or 1.0 / np.sqrt(d)
            keep = np.asarray(np.isfinite(reference.scores(np.ones((1, s_q, h, d)), np.ones(K.shape),
                                                           causal=causal, window=window)))
            slopes = opts.get("alibi_slopes")
            diag = np.arange(s_q) + n - s_q
            no, nl = naive_attention(qd, Kd, Vd, None, dtype, sc, keep,
                                     softcap=opts.get("softcap") or 0.0,
                                     slopes=None if slopes is None else cp.asarray(np.atleast_2d(slopes), np.float32),
                                     diag=diag)
            no, nl = cp.asnumpy(no).astype(np.float64), cp.asnumpy(nl).astype(np.float64)
            fin = np.isfinite(rl)
            sc_o = max(1.0, np.abs(ro).max(initial=0))
            tol_o = 2 * np.abs(no - ro).max(initial=0) + FLOOR[dtype_name] * sc_o
            tol_l = 2 * np.abs(nl[fin] - rl[fin]).max(initial=0) + FLOOR[dtype_name] * max(1.0, np.abs(rl[fin]).max(initial=0))
        err_o = np.abs(got_o - ro).max(initial=0)
        assert err_o <= tol_o, f"batch entry {i} ({n} keys): out error {err_o:.3g} > {tol_o:.3g}"
        fin = np.isfinite(rl)
        assert np.array_equal(np.isneginf(got_l), np.isneginf(rl)), f"batch entry {i}: lse -inf rows"
        err_l = np.abs(got_l[fin] - rl[fin]).max(initial=0)
        assert err_l <= tol_l, f"batch entry {i}: lse error {err_l:.3g} > {tol_l:.3g}"


CASES = {
    # name: (sizes, options)
    "contig_decode_gqa32_8_ragged": (dict(b=3, s_q=1, h=32, hk=8, d=128, lens=[0, 150, 299], s_new=1,
                                          cache_len=300), dict(causal=True)),
    "contig_noappend_full": (dict(b=2, s_q=1, h=8, hk=8, d=128, lens=[700, 1100], s_new=0,
                                  cache_len=1100), dict()),
    "paged16_shuffled_cross_pages_q7": (dict(b=3, s_q=7, h=32, hk=8, d=128, lens=[12, 33, 0], s_new=7,
                                             page=16), dict(causal=True)),
    "paged256_mqa_cross": (dict(b=3, s_q=1, h=8, hk=1, d=128, lens=[1000, 511, 255], s_new=1,
                                page=256), dict()),
    "paged32_window": (dict(b=2, s_q=7, h=16, hk=4, d=128, lens=[400, 61], s_new=7, page=32),
                       dict(window=(64, 0))),
    "contig_window_left_right": (dict(b=2, s_q=5, h=8, hk=2, d=64, lens=[333, 90], s_new=5,
                                      cache_len=400), dict(window=(40, 2))),
    "rotary_half_causal": (dict(b=2, s_q=3, h=16, hk=4, d=128, lens=[77, 400], s_new=3, rot=64,
                                page=16), dict(causal=True)),
    "rotary_interleaved_causal": (dict(b=2, s_q=3, h=16, hk=4, d=128, lens=[77, 400], s_new=3, rot=128,
                                       cache_len=410), dict(causal=True, interleaved=True)),
    "rotary_half_noncausal_q_at_len": (dict(b=2, s_q=2, h=8, hk=2, d=64, lens=[20, 0], s_new=2,
                                            rot=32, cache_len=40), dict()),
    "prefill_chunk_q128": (dict(b=2, s_q=128, h=8, hk=2, d=128, lens=[300, 0], s_new=128,
                                page=64), dict(causal=True)),
    "softcap_alibi": (dict(b=2, s_q=2, h=8, hk=2, d=128, lens=[500, 31], s_new=2, cache_len=600),
                      dict(causal=True, softcap=30.0, alibi=True)),
    "long_split_gqa": (dict(b=1, s_q=1, h=32, hk=8, d=128, lens=[20000], s_new=1, cache_len=20001),
                       dict()),
    "d64_fp16_mha": (dict(b=4, s_q=1, h=8, hk=8, d=64, lens=[5, 2000, 64, 1], s_new=1,
                          cache_len=2100, dtype="float16"), dict(causal=True)),
    "d256_scale": (dict(b=2, s_q=1, h=4, hk=2, d=256, lens=[900, 17], s_new=1, page=16),
                   dict(scale=0.05)),
    "gather_d96": (dict(b=2, s_q=3, h=8, hk=2, d=96, lens=[150, 0], s_new=3, page=16, rot=32),
                   dict(causal=True)),
    "gather_float32": (dict(b=2, s_q=2, h=8, hk=2, d=128, lens=[150, 9], s_new=2, cache_len=200,
                            dtype="float32"), dict(causal=True)),
}


@pytest.mark.parametrize("splits", [0, 1, 3], ids=["auto", "splits1", "splits3"])
@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_matches_reference(rng, name, splits):
    sizes, opts = dict(CASES[name][0]), dict(CASES[name][1])
    if splits and name not in ("contig_decode_gqa32_8_ragged", "paged16_shuffled_cross_pages_q7",
                               "long_split_gqa", "paged256_mqa_cross"):
        pytest.skip("split counts forced on a few cases only")
    dtype_name = sizes.pop("dtype", "bfloat16")
    dtype = DTYPES[dtype_name]
    interleaved = opts.pop("interleaved", False)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, sizes["h"])
    q, kc, vc, k, v, bt, tabs, lens = _make(rng, dtype=dtype, **sizes)
    kc2, vc2 = appended_caches(kc, vc, k, v, lens, bt, tabs, interleaved, dtype)
    g = lambda x: None if x is None else cp.asarray(x)   # noqa: E731
    kc_d, vc_d = g(kc), g(vc)
    kw = {}
    if tabs is not None:
        kw = dict(rotary_cos=g(tabs[0]), rotary_sin=g(tabs[1]), rotary_interleaved=interleaved)
    out, lse = cf.attention_with_kvcache(g(q), kc_d, vc_d, g(k), g(v),
                                         cache_seqlens=g(lens.astype(np.int32)), block_table=g(bt),
                                         return_lse=True, num_splits=splits, **kw, **opts)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    # the cache: new rows where they belong, everything else (NaN poison included) unchanged
    for got, want, nm in ((kc_d, kc2, "k_cache"), (vc_d, vc2, "v_cache")):
        got = cp.asnumpy(got).astype(np.float64)
        tol = 0 if tabs is None else float(ml_dtypes.finfo(dtype).eps) * 4 * np.nanmax(np.abs(want))
        bad = ~((np.isnan(got) & np.isnan(want)) | (np.abs(got - want) <= tol))
        assert not bad.any(), f"{nm}: {int(bad.sum())} elements differ from the expected cache"
    _check(cp.asnumpy(out), cp.asnumpy(lse), q, kc2, vc2, lens, sizes["s_new"], bt, tabs,
           interleaved, dtype, dtype_name, opts)


def test_int_cache_seqlens_and_numpy_lengths(rng):
    """cache_seqlens as a Python int and as a NumPy array give the device-array result."""
    q, kc, vc, k, v, bt, _, lens = _make(rng, b=2, s_q=1, h=8, hk=2, d=128, lens=[300, 300],
                                         s_new=1, page=16, dtype=BF16)
    res = []
    for cs in (300, np.array([300, 300], np.int32), cp.asarray(np.array([300, 300], np.int32))):
        kc_d, vc_d = cp.asarray(kc), cp.asarray(vc)
        res.append(cp.asnumpy(cf.attention_with_kvcache(cp.asarray(q), kc_d, vc_d, cp.asarray(k),
                                                        cp.asarray(v), cache_seqlens=cs,
                                                        block_table=cp.asarray(bt))).astype(np.float32))
    np.testing.assert_array_equal(res[0], res[1])
    np.testing.assert_array_equal(res[0], res[2])


@pytest.mark.parametrize("where", ["host", "device"])
def test_bad_block_table_and_lengths_raise(rng, where):
    q, kc, vc, k, v, bt, _, lens = _make(rng, b=2, s_q=1, h=8, hk=2, d=128, lens=[40, 10],
                                         s_new=1, page=16, dtype=BF16)
    put = (lambda x: x) if where == "host" else cp.asarray
    kc_d, vc_d = cp.asarray(kc), cp.asarray(vc)
    before = cp.asnumpy(kc_d).copy()
    bad = bt.copy()
    bad[0, 1] = kc.shape[0] + 5          # used by entry 0 (keys 16..31)
    args = (cp.asarray(q), kc_d, vc_d, cp.asarray(k), cp.asarray(v))
    with pytest.raises(ValueError, match="block_table"):
        cf.attention_with_kvcache(*args, cache_seqlens=put(lens.astype(np.int32)), block_table=put(bad))
    with pytest.raises(ValueError, match="cache_seqlens"):
        too_long = np.array([40, bt.shape[1] * 16], np.int32)
        cf.attention_with_kvcache(*args, cache_seqlens=put(too_long), block_table=put(bt))
    with pytest.raises(ValueError, match="cache_seqlens"):
        cf.attention_with_kvcache(*args, cache_seqlens=put(np.array([-1, 3], np.int32)), block_table=put(bt))
    np.testing.assert_array_equal(cp.asnumpy(kc_d).view(np.uint16), before.view(np.uint16))


def test_unchecked_bad_values_stay_inside_the_cache(rng):
    """set_device_checks(False): bad device values give no error, and the kernels' clamps keep
    every read and write inside the cache (no illegal address: the context stays usable)."""
    q, kc, vc, k, v, bt, _, lens = _make(rng, b=2, s_q=1, h=8, hk=2, d=128, lens=[40, 10],
                                         s_new=1, page=16, dtype=BF16, extra_pages=0)
    kc_d, vc_d = cp.asarray(kc), cp.asarray(vc)
    bad = bt.copy()
    bad[0, :] = 10**6
    prev = set_device_checks(False)
    try:
        out = cf.attention_with_kvcache(cp.asarray(q), kc_d, vc_d, cp.asarray(k), cp.asarray(v),
                                        cache_seqlens=cp.asarray(np.array([10**6, -5], np.int32)),
                                        block_table=cp.asarray(bad))
        cp.cuda.get_current_stream().synchronize()
    finally:
        set_device_checks(prev)
    assert out.shape == q.shape
    assert float(cp.ones(4).sum()) == 4.0


@pytest.mark.parametrize("s_q, h, hk", [(1, 32, 8), (1, 16, 4), (4, 8, 2)], ids=["gqa", "gqa4", "q4"])
def test_plain_attention_split_route(rng, s_q, h, hk):
    """decode.forward_few_rows (the hook for attention with few query rows) against the reference."""
    from cupyflash import _checks as ck
    from cupyflash.gpu import decode

    b, s_k, d = 2, 3000, 128
    q = rng.standard_normal((b, s_q, h, d)).astype(BF16)
    k = rng.standard_normal((b, s_k, hk, d)).astype(BF16)
    v = rng.standard_normal((b, s_k, hk, d)).astype(BF16)
    for causal in (False, True):
        opts = ck.make_options(ck.Dims(b, s_q, s_k, h, hk, d, d), cp, causal=causal)
        out = cp.empty((b, s_q, h, d), BF16)
        lse = cp.empty((b, h, s_q), np.float32)
        name = decode.forward_few_rows(cp.asarray(q), cp.asarray(k), cp.asarray(v), out, lse, opts)
        assert name is not None and name.startswith("decode_")
        ro, rl = reference.attention(q, k, v, causal=causal, return_lse=True)
        assert np.abs(cp.asnumpy(out).astype(np.float64) - ro).max() < 2e-2
        assert np.abs(cp.asnumpy(lse) - rl).max() < 1e-3


@pytest.mark.parametrize("change", [dict(head_fastest=False), dict(fused_combine=False),
                                    dict(ctas_per_sm=3), dict(nw=2, ctas_per_sm=4)],
                         ids=["split_major_grid", "combine_kernel", "three_ctas", "two_warps"])
def test_tuning_alternatives_agree(rng, change):
    """plan_decode.TUNING's alternatives (benchmarked A/B) give the default's results."""
    from cupyflash import kvcache
    from cupyflash.gpu import plan_decode

    q, kc, vc, _, _, bt, _, lens = _make(rng, b=3, s_q=2, h=16, hk=4, d=128, lens=[3000, 17, 0],
                                         s_new=0, page=32, dtype=BF16)
    args = (cp.asarray(q), cp.asarray(kc), cp.asarray(vc))
    kw = dict(cache_seqlens=cp.asarray(lens.astype(np.int32)), block_table=cp.asarray(bt),
              return_lse=True, causal=True, num_splits=5)
    o1, l1 = cf.attention_with_kvcache(*args, **kw)
    old = dict(plan_decode.TUNING)
    plan_decode.TUNING.update(change)
    kvcache._FAST.clear()
    try:
        o2, l2 = cf.attention_with_kvcache(*args, **kw)
    finally:
        plan_decode.TUNING.update(old)
        kvcache._FAST.clear()
    np.testing.assert_allclose(cp.asnumpy(o2).astype(np.float32), cp.asnumpy(o1).astype(np.float32),
                               atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(cp.asnumpy(l2), cp.asnumpy(l1), atol=1e-5, rtol=1e-5)


def test_repeated_calls_take_the_fast_path_and_agree(rng):
    """A decode loop: the second and later calls (same shapes) reuse the planned launch, with
    the int length changing each step."""
    from cupyflash import kvcache

    q, kc, vc, k, v, bt, _, lens = _make(rng, b=2, s_q=1, h=32, hk=8, d=128, lens=[100, 100],
                                         s_new=4, page=16, dtype=BF16)
    kc_d, vc_d, bt_d = cp.asarray(kc), cp.asarray(vc), cp.asarray(bt)
    kvcache._FAST.clear()
    outs = []
    for t in range(4):
        outs.append(cp.asnumpy(cf.attention_with_kvcache(
            cp.asarray(q), kc_d, vc_d, cp.asarray(k[:, t:t + 1]), cp.asarray(v[:, t:t + 1]),
            cache_seqlens=100 + t, block_table=bt_d, causal=True)))
    assert len(kvcache._FAST) == 1
    kc2, vc2 = appended_caches(kc, vc, k, v, lens, bt, None, False, BF16)
    got = cp.asnumpy(kc_d).astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(kc2))
    assert np.array_equal(got[~np.isnan(got)], kc2[~np.isnan(kc2)])
    for t in range(4):
        n = 100 + t + 1
        K = kc2[bt].reshape(2, -1, 8, 128)[:, :n]
        V = vc2[bt].reshape(2, -1, 8, 128)[:, :n]
        ref = reference.attention(np.asarray(q, np.float64), K, V, causal=True)
        assert np.abs(outs[t].astype(np.float64) - ref).max() < 3e-2


@pytest.mark.parametrize("s_q, causal, rot", [(1, True, 64), (3, True, 0), (2, False, 128)],
                         ids=["decode_rotary", "chunk_causal", "noncausal_rotary"])
def test_multi_head_calls_on_the_hopper_forward(rng, monkeypatch, s_q, causal, rot):
    """plan_decode.route_forward (threshold lowered): a multi-head call with int cache_seqlens on
    a contiguous cache attends on the Hopper forward after the append / rotary kernel; the
    result matches the reference, and a repeated call with another length reuses the route."""
    from cupyflash import kvcache
    from cupyflash.gpu import decode_route, device, plan_decode

    if device.info(cp.cuda.Device().id)[0] != 90:
        pytest.skip("the Hopper forward route needs compute capability 9.0")
    monkeypatch.setattr(plan_decode, "FORWARD_ROUTE_MIN_BYTES", 0)
    kvcache._FAST.clear()
    n0 = 600
    q, kc, vc, k, v, bt, tabs, lens = _make(rng, b=2, s_q=s_q, h=8, hk=8, d=128, lens=[n0, n0],
                                            s_new=s_q, cache_len=700, rot=rot, dtype=BF16)
    kc_d, vc_d = cp.asarray(kc), cp.asarray(vc)
    kw = {}
    if tabs is not None:
        kw = dict(rotary_cos=cp.asarray(tabs[0]), rotary_sin=cp.asarray(tabs[1]))
    for step in range(2):   # the second call: the entry of the first (another length)
        n = n0 + step * s_q
        q_s = q if step == 0 else rng.standard_normal(q.shape).astype(BF16)
        k_s = k if step == 0 else rng.standard_normal(k.shape).astype(BF16)
        v_s = v if step == 0 else rng.standard_normal(v.shape).astype(BF16)
        kc_before, vc_before = cp.asnumpy(kc_d), cp.asnumpy(vc_d)
        out, lse = cf.attention_with_kvcache(cp.asarray(q_s), kc_d, vc_d, cp.asarray(k_s),
                                             cp.asarray(v_s), cache_seqlens=n, return_lse=True,
                                             causal=causal, **kw)
        ents = list(kvcache._FAST.values())
        assert len(ents) == 1 and isinstance(ents[0].launch, decode_route.ForwardRoute)
        lens_s = np.array([n, n], np.int64)
        kc2, vc2 = appended_caches(kc_before, vc_before, k_s, v_s, lens_s, None, tabs, False, BF16)
        _check(cp.asnumpy(out), cp.asnumpy(lse), q_s, kc2, vc2, lens_s, s_q, None, tabs, False,
               BF16, "bfloat16", dict(causal=causal))
    kvcache._FAST.clear()
