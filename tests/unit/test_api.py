"""The public API on the CPU path: layouts, kinds in and out, options, backward, vjp, varlen.

cpu.py's own numerics are fuzzed in test_cpu.py; here the API's plumbing is checked against the
float64 reference: that each keyword reaches the computation, shapes and dtypes come back right,
and layouts and broadcast dbias are handled.
"""
import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import reference

F32_TOL = dict(rtol=2e-5, atol=2e-5)


def _qkv(rng, b=2, sq=13, sk=17, h=4, hk=2, d=24, dv=20, dtype=np.float32):
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, dv)).astype(dtype)
    return q, k, v


OPTION_CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal-top-left": dict(causal=True, causal_align="top_left"),
    "window": dict(window=(3, 2)),
    "softcap": dict(softcap=2.5),
    "alibi-h": "alibi_h",
    "alibi-bh": "alibi_bh",
    "bias-key-padding": "bias_kp",
    "mask": "mask",
    "scale": dict(scale=0.3),
}


def _options(rng, case, b=2, h=4, sq=13, sk=17):
    spec = OPTION_CASES[case]
    if isinstance(spec, dict):
        return spec
    if spec == "alibi_h":
        return dict(alibi_slopes=rng.uniform(0.1, 1, h).astype(np.float32))
    if spec == "alibi_bh":
        return dict(alibi_slopes=rng.uniform(0.1, 1, (b, h)))
    if spec == "bias_kp":
        return dict(bias=rng.standard_normal((b, 1, 1, sk)).astype(np.float32))
    return dict(mask=rng.random((sq, sk)) > 0.3)


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_forward_matches_reference(rng, case, layout):
    q, k, v = _qkv(rng)
    opts = _options(rng, case)
    out_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **opts)
    to = (lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))) if layout == "bhsd" else (lambda x: x)
    out, lse = cf.attention(to(q), to(k), to(v), layout=layout, return_lse=True, device="cpu", **opts)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == to(out_ref).shape and lse.shape == (2, 4, 13)
    np.testing.assert_allclose(out, to(out_ref), **F32_TOL)
    np.testing.assert_allclose(lse, lse_ref, **F32_TOL)


@pytest.mark.parametrize("case", ["plain", "causal", "softcap", "alibi-bh", "window"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_backward_matches_reference(rng, case, layout):
    q, k, v = _qkv(rng, dtype=np.float64)
    opts = _options(rng, case)
    dout = rng.standard_normal((2, 13, 4, 20))
    grads_ref = reference.attention_backward(dout, q, k, v, **opts)[:3]
    to = (lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))) if layout == "bhsd" else (lambda x: x)
    out, vjp = cf.attention_vjp(to(q), to(k), to(v), layout=layout, device="cpu", **opts)
    grads = vjp(to(dout))
    assert len(grads) == 3
    for g, g_ref, x in zip(grads, grads_ref, (q, k, v)):
        assert g.shape == to(x).shape and g.dtype == np.float64
        np.testing.assert_allclose(g, to(g_ref), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("bias_shape", [(17,), (13, 17), (4, 1, 1), (2, 1, 13, 17), (2, 4, 13, 17)],
                         ids=lambda s: "x".join(map(str, s)))
def test_dbias_comes_back_in_the_bias_shape(rng, bias_shape):
    q, k, v = _qkv(rng, dtype=np.float64)
    bias = rng.standard_normal(bias_shape)
    dout = rng.standard_normal((2, 13, 4, 20))
    out, lse = cf.attention(q, k, v, bias=bias, return_lse=True, device="cpu")
    dq, dk, dv, dbias = cf.attention_backward(dout, q, k, v, out, lse, bias=bias, device="cpu")
    dbias_ref = reference.attention_backward(dout, q, k, v, bias=bias)[3]
    assert dbias.shape == bias_shape
    np.testing.assert_allclose(dbias, dbias_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=["fp16", "bf16", "fp32", "fp64"])
def test_dtype_round_trip(rng, dtype):
    q, k, v = _qkv(rng, dtype=dtype)
    out, lse = cf.attention(q, k, v, return_lse=True, device="cpu")
    assert out.dtype == np.dtype(dtype)
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    ref = reference.attention(q, k, v)
    tol = {np.float16: 5e-3, ml_dtypes.bfloat16: 4e-2, np.float32: 2e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)


def test_strided_views_need_no_copy_and_match(rng):
    base = rng.standard_normal((2, 13, 8, 48)).astype(np.float32)
    q, k, v = base[:, :, 0:4, :24], base[:, :, 4:6, 24:], base[:, :, 6:8, ::2]  # v: strided last dim
    out = cf.attention(q, k, v, device="cpu")
    np.testing.assert_allclose(out, reference.attention(q, k, v), **F32_TOL)


@pytest.mark.parametrize("shape", [(0, 5, 4, 8), (2, 0, 4, 8)], ids=["batch0", "seqlen_q0"])
def test_empty_query_gives_empty_out(shape):
    b, sq, h, d = shape
    q = np.empty(shape, np.float32)
    k = v = np.ones((b, 7, h, d), np.float32)
    out, lse = cf.attention(q, k, v, return_lse=True, device="cpu")
    assert out.shape == shape and lse.shape == (b, h, sq)


def test_no_keys_gives_zero_and_minus_inf(rng):
    q = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)
    k = v = np.empty((2, 0, 4, 8), np.float32)
    out, lse = cf.attention(q, k, v, return_lse=True, device="cpu")
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_fully_masked_rows_are_zero_not_nan(rng):
    q, k, v = _qkv(rng, sq=17, sk=5)  # bottom-right causal: the first 12 rows see no key
    out, lse = cf.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    assert not np.isnan(out).any()
    assert np.all(out[:, :12] == 0) and np.all(lse[:, :, :12] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 12:]))


