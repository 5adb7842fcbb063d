"""The public API on the GPU: array kinds in and out, devices, streams, fallbacks (device only).

Kernel numerics are tested in test_gpu_forward.py; here the plumbing around them.
"""
import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import reference

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def cp():
    import cupy

    return cupy


def _qkv(rng, b=2, sq=37, sk=53, h=4, hk=2, d=64, dtype=BF16):
    return tuple(rng.standard_normal((b, s, n, d)).astype(dtype)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def _close(out, ref, dtype):
    tol = {np.dtype(BF16): 3e-2, np.dtype(np.float16): 4e-3, np.dtype(np.float32): 1e-5,
           np.dtype(np.float64): 1e-12}[np.dtype(dtype)]
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["fp16", "bf16", "fp32"])
def test_cupy_in_cupy_out(rng, cp, dtype):
    q, k, v = _qkv(rng, dtype=dtype)
    out, lse = cf.attention(*(cp.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
    assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32 and lse.shape == (2, 4, 37)
    ref, lse_ref = reference.attention(q, k, v, causal=True, return_lse=True)
    _close(cp.asnumpy(out), ref, dtype)
    np.testing.assert_allclose(cp.asnumpy(lse), lse_ref, rtol=1e-3, atol=1e-3)


def test_numpy_in_numpy_out_on_the_gpu(rng):
    q, k, v = _qkv(rng)
    out = cf.attention(q, k, v, device="gpu")
    assert isinstance(out, np.ndarray) and out.dtype == BF16
    _close(out, reference.attention(q, k, v), BF16)


def test_bhsd_layout_on_the_gpu(rng, cp):
    q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in _qkv(rng))
    out = cf.attention(*(cp.asarray(x) for x in (q, k, v)), layout="bhsd", window=(5, 3))
    assert out.shape == (2, 4, 37, 64) and out.flags.c_contiguous
    ref = reference.attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), window=(5, 3))
    _close(cp.asnumpy(out), ref.transpose(0, 2, 1, 3), BF16)


def test_runs_on_the_current_stream(rng, cp):
    q, k, v = (cp.asarray(x) for x in _qkv(rng))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cf.attention(q, k, v)
        stream.synchronize()
    _close(cp.asnumpy(out), reference.attention(*(cp.asnumpy(x) for x in (q, k, v))), BF16)


def test_float64_cupy_runs_on_the_gpu(rng, cp):
    """float64 CuPy inputs run the f64_t kernels and stay CuPy (tests/gpu/test_gpu_float64.py
    checks that nothing goes to the host)."""
    q, k, v = _qkv(rng, dtype=np.float64)
    out = cf.attention(*(cp.asarray(x) for x in (q, k, v)), softcap=3.0)
    assert isinstance(out, cp.ndarray) and out.dtype == np.float64
    _close(cp.asnumpy(out), reference.attention(q, k, v, softcap=3.0), np.float64)


def test_device_cpu_with_cupy_inputs_returns_cupy(rng, cp):
    q, k, v = _qkv(rng, dtype=np.float32)
    out = cf.attention(*(cp.asarray(x) for x in (q, k, v)), device="cpu")
    assert isinstance(out, cp.ndarray)
    _close(cp.asnumpy(out), reference.attention(q, k, v), np.float32)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_backward_of_cupy_inputs_runs_on_the_gpu(rng, cp, layout):
    q, k, v = _qkv(rng, dtype=np.float16)
    dout = rng.standard_normal((2, 37, 4, 64)).astype(np.float16)
    to = (lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))) if layout == "bhsd" else (lambda x: x)
    out, vjp = cf.attention_vjp(*(cp.asarray(to(x)) for x in (q, k, v)), causal=True, layout=layout)
    grads = vjp(cp.asarray(to(dout)))
    refs = reference.attention_backward(dout, q, k, v, causal=True)[:3]
    for g, g_ref, x in zip(grads, refs, (q, k, v)):
        assert isinstance(g, cp.ndarray) and g.shape == to(x).shape and g.dtype == np.float16
        np.testing.assert_allclose(cp.asnumpy(g).astype(np.float64), to(g_ref), rtol=2e-2, atol=2e-2)


