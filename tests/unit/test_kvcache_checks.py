"""attention_with_kvcache's validation: each bad argument raises before any work, with the one
message format naming the argument (docs/semantics.md §8), and leaves the cache untouched."""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import kvcache


def _arrays(rng, b=2, s_q=1, h=4, hk=2, d=16, cache=40, s_new=1, page=None, nb=None):
    q = rng.standard_normal((b, s_q, h, d))
    if page is None:
        kc = rng.standard_normal((b, cache, hk, d))
    else:
        kc = rng.standard_normal((nb or 2 * b * cache // page, page, hk, d))
    vc = rng.standard_normal(kc.shape)
    k = rng.standard_normal((b, s_new, hk, d))
    v = rng.standard_normal((b, s_new, hk, d))
    return q, kc, vc, k, v


def _bt(b, cols, nb, rng):
    return rng.permutation(nb)[:b * cols].reshape(b, cols).astype(np.int32)


BAD = {
    # name: (function of rng -> (args, kwargs), exception, argument named)
    "q_3d": (lambda a, r: ((a[0][0],) + a[1:], dict(cache_seqlens=3)), ValueError, "q"),
    "cache_head_dim": (lambda a, r: ((a[0], a[1][..., :8], a[2][..., :8], a[3], a[4]),
                                     dict(cache_seqlens=3)), ValueError, "v_cache|k_cache"),
    "v_cache_shape": (lambda a, r: ((a[0], a[1], a[2][:, :20], a[3], a[4]), dict(cache_seqlens=3)),
                      ValueError, "v_cache"),
    "heads_not_multiple": (lambda a, r: ((a[0][:, :, :3],) + a[1:], dict(cache_seqlens=3)),
                           ValueError, "k_cache"),
    "batch_mismatch": (lambda a, r: ((a[0][:1],) + a[1:3], dict(cache_seqlens=3)), ValueError, "k_cache"),
    "k_without_v": (lambda a, r: (a[:4], dict(cache_seqlens=3)), TypeError, "v"),
    "k_shape": (lambda a, r: (a[:3] + (a[3][:, :, :1], a[4]), dict(cache_seqlens=3)), ValueError, "k"),
    "dtype_mismatch": (lambda a, r: (a[:3] + (a[3].astype(np.float32), a[4]), dict(cache_seqlens=3)),
                       TypeError, "k"),
    "no_lengths_with_append": (lambda a, r: (a, {}), ValueError, "cache_seqlens"),
    "lengths_float": (lambda a, r: (a, dict(cache_seqlens=np.array([1.0, 2.0]))), TypeError, "cache_seqlens"),
    "lengths_shape": (lambda a, r: (a, dict(cache_seqlens=np.array([1, 2, 3], np.int32))), ValueError,
                      "cache_seqlens"),
    "lengths_bool": (lambda a, r: (a, dict(cache_seqlens=True)), TypeError, "cache_seqlens"),
    "length_negative": (lambda a, r: (a, dict(cache_seqlens=np.array([-1, 2], np.int32))), ValueError,
                        "cache_seqlens"),
    "length_full_then_append": (lambda a, r: (a, dict(cache_seqlens=np.array([3, 40], np.int32))),
                                ValueError, "cache_seqlens"),
    "num_splits_negative": (lambda a, r: (a, dict(cache_seqlens=3, num_splits=-1)), ValueError, "num_splits"),
    "num_splits_float": (lambda a, r: (a, dict(cache_seqlens=3, num_splits=2.0)), ValueError, "num_splits"),
    "rotary_only_cos": (lambda a, r: (a, dict(cache_seqlens=3, rotary_cos=np.ones((50, 4)))), TypeError,
                        "rotary_sin"),
    "rotary_too_wide": (lambda a, r: (a, dict(cache_seqlens=3, rotary_cos=np.ones((50, 9)),
                                              rotary_sin=np.ones((50, 9)))), ValueError, "rotary_cos"),
    "rotary_shapes_differ": (lambda a, r: (a, dict(cache_seqlens=3, rotary_cos=np.ones((50, 4)),
                                                   rotary_sin=np.ones((40, 4)))), ValueError, "rotary_sin"),
    "rotary_too_short": (lambda a, r: (a, dict(cache_seqlens=3, rotary_cos=np.ones((3, 4)),
                                               rotary_sin=np.ones((3, 4)))), ValueError, "rotary_cos"),
    "rotary_without_append": (lambda a, r: (a[:3], dict(cache_seqlens=3, rotary_cos=np.ones((50, 4)),
                                                        rotary_sin=np.ones((50, 4)))), ValueError,
                              "rotary_cos"),
    "rotary_interleaved_int": (lambda a, r: (a, dict(cache_seqlens=3, rotary_interleaved=1)), TypeError,
                               "rotary_interleaved"),
    "causal_int": (lambda a, r: (a, dict(cache_seqlens=3, causal=1)), TypeError, "causal"),
    "window_bad": (lambda a, r: (a, dict(cache_seqlens=3, window=(1,))), ValueError, "window"),
    "softcap_negative": (lambda a, r: (a, dict(cache_seqlens=3, softcap=-1.0)), ValueError, "softcap"),
    "alibi_shape": (lambda a, r: (a, dict(cache_seqlens=3, alibi_slopes=np.ones(3))), ValueError,
                    "alibi_slopes"),
    "list_q": (lambda a, r: ((a[0].tolist(),) + a[1:], dict(cache_seqlens=3)), TypeError, "q"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_argument_raises_naming_it(rng, name):
    fn, exc, arg = BAD[name]
    a = _arrays(rng)
    args, kwargs = fn(a, rng)
    before = a[1].copy()
    with pytest.raises(exc, match=rf"^({arg}): got .*; accepted: "):
        cf.attention_with_kvcache(*args, **kwargs)
    np.testing.assert_array_equal(a[1], before)


PAGED_BAD = {
    "block_table_int64": (lambda bt: dict(block_table=bt.astype(np.int64)), TypeError, "block_table"),
    "block_table_1d": (lambda bt: dict(block_table=bt[0]), ValueError, "block_table"),
    "block_table_batch": (lambda bt: dict(block_table=bt[:1]), ValueError, "block_table"),
    "block_index_negative": (lambda bt: dict(block_table=np.where(bt == bt[0, 0], -1, bt).astype(np.int32)),
                             ValueError, "block_table"),
    "block_index_past_end": (lambda bt: dict(block_table=np.where(bt == bt[1, 2], 10**6, bt).astype(np.int32)),
                             ValueError, "block_table"),
    "length_past_capacity": (lambda bt: dict(block_table=bt, cache_seqlens=np.array([3, 64], np.int32)),
                             ValueError, "cache_seqlens"),
}


@pytest.mark.parametrize("name", list(PAGED_BAD))
def test_paged_bad_values(rng, name):
    page, b, cols = 16, 2, 4
    nb = 10
    q, kc, vc, k, v = _arrays(rng, page=page, nb=nb)
    bt = _bt(b, cols, nb, rng)
    fn, exc, arg = PAGED_BAD[name]
    kwargs = dict(cache_seqlens=np.array([3, 40], np.int32))   # entry 1 uses columns 0..2
    kwargs.update(fn(bt))
    before = kc.copy()
    with pytest.raises(exc, match=rf"^{arg}: got .*; accepted: "):
        cf.attention_with_kvcache(q, kc, vc, k, v, **kwargs)
    np.testing.assert_array_equal(kc, before)


def test_unused_block_table_entries_are_not_checked(rng):
    """Entries past each sequence's last page (e.g. -1 padding, as vLLM keeps) are never read."""
    q, kc, vc, k, v = _arrays(rng, page=16, nb=10)
    bt = np.full((2, 4), -1, np.int32)
    bt[0, 0], bt[1, :2] = 3, [7, 1]
    out = cf.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=np.array([2, 20], np.int32),
                                    block_table=bt)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("page", [8, 24, 1])
def test_page_size_must_be_multiple_of_16(rng, page):
    q, kc, vc, k, v = _arrays(rng, page=page, nb=40)
    bt = _bt(2, 2, 40, rng)
    with pytest.raises(ValueError, match="^k_cache: got page size"):
        cf.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=1, block_table=bt)


def test_read_only_cache_refused_when_appending(rng):
    q, kc, vc, k, v = _arrays(rng)
    kc.flags.writeable = False
    with pytest.raises(ValueError, match="^k_cache: got a read-only array"):
        cf.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3)
    # without new rows a read-only cache is fine
    cf.attention_with_kvcache(q, kc, vc, cache_seqlens=3)


def test_check_kvcache_is_pure_shapes():
    """check_kvcache takes any objects with shape / dtype / ndim (no array data needed)."""
    class Spec:
        def __init__(self, shape, dtype=np.float16):
            self.shape, self.dtype, self.ndim = shape, np.dtype(dtype), len(shape)

    dims = kvcache.check_kvcache(Spec((4, 1, 32, 128)), Spec((100, 256, 8, 128)),
                                 Spec((100, 256, 8, 128)), Spec((4, 1, 8, 128)), Spec((4, 1, 8, 128)),
                                 cache_seqlens=Spec((4,), np.int32),
                                 block_table=Spec((4, 16), np.int32),
                                 rotary_cos=Spec((4096, 32), np.float32),
                                 rotary_sin=Spec((4096, 32), np.float32))
    assert dims.paged and dims.capacity == 16 * 256 and dims.rotary_dim == 64
    assert dims.heads // dims.heads_k == 4 and dims.seqlen_new == 1


def test_set_device_checks_toggles():
    prev = kvcache.set_device_checks(False)
    try:
        assert kvcache.set_device_checks(True) is False
    finally:
        kvcache.set_device_checks(prev)
    with pytest.raises(TypeError, match="^enabled"):
        kvcache.set_device_checks("no")