def test_nan_input_propagates(rng):
    q, k, v = _qkv(rng)
    q[0, 3, 1, 0] = np.nan
    out = cf.attention(q, k, v, device="cpu")
    assert np.isnan(out[0, 3, 1]).all() and np.isfinite(out[1]).all()


# ---- variable-length batches --------------------------------------------------------------------

def _packed(rng, lens_q, lens_k, h=4, hk=2, d=16, dtype=np.float32):
    q = rng.standard_normal((sum(lens_q), h, d)).astype(dtype)
    k = rng.standard_normal((sum(lens_k), hk, d)).astype(dtype)
    v = rng.standard_normal((sum(lens_k), hk, d)).astype(dtype)
    cu = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("opts", [{}, dict(causal=True), dict(window=(2, 1), softcap=3.0)],
                         ids=["plain", "causal", "window-softcap"])
def test_varlen_matches_dense_per_sequence(rng, opts):
    lens_q, lens_k = (5, 1, 0, 9, 3), (7, 4, 3, 9, 0)
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k)
    slopes = rng.uniform(0.1, 1, (5, 4))
    out, lse = cf.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, device="cpu",
                                   alibi_slopes=slopes, **opts)
    assert out.shape == (sum(lens_q), 4, 16) and lse.shape == (4, sum(lens_q))
    for i in range(5):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        o_ref, l_ref = reference.attention(q[None, sq], k[None, sk], v[None, sk], return_lse=True,
                                           alibi_slopes=slopes[i], **opts)
        np.testing.assert_allclose(out[sq], o_ref[0], **F32_TOL)
        np.testing.assert_allclose(lse[:, sq], l_ref[0], **F32_TOL)


def test_varlen_backward_matches_dense_per_sequence(rng):
    lens_q, lens_k = (4, 1, 6), (4, 5, 2)
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, dtype=np.float64)
    out, lse = cf.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, device="cpu")
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = cf.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True,
                                              device="cpu")
    for i in range(3):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ref = reference.attention_backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], causal=True)
        for g, g_ref, s in zip((dq, dk, dv), ref[:3], (sq, sk, sk)):
            np.testing.assert_allclose(g[s], g_ref[0], rtol=1e-9, atol=1e-10)


def test_gradient_descent_with_vjp_lowers_the_loss(rng):
    """A NumPy user's training loop: fit q, k, v so that attention(q, k, v) approaches a target."""
    shapes = dict(b=1, sq=8, sk=8, h=2, hk=2, d=8, dv=8, dtype=np.float64)
    target = reference.attention(*_qkv(rng, **shapes), causal=True)
    q, k, v = _qkv(rng, **shapes)
    losses = []
    for _ in range(40):
        out, vjp = cf.attention_vjp(q, k, v, causal=True, device="cpu")
        diff = out - target
        losses.append(float((diff ** 2).sum()))
        dq, dk, dv = vjp(2 * diff)
        q, k, v = q - 0.2 * dq, k - 0.2 * dk, v - 0.2 * dv
    assert losses[-1] < 0.5 * losses[0], losses


# ---- the validated-call cache -------------------------------------------------------------------