def test_bias_and_mask_on_cupy_inputs_run_on_the_gpu(rng, cp):
    q, k, v = _qkv(rng)
    bias = rng.standard_normal((53,)).astype(np.float32)
    mask = rng.random((37, 53)) > 0.2
    out = cf.attention(*(cp.asarray(x) for x in (q, k, v)), bias=cp.asarray(bias),
                       mask=cp.asarray(mask))
    assert isinstance(out, cp.ndarray)
    _close(cp.asnumpy(out), reference.attention(q, k, v, bias=bias, mask=mask), BF16)


def test_numpy_backward_falls_back_to_the_cpu_under_auto(rng):
    q, k, v = _qkv(rng, dtype=np.float32)
    out, vjp = cf.attention_vjp(q, k, v, causal=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = vjp(dout)
    ref = reference.attention_backward(dout, q, k, v, causal=True)
    for g, g_ref in zip((dq, dk, dv), ref[:3]):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_torch_tensors_are_taken_zero_copy(rng, cp):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 37, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = cf.attention(q, k, v)  # DLPack / CUDA array interface
    assert isinstance(out, cp.ndarray)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v))).transpose(1, 2)
    np.testing.assert_allclose(cp.asnumpy(out).astype(np.float32), expected.cpu().numpy(),
                               rtol=4e-3, atol=4e-3)


def test_varlen_on_the_gpu_matches_the_reference(rng, cp):
    lens_q, lens_k = (5, 1, 0, 130, 64), (7, 65, 3, 129, 0)
    cu = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((sum(lens_q), 4, 64)).astype(np.float16)
    k = rng.standard_normal((sum(lens_k), 2, 64)).astype(np.float16)
    v = rng.standard_normal((sum(lens_k), 2, 64)).astype(np.float16)
    out, lse = cf.attention_varlen(*(cp.asarray(x) for x in (q, k, v, cu(lens_q), cu(lens_k))),
                                   causal=True, return_lse=True)
    out, lse = cp.asnumpy(out), cp.asnumpy(lse)
    for i, (a, b) in enumerate(zip(cu(lens_q)[:-1], cu(lens_k)[:-1])):
        sq, sk = slice(a, a + lens_q[i]), slice(b, b + lens_k[i])
        o_ref, l_ref = reference.attention(q[None, sq], k[None, sk], v[None, sk], causal=True,
                                           return_lse=True)
        _close(out[sq], o_ref[0], np.float16)
        np.testing.assert_allclose(lse[:, sq], l_ref[0], rtol=1e-3, atol=1e-3)


