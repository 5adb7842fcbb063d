"""The API's rules for what an argument may be, one test per rule, on the CPU path.

- array arguments: NumPy / CuPy arrays (or CAI / DLPack objects); None where an array is needed,
  lists and other array-likes, and NumPy masked arrays are refused with a TypeError naming them;
- flags (causal, return_lse, allow_tf32, deterministic): Python bool or numpy.bool_ only;
- allow_tf32=True: float32 inputs only (ValueError naming it otherwise);
- cu_seqlens: any integer dtype whose values fit in int32.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf


def _qkv(rng, shape=(2, 5, 4, 8), dtype=np.float32):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


def _packed(rng, lens=(3, 4)):
    n = sum(lens)
    q, k, v = (rng.standard_normal((n, 2, 8)).astype(np.float32) for _ in range(3))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return q, k, v, cu


def _message_names(info, name):
    assert str(info.value).startswith(f"{name}: got "), str(info.value)


# ---- None where an array is needed ----------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_attention_none_array_is_a_type_error(rng, name):
    args = dict(zip("qkv", _qkv(rng)))
    args[name] = None
    with pytest.raises(TypeError) as info:
        cf.attention(**args, device="cpu")
    _message_names(info, name)


@pytest.mark.parametrize("name", ["dout", "q", "k", "v", "out", "lse"])
def test_backward_none_array_is_a_type_error(rng, name):
    q, k, v = _qkv(rng)
    out, lse = cf.attention(q, k, v, return_lse=True, device="cpu")
    args = dict(dout=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse)
    args[name] = None
    with pytest.raises(TypeError) as info:
        cf.attention_backward(**args, device="cpu")
    _message_names(info, name)


@pytest.mark.parametrize("name", ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_none_array_is_a_type_error(rng, name):
    q, k, v, cu = _packed(rng)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    args[name] = None
    with pytest.raises(TypeError) as info:
        cf.attention_varlen(**args, device="cpu")
    _message_names(info, name)


@pytest.mark.parametrize("name", ["dout", "out", "lse", "cu_seqlens_k"])
def test_varlen_backward_none_array_is_a_type_error(rng, name):
    q, k, v, cu = _packed(rng)
    out, lse = cf.attention_varlen(q, k, v, cu, cu, return_lse=True, device="cpu")
    args = dict(dout=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu,
                cu_seqlens_k=cu)
    args[name] = None
    with pytest.raises(TypeError) as info:
        cf.attention_varlen_backward(**args, device="cpu")
    _message_names(info, name)


# ---- flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("return_lse", "no"), ("return_lse", 1), ("return_lse", None), ("causal", 1),
    ("causal", "yes"), ("allow_tf32", "no"), ("allow_tf32", 0),
], ids=lambda x: repr(x))
def test_non_bool_flag_is_refused(rng, name, value):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError) as info:
        cf.attention(q, k, v, device="cpu", **{name: value})
    _message_names(info, name)


def test_non_bool_flag_is_refused_after_a_cached_call(rng):
    q, k, v = _qkv(rng)
    cf.attention(q, k, v, device="cpu")   # the signature is now cached
    with pytest.raises(TypeError, match="^return_lse: got 'no'"):
        cf.attention(q, k, v, device="cpu", return_lse="no")


@pytest.mark.parametrize("value", [1, "no"], ids=repr)
def test_non_bool_deterministic_is_refused(rng, value):
    q, k, v = _qkv(rng)
    out, lse = cf.attention(q, k, v, return_lse=True, device="cpu")
    with pytest.raises(TypeError, match="^deterministic: got"):
        cf.attention_backward(out, q, k, v, out, lse, deterministic=value, device="cpu")


def test_varlen_non_bool_return_lse_is_refused(rng):
    q, k, v, cu = _packed(rng)
    with pytest.raises(TypeError, match="^return_lse: got"):
        cf.attention_varlen(q, k, v, cu, cu, return_lse="yes", device="cpu")


def test_numpy_bool_flags_are_taken(rng):
    q, k, v = _qkv(rng)
    out, lse = cf.attention(q, k, v, causal=np.bool_(True), return_lse=np.True_, device="cpu")
    np.testing.assert_array_equal(out, cf.attention(q, k, v, causal=True, device="cpu"))
    assert lse.shape == (2, 4, 5)


# ---- allow_tf32 -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64],
                         ids=lambda d: np.dtype(d).name)
def test_allow_tf32_with_another_dtype_is_refused(rng, dtype):
    q, k, v = _qkv(rng, dtype=dtype)
    with pytest.raises(ValueError) as info:
        cf.attention(q, k, v, allow_tf32=True, device="cpu")
    _message_names(info, "allow_tf32")
    assert np.dtype(dtype).name in str(info.value)


def test_allow_tf32_with_float32_is_taken(rng):
    q, k, v = _qkv(rng)
    out = cf.attention(q, k, v, allow_tf32=True, device="cpu")
    np.testing.assert_array_equal(out, cf.attention(q, k, v, device="cpu"))


def test_varlen_allow_tf32_with_float16_is_refused(rng):
    q, k, v, cu = _packed(rng)
    with pytest.raises(ValueError, match="^allow_tf32: got"):
        cf.attention_varlen(*(x.astype(np.float16) for x in (q, k, v)), cu, cu, allow_tf32=True,
                            device="cpu")


# ---- masked arrays --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v", "bias", "alibi_slopes"])
def test_masked_array_is_refused(rng, name):
    q, k, v = _qkv(rng)
    args = dict(q=q, k=k, v=v)
    full = {"q": q, "k": k, "v": v, "bias": rng.standard_normal((5, 5)).astype(np.float32),
            "alibi_slopes": np.ones(4)}[name]
    args[name] = np.ma.masked_array(full, mask=np.zeros(full.shape, bool))
    with pytest.raises(TypeError) as info:
        cf.attention(**args, device="cpu")
    _message_names(info, name)
    assert "MaskedArray" in str(info.value)


# ---- one rule for lists ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "bias", "mask", "alibi_slopes"])
def test_lists_are_refused_for_every_array_argument(rng, name):
    q, k, v = _qkv(rng, shape=(1, 2, 2, 4))
    args = dict(q=q, k=k, v=v)
    args[name] = {"q": q.tolist(), "bias": [[0.0, 1.0], [1.0, 0.0]],
                  "mask": [[True, False], [True, True]], "alibi_slopes": [0.5, 0.25]}[name]
    with pytest.raises(TypeError) as info:
        cf.attention(**args, device="cpu")
    _message_names(info, name)
    assert "numpy.asarray" in str(info.value)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "alibi_slopes"])
def test_varlen_lists_are_refused(rng, name):
    q, k, v, cu = _packed(rng)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    args[name] = {"cu_seqlens_q": cu.tolist(), "alibi_slopes": [0.5, 0.25]}[name]
    with pytest.raises(TypeError) as info:
        cf.attention_varlen(**args, device="cpu")
    _message_names(info, name)


# ---- cu_seqlens of any integer width --------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int64, np.uint16, np.uint32, np.uint64],
                         ids=lambda d: np.dtype(d).name)
def test_cu_seqlens_of_any_integer_dtype_are_taken(rng, dtype):
    q, k, v, cu = _packed(rng, lens=(5, 1, 9))
    want, want_lse = cf.attention_varlen(q, k, v, cu, cu, return_lse=True, device="cpu")
    got, got_lse = cf.attention_varlen(q, k, v, cu.astype(dtype), cu.astype(dtype),
                                       return_lse=True, device="cpu")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_lse, want_lse)
    grads = cf.attention_varlen_backward(np.ones_like(got), q, k, v, got, got_lse,
                                         cu.astype(dtype), cu.astype(dtype), device="cpu")
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_cu_seqlens_from_cumsum_are_taken(rng):
    lens = np.array([4, 2, 6])
    q, k, v, cu32 = _packed(rng, lens=tuple(lens))
    cu = np.concatenate([[0], np.cumsum(lens)])          # int64 on Linux
    np.testing.assert_array_equal(cf.attention_varlen(q, k, v, cu, cu, device="cpu"),
                                  cf.attention_varlen(q, k, v, cu32, cu32, device="cpu"))