def test_repeated_call_reuses_its_validation_and_stays_correct(rng):
    from cupyflash import api

    q, k, v = _qkv(rng)
    api._CALLS.clear()
    first = cf.attention(q, k, v, causal=True, device="cpu")
    assert len(api._CALLS) == 1
    q2, k2, v2 = _qkv(rng)  # fresh values, same signature: a cache hit
    second = cf.attention(q2, k2, v2, causal=True, device="cpu")
    assert len(api._CALLS) == 1
    np.testing.assert_allclose(first, reference.attention(q, k, v, causal=True), **F32_TOL)
    np.testing.assert_allclose(second, reference.attention(q2, k2, v2, causal=True), **F32_TOL)
    # another option value, stride or layout is another signature
    cf.attention(q, k, v, causal=False, device="cpu")
    cf.attention(q[:, ::2], k, v, causal=True, device="cpu")
    assert len(api._CALLS) == 3


@pytest.mark.parametrize("bad, exc, name", [
    (dict(window=(True, 2)), ValueError, "window"),
    (dict(window=(1.0, 2)), ValueError, "window"),
    (dict(causal=1), TypeError, "causal"),
    (dict(layout="nope"), ValueError, "layout"),
], ids=["window-bool", "window-float", "causal-int", "layout"])
def test_cached_signature_does_not_let_a_bad_option_through(rng, bad, exc, name):
    q, k, v = _qkv(rng)
    good = {"window": (1, 2), "causal": True, "layout": "bshd"}
    cf.attention(q, k, v, device="cpu", **good)
    cf.attention(q, k, v, device="cpu", **good)  # cached now
    with pytest.raises(exc, match=f"^{name}: got"):
        cf.attention(q, k, v, device="cpu", **{**good, **bad})


def test_failed_validation_is_not_cached(rng):
    from cupyflash import api

    q, k, v = _qkv(rng)
    api._CALLS.clear()
    for _ in range(2):
        with pytest.raises(ValueError, match="^softcap: got"):
            cf.attention(q, k, v, softcap=-1.0, device="cpu")
    assert not api._CALLS


# ---- the GPU fast path's key (pure: stand-in arrays) ---------------------------------------------

def _stand_in(shape=(2, 13, 4, 24), strides=None, dtype=np.float16, device_id=0):
    """Just what _fast_key reads of a CuPy array: shape, strides, dtype, data.device_id."""
    from types import SimpleNamespace

    dt = np.dtype(dtype)
    if strides is None:
        strides = tuple(int(s) for s in np.empty(shape, dt).strides)
    return SimpleNamespace(shape=shape, strides=strides, dtype=dt,
                           data=SimpleNamespace(device_id=device_id))


_BASE_OPTIONS = dict(causal=True, causal_align="bottom_right", window=(3, 2), softcap=None,
                     scale=0.5, layout="bshd", device="auto", allow_tf32=False)


def _key_of(q=None, k=None, v=None, **changes):
    from cupyflash import api

    opts = {**_BASE_OPTIONS, **changes}
    return api._fast_key(q or _stand_in(), k or _stand_in(), v or _stand_in(), **opts)


@pytest.mark.parametrize("change", [
    dict(q=_stand_in(strides=(2 * 13 * 4 * 48, 4 * 48, 48, 2))),     # a view of a wider buffer
    dict(k=_stand_in(dtype=ml_dtypes.bfloat16)),
    dict(v=_stand_in(device_id=1)),
    dict(q=_stand_in(shape=(2, 14, 4, 24))),
    dict(causal=1), dict(causal=np.bool_(True)),
    dict(window=(True, 2)), dict(window=(3.0, 2)), dict(window=[3, 2]), dict(window=None),
    dict(softcap=0), dict(softcap=0.0),
    dict(scale=1), dict(scale=np.float32(0.5)),
    dict(layout="bhsd"), dict(device="gpu"), dict(allow_tf32=0), dict(causal_align="top_left"),
], ids=["q-strides", "k-dtype", "v-device", "q-shape", "causal-int", "causal-npbool",
        "window-bool", "window-float", "window-list", "window-none", "softcap-int0",
        "softcap-float0", "scale-int", "scale-f32", "layout", "device", "tf32-int", "align"])
def test_fast_key_tells_apart_everything_validation_reads(change):
    base = _key_of()
    other = _key_of(**change)
    assert hash(base) is not None and hash(other) is not None
    assert other != base
    assert _key_of() == base  # and is a pure function of its inputs


def test_fast_key_of_an_unhashable_option_raises_type_error():
    with pytest.raises(TypeError):
        hash(_key_of(scale=np.array(0.5)))


class _FakeDeviceArray:
    """A stand-in for cupy.ndarray: shape, strides, dtype, itemsize, data.ptr / device_id."""

    _next_ptr = [1 << 30]

    def __init__(self, shape, dtype, strides=None, device_id=0):
        from types import SimpleNamespace

        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = strides or tuple(int(s) for s in np.empty(shape, self.dtype).strides)
        self._next_ptr[0] += 1 << 20
        self.data = SimpleNamespace(ptr=self._next_ptr[0], device_id=device_id)