def test_arrays_on_two_gpus_are_refused(rng, cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = _qkv(rng)
    with cp.cuda.Device(0):
        qd = cp.asarray(q)
    with cp.cuda.Device(1):
        kd, vd = cp.asarray(k), cp.asarray(v)
    with pytest.raises(ValueError, match="^k: got an array on GPU 1"):
        cf.attention(qd, kd, vd)


# ---- the fast path of a repeated call on CuPy arrays --------------------------------------------

def _no_full_path(monkeypatch):
    """From here on attention() may only take the fast path (the full path raises)."""
    from cupyflash import api

    def full_path(*args, **kwargs):
        raise AssertionError("the full path ran: the fast path was expected")

    monkeypatch.setattr(api, "_run", full_path)
    monkeypatch.setattr(api, "_on_device", full_path)


FAST_CASES = {  # (b, sq, sk, h, hk, d, dtype, options)
    "bshd-bf16": (2, 37, 53, 4, 2, 64, BF16, {}),
    "bhsd-fp16-causal-lse": (2, 41, 29, 4, 1, 64, np.float16,
                             dict(layout="bhsd", causal=True, return_lse=True)),
    "fp32-odd-headdim-window": (1, 31, 67, 3, 3, 17, np.float32, dict(window=(7, 3))),
    "seqlen1": (3, 1, 1, 2, 2, 32, np.float16, dict(return_lse=True)),
    "rows-without-keys": (1, 23, 5, 2, 1, 40, BF16, dict(causal=True, return_lse=True)),
}


@pytest.mark.parametrize("case", list(FAST_CASES))
def test_repeated_call_takes_the_fast_path_and_stays_correct(rng, cp, monkeypatch, case):
    from cupyflash import api

    b, sq, sk, h, hk, d, dtype, options = FAST_CASES[case]
    bhsd = options.get("layout") == "bhsd"
    to_user = (lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))) if bhsd else (lambda x: x)
    api._FAST.clear()
    for call in range(3):  # fresh inputs each call: a stale output from the pool cannot pass
        if call == 1:
            assert len(api._FAST) == 1, "the first call did not cache its fast path"
            _no_full_path(monkeypatch)
        q, k, v = _qkv(rng, b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, dtype=dtype)
        res = cf.attention(*(cp.asarray(to_user(x)) for x in (q, k, v)), **options)
        out, lse = res if options.get("return_lse") else (res, None)
        assert isinstance(out, cp.ndarray) and out.dtype == np.dtype(dtype)
        assert out.shape == to_user(q).shape and out.flags.c_contiguous
        causal = options.get("causal", False)
        ref, lse_ref = reference.attention(q, k, v, causal=causal, window=options.get("window"),
                                           return_lse=True)
        got = cp.asnumpy(out)
        assert not np.isnan(got.astype(np.float64)).any()
        _close(got, to_user(ref), dtype)
        if lse is not None:
            assert lse.shape == (b, h, sq) and lse.dtype == np.float32
            got_lse = cp.asnumpy(lse)
            np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(lse_ref))
            live = np.isfinite(lse_ref)
            np.testing.assert_allclose(got_lse[live], lse_ref[live], rtol=1e-3, atol=1e-3)
    assert len(api._FAST) == 1


def test_changed_strides_dtype_or_options_take_their_own_signature(rng, cp):
    from cupyflash import api

    api._FAST.clear()
    q, k, v = _qkv(rng)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    _close(cp.asnumpy(cf.attention(qd, kd, vd)), reference.attention(q, k, v), BF16)
    # same shapes, other strides: heads 0..3 of an 8-head buffer
    wide = cp.asarray(rng.standard_normal((2, 37, 8, 64)).astype(BF16))
    qw = wide[:, :, :4]
    _close(cp.asnumpy(cf.attention(qw, kd, vd)),
           reference.attention(cp.asnumpy(qw), k, v), BF16)
    # another dtype, another option value
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    _close(cp.asnumpy(cf.attention(*(cp.asarray(x) for x in (q16, k16, v16)))),
           reference.attention(q16, k16, v16), np.float16)
    _close(cp.asnumpy(cf.attention(qd, kd, vd, causal=True)),
           reference.attention(q, k, v, causal=True), BF16)
    assert len(api._FAST) == 4
    # a last dimension that is not contiguous is copied per call: no fast entry, still right
    vs = cp.asarray(np.concatenate([v, v], axis=-1))[..., ::2]
    for _ in range(2):
        _close(cp.asnumpy(cf.attention(qd, kd, vs)),
               reference.attention(q, k, cp.asnumpy(vs)), BF16)
    assert len(api._FAST) == 4


@pytest.mark.parametrize("bad, exc, name", [
    (dict(window=(True, 2)), ValueError, "window"),
    (dict(causal=1), TypeError, "causal"),
    (dict(layout="nope"), ValueError, "layout"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(scale="0.5"), TypeError, "scale"),
    (dict(scale=np.array(0.5)), TypeError, "scale"),   # unhashable: the fast key cannot be built
    (dict(allow_tf32=1), TypeError, "allow_tf32"),
    (dict(device="tpu"), ValueError, "device"),
], ids=["window-bool", "causal-int", "layout", "softcap-negative", "scale-str", "scale-array",
        "tf32-int", "device"])
def test_fast_path_does_not_let_a_bad_option_through(rng, cp, bad, exc, name):
    q, k, v = (cp.asarray(x) for x in _qkv(rng))
    good = dict(window=(1, 2), causal=True, layout="bshd", scale=0.5)
    cf.attention(q, k, v, **good)
    cf.attention(q, k, v, **good)  # the fast path now
    with pytest.raises(exc, match=f"^{name}: got"):
        cf.attention(q, k, v, **{**good, **bad})


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }   // hold the stream so later work must wait for it
}
"""


def test_fast_path_launches_on_the_current_stream(rng, cp, monkeypatch):
    """On a non-blocking stream: spin, overwrite q, attention. A launch on any other stream
    would read q before the overwrite (the legacy stream does not wait for this one)."""
    q, k, v = _qkv(rng)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    cf.attention(qd, kd, vd)          # cache the fast path
    q2 = _qkv(rng)[0]
    q2d = cp.asarray(q2)
    spin = cp.RawKernel(_SPIN, "spin")
    cp.cuda.Device().synchronize()
    _no_full_path(monkeypatch)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(200_000_000),))   # ~0.1 s
        qd[...] = q2d
        out = cf.attention(qd, kd, vd)
    stream.synchronize()
    _close(cp.asnumpy(out), reference.attention(q2, k, v), BF16)


def test_fast_path_from_many_threads(rng, cp):
    """Threads share one cached Params record: each call's pointers and launch stay paired."""
    import threading

    host = [_qkv(rng, b=1, sq=64, sk=96, h=2, hk=1, d=64, dtype=np.float16) for _ in range(8)]
    dev = [tuple(cp.asarray(x) for x in t) for t in host]
    cf.attention(*dev[0])
    results = [None] * len(dev)

    def work(i):
        outs = [cf.attention(*dev[i]) for _ in range(25)]
        cp.cuda.get_current_stream().synchronize()
        results[i] = outs

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(dev))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (q, k, v), outs in zip(host, results):
        ref = reference.attention(q, k, v)
        for out in outs:
            _close(cp.asnumpy(out), ref, np.float16)


def test_fast_path_follows_the_arrays_device(rng, cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = _qkv(rng)
    with cp.cuda.Device(1):
        qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
        cf.attention(qd, kd, vd)       # cached on device 1
    with cp.cuda.Device(0):
        out = cf.attention(qd, kd, vd)  # current device 0: the full path switches to 1
    assert out.device.id == 1
    _close(cp.asnumpy(out), reference.attention(q, k, v), BF16)


MEMORY_CASES = [(np.float32 if dt == "fp32" else BF16, d, causal, dt)
                for dt in ("bf16", "fp32") for d in (64, 128) for causal in (False, True)]


@pytest.mark.parametrize("dtype,d,causal", [c[:3] for c in MEMORY_CASES],
                         ids=[f"{c[3]}-hd{c[1]}-{'causal' if c[2] else 'full'}" for c in MEMORY_CASES])
def test_memory_of_one_call_is_outputs_and_small_buffers(rng, cp, dtype, d, causal):
    """Forward: out + lse; backward: dq, dk, dv + D + a float32 dQ accumulator. Nothing N x N:
    the score matrix here (1 x 8 x 1024 x 1024 float32, 32 MiB) is 8-16x the allowance."""
    from cupyflash import _bench

    b, s, h = 1, 1024, 8
    q, k, v = (cp.asarray(rng.standard_normal((b, s, h, d)).astype(dtype)) for _ in range(3))
    peak, kept, _ = _bench.measure_memory(lambda: cf.attention(q, k, v, causal=causal, return_lse=True))
    lse_bytes = b * h * s * 4
    assert kept == peak <= _round_up(q.nbytes) + _round_up(lse_bytes)
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    dout = cp.asarray(rng.standard_normal(out.shape).astype(dtype))
    peak, kept, _ = _bench.measure_memory(
        lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=causal))
    assert kept <= 3 * _round_up(q.nbytes)
    assert peak <= 3 * _round_up(q.nbytes) + _round_up(lse_bytes) + _round_up(b * s * h * d * 4)