def test_fast_path_wiring_with_stand_ins(monkeypatch):
    """The API's fast path on stand-in device arrays: a cached signature allocates out and lse
    with the planned shapes and launches with their pointers; any other current device or option
    value takes the full path."""
    from types import SimpleNamespace

    from cupyflash import api

    launched, current = [], [0]
    entry = SimpleNamespace(launch=lambda *ptrs: launched.append(ptrs))
    monkeypatch.setattr(api, "_gpu_module", lambda: SimpleNamespace(cached_launch=lambda *a: entry))
    for name in ("_FAST", "_fast_array_type", "_fast_get_device", "_fast_new"):
        monkeypatch.setattr(api, name, getattr(api, name))  # restored after the test
    monkeypatch.setattr(api, "_FAST", {})
    xp = SimpleNamespace(ndarray=_FakeDeviceArray,
                         cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: current[0])))
    full_path = []
    monkeypatch.setattr(api, "_run", lambda *a, **kw: full_path.append(1) or "full")

    b, sq, sk, h, hk, d = 2, 7, 11, 4, 2, 24
    q = _FakeDeviceArray((b, sq, h, d), np.float16)
    k, v = (_FakeDeviceArray((b, sk, hk, d), np.float16) for _ in range(2))
    options = dict(causal=True, causal_align="bottom_right", window=None, softcap=None,
                   scale=None, layout="bshd", device="auto", allow_tf32=False)
    dims = api.ck.Dims(b, sq, sk, h, hk, d, d)
    opts = api.ck.make_options(dims, np, causal=True)
    out_user = _FakeDeviceArray((b, sq, h, d), np.float16)
    api._remember_fast(SimpleNamespace(xp=xp, device_id=0), (q, k, v), tuple(options.values()),
                       (q, k, v), out_user, dims, opts, "bshd")
    assert len(api._FAST) == 1

    out, lse = cf.attention(q, k, v, return_lse=True, **options)
    assert launched[-1] == (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
    assert out.shape == (b, sq, h, d) and out.dtype == np.float16
    assert lse.shape == (b, h, sq) and lse.dtype == np.float32
    single = cf.attention(q, k, v, **options)
    assert isinstance(single, _FakeDeviceArray) and len(launched) == 2 and not full_path
    current[0] = 1   # the arrays live on device 0: the full path switches to it
    assert cf.attention(q, k, v, **options) == "full" and len(launched) == 2
    current[0] = 0
    assert cf.attention(q, k, v, **{**options, "causal": 1}) == "full"
    assert cf.attention(q, k, v, **{**options, "scale": np.array(0.5)}) == "full"
    q_strided = _FakeDeviceArray(q.shape, q.dtype, strides=(4096, 512, 64, 2))
    assert cf.attention(q_strided, k, v, **options) == "full"
    assert len(full_path) == 4 and len(launched) == 2


def test_fast_path_is_not_cached_where_a_launch_needs_more_than_pointers():
    from types import SimpleNamespace

    from cupyflash import api

    xp = SimpleNamespace(ndarray=_FakeDeviceArray)
    backend = SimpleNamespace(xp=xp, device_id=0)
    q = _FakeDeviceArray((1, 5, 2, 8), np.float16)
    kv = _FakeDeviceArray((1, 5, 2, 8), np.float16)
    v_gap = _FakeDeviceArray((1, 5, 2, 8), np.float16, strides=(320, 64, 32, 4))  # copied per call
    opts_list = (False, "bottom_right", None, None, None, "bshd", "auto", False)
    dims = api.ck.Dims(1, 5, 5, 2, 2, 8, 8)
    alibi = api.ck.make_options(dims, np, alibi_slopes=np.ones(2))
    plain = api.ck.make_options(dims, np)
    before = dict(api._FAST)
    api._remember_fast(backend, (q, kv, v_gap), opts_list, (q, kv, v_gap), q, dims, plain, "bshd")
    api._remember_fast(backend, (q, kv, kv), opts_list, (q, kv, kv), q, dims, alibi, "bshd")
    api._remember_fast(backend, (q, kv, kv), opts_list, (q, kv, kv), q,
                       api.ck.Dims(1, 5, 0, 2, 2, 8, 8), plain, "bshd")
    api._remember_fast(backend, (np.empty(q.shape), kv, kv), opts_list, (q, kv, kv), q, dims,
                       plain, "bshd")
    assert api._FAST == before