@pytest.mark.parametrize("d,kind", [(128, "1hqk"), (128, "11qk"), (96, "1hqk"), (64, "11qk")],
                         ids=["hd128-1hqk", "hd128-11qk", "hd96-1hqk", "hd64-11qk"])
def test_memory_of_bias_backward_is_dbias_only(rng, cp, monkeypatch, d, kind):
    """With a dbias kernel (forced here; by default where the Hopper dbias kernel covers the call,
    in deterministic mode and when the float32 accumulator does not fit), a bf16 bias summed over
    the batch (1hqk) or batch and heads (11qk): the backward holds dq, dk, dv + D + the dQ
    accumulator + dbias, no float32 copy of dbias (a float32 accumulator, 2x dbias, would
    exceed the allowance). hd 128 runs the
    Hopper main kernel on an H100 / H200, hd 96 and 64-with-11qk exercise the other routes."""
    from cupyflash import _bench
    from cupyflash.gpu.tuning import TUNING

    monkeypatch.setattr(TUNING, "dbias_kernel", True)
    b, s, h = 2, 512, 4
    q, k, v, dout = (cp.asarray(rng.standard_normal((b, s, h, d)).astype(BF16)) for _ in range(4))
    shape = (1, h, s, s) if kind == "1hqk" else (1, 1, s, s)
    bias = cp.asarray(rng.standard_normal(shape).astype(BF16))
    out, lse = cf.attention(q, k, v, bias=bias, return_lse=True)
    peak, kept, _ = _bench.measure_memory(
        lambda: cf.attention_backward(dout, q, k, v, out, lse, bias=bias))
    grads = 3 * _round_up(q.nbytes)
    assert kept <= grads + _round_up(bias.nbytes)
    assert peak <= grads + _round_up(bias.nbytes) + _round_up(b * h * s * 4) \
        + _round_up(b * s * h * d * 4)


def test_bias_backward_without_room_for_the_float32_accumulator(rng, cp):
    """A pool limit that leaves room for the gradients and dbias but not for a float32 copy of
    dbias: the backward takes flash_bwd_dbias instead of failing, and gives the same dbias (to
    float32 rounding order) as the accumulator path."""
    b, s, h, d = 2, 512, 4, 128
    q, k, v, dout = (cp.asarray(rng.standard_normal((b, s, h, d)).astype(BF16)) for _ in range(4))
    bias = cp.asarray(rng.standard_normal((1, h, s, s)).astype(BF16))
    out, lse = cf.attention(q, k, v, bias=bias, return_lse=True)
    want = cf.attention_backward(dout, q, k, v, out, lse, bias=bias)
    room = 3 * _round_up(q.nbytes) + _round_up(bias.nbytes) + _round_up(b * h * s * 4) \
        + _round_up(b * s * h * d * 4) + (1 << 20)
    assert room < _round_up(bias.size * 4) + 3 * _round_up(q.nbytes) + _round_up(bias.nbytes)
    pool = cp.cuda.MemoryPool()   # a fresh pool for the call alone (no fragments of earlier tests)
    pool.set_limit(size=room)
    with cp.cuda.using_allocator(pool.malloc):
        got = cf.attention_backward(dout, q, k, v, out, lse, bias=bias)
        cp.cuda.Device().synchronize()
    assert pool.total_bytes() <= room
    for w, x, y in zip(("dq", "dk", "dv", "dbias"), got, want):
        x, y = cp.asnumpy(x).astype(np.float32), cp.asnumpy(y).astype(np.float32)
        assert np.isfinite(x).all(), w
        np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2 * np.abs(y).max(), err_msg=w)


def _round_up(nbytes, unit=512):
    """CuPy's pool hands out multiples of 512 bytes."""
    return -(-nbytes // unit) * unit
