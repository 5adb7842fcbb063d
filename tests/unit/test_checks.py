"""Every bad input raises before any work, with the argument's name in the message.

Pure validation: NumPy arrays on the CPU path (device="cpu"), no GPU needed.
"""
import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _checks as ck
from cupyflash._options import UNBOUNDED


def _qkv(rng, b=2, sq=5, sk=7, h=4, hk=2, d=8, dv=6, dtype=np.float32):
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, dv)).astype(dtype)
    return q, k, v


class FakeGpuArray:
    """Claims to live on a GPU (CUDA array interface) without one: must be refused when mixed."""

    def __init__(self, shape, typestr="<f4"):
        self.shape = shape
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (0, False),
                                         "version": 3, "strides": None}


def _bad(rng, **over):
    """Arguments of one attention call with ``over`` replacing some of them."""
    q, k, v = _qkv(rng)
    args = dict(q=q, k=k, v=v, device="cpu")
    args.update(over)
    return args


BAD_FORWARD = [
    # id, replacement(rng) -> kwargs override, exception type, argument named
    ("q-3d", lambda r: dict(q=r.standard_normal((2, 5, 4)).astype(np.float32)), ValueError, "q"),
    ("q-list", lambda r: dict(q=[[1.0]]), TypeError, "q"),
    ("k-batch", lambda r: dict(k=r.standard_normal((3, 7, 2, 8)).astype(np.float32)), ValueError, "k"),
    ("v-seqlen", lambda r: dict(v=r.standard_normal((2, 6, 2, 6)).astype(np.float32)), ValueError, "v"),
    ("v-heads", lambda r: dict(v=r.standard_normal((2, 7, 1, 6)).astype(np.float32)), ValueError, "v"),
    ("k-headdim", lambda r: dict(k=r.standard_normal((2, 7, 2, 9)).astype(np.float32)), ValueError, "k"),
    ("k-heads-not-dividing", lambda r: dict(k=r.standard_normal((2, 7, 3, 8)).astype(np.float32),
                                            v=r.standard_normal((2, 7, 3, 6)).astype(np.float32)), ValueError, "k"),
    ("q-headdim-257", lambda r: dict(q=r.standard_normal((2, 5, 4, 257)).astype(np.float32),
                                     k=r.standard_normal((2, 7, 2, 257)).astype(np.float32)), ValueError, "q"),
    ("q-headdim-0", lambda r: dict(q=np.empty((2, 5, 4, 0), np.float32),
                                   k=np.empty((2, 7, 2, 0), np.float32)), ValueError, "q"),
    ("v-headdim-300", lambda r: dict(v=r.standard_normal((2, 7, 2, 300)).astype(np.float32)), ValueError, "v"),
    ("q-int32", lambda r: dict(q=np.arange(2 * 5 * 4 * 8, dtype=np.int32).reshape(2, 5, 4, 8)), TypeError, "q"),
    ("k-mixed-dtype", lambda r: dict(k=r.standard_normal((2, 7, 2, 8)).astype(np.float16)), TypeError, "k"),
    ("v-complex", lambda r: dict(v=(r.standard_normal((2, 7, 2, 6)) * 1j).astype(np.complex64)), TypeError, "v"),
    ("bias-shape", lambda r: dict(bias=r.standard_normal((2, 4, 5, 6)).astype(np.float32)), ValueError, "bias"),
    ("bias-5d", lambda r: dict(bias=r.standard_normal((1, 2, 4, 5, 7)).astype(np.float32)), ValueError, "bias"),
    ("bias-int", lambda r: dict(bias=np.ones((7,), np.int32)), TypeError, "bias"),
    ("mask-float", lambda r: dict(mask=r.standard_normal((5, 7)).astype(np.float32)), TypeError, "mask"),
    ("mask-shape", lambda r: dict(mask=np.ones((3, 1, 1, 7), bool)), ValueError, "mask"),
    ("window-int", lambda r: dict(window=5), ValueError, "window"),
    ("window-below-minus-one", lambda r: dict(window=(-2, 0)), ValueError, "window"),
    ("window-float", lambda r: dict(window=(1.5, 2)), ValueError, "window"),
    ("window-triple", lambda r: dict(window=(1, 2, 3)), ValueError, "window"),
    ("causal-str", lambda r: dict(causal="yes"), TypeError, "causal"),
    ("causal-align", lambda r: dict(causal_align="left"), ValueError, "causal_align"),
    ("layout", lambda r: dict(layout="sbhd"), ValueError, "layout"),
    ("device", lambda r: dict(device="tpu"), ValueError, "device"),
    ("softcap-negative", lambda r: dict(softcap=-1.0), ValueError, "softcap"),
    ("softcap-str", lambda r: dict(softcap="1"), TypeError, "softcap"),
    ("scale-nan", lambda r: dict(scale=float("nan")), ValueError, "scale"),
    ("scale-str", lambda r: dict(scale="0.1"), TypeError, "scale"),
    ("alibi-shape", lambda r: dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
    ("alibi-bool", lambda r: dict(alibi_slopes=np.ones(4, bool)), TypeError, "alibi_slopes"),
    ("allow-tf32-str", lambda r: dict(allow_tf32="no"), TypeError, "allow_tf32"),
    ("k-gpu-mixed-with-numpy-q", lambda r: dict(k=FakeGpuArray((2, 7, 2, 8))), TypeError, "k"),
]


@pytest.mark.parametrize("make, exc, name", [c[1:] for c in BAD_FORWARD], ids=[c[0] for c in BAD_FORWARD])
def test_bad_forward_input_names_the_argument(rng, make, exc, name):
    args = _bad(rng, **make(rng))
    with pytest.raises(exc) as info:
        cf.attention(**args)
    message = str(info.value)
    assert message.startswith(f"{name}: got "), message
    assert "accepted:" in message


@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
def test_layout_bhsd_checks_in_its_own_order(rng, fn):
    # bhsd q (b, h, s, d) whose heads (dim 1) do not divide by k's heads.
    q = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 7, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 7, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^k: got 2 heads for 3 query heads"):
        if fn == "attention":
            cf.attention(q, k, v, layout="bhsd", device="cpu")
        elif fn == "attention_vjp":
            cf.attention_vjp(q, k, v, layout="bhsd", device="cpu")
        else:
            out = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
            cf.attention_backward(out, q, k, v, out, np.zeros((2, 3, 5), np.float32),
                                  layout="bhsd", device="cpu")


def _fwd(rng, **kw):
    q, k, v = _qkv(rng)
    out, lse = cf.attention(q, k, v, return_lse=True, device="cpu", **kw)
    return q, k, v, out, lse


BAD_BACKWARD = [
    ("dout-shape", lambda q, k, v, o, l: dict(dout=o[:, :-1]), ValueError, "dout"),
    ("dout-dtype", lambda q, k, v, o, l: dict(dout=o.astype(np.float64)), TypeError, "dout"),
    ("out-shape", lambda q, k, v, o, l: dict(out=o[..., :-1]), ValueError, "out"),
    ("lse-shape", lambda q, k, v, o, l: dict(lse=l[:, :, :-1]), ValueError, "lse"),
    ("lse-dtype", lambda q, k, v, o, l: dict(lse=l.astype(np.float16)), TypeError, "lse"),
    ("deterministic-int", lambda q, k, v, o, l: dict(deterministic=1), TypeError, "deterministic"),
]


@pytest.mark.parametrize("make, exc, name", [c[1:] for c in BAD_BACKWARD], ids=[c[0] for c in BAD_BACKWARD])
def test_bad_backward_input_names_the_argument(rng, make, exc, name):
    q, k, v, out, lse = _fwd(rng)
    args = dict(dout=rng.standard_normal(out.shape).astype(out.dtype), q=q, k=k, v=v, out=out,
                lse=lse, device="cpu")
    args.update(make(q, k, v, out, lse))
    with pytest.raises(exc) as info:
        cf.attention_backward(**args)
    assert str(info.value).startswith(f"{name}: got "), str(info.value)


def test_vjp_refuses_return_lse(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="^return_lse: got"):
        cf.attention_vjp(q, k, v, return_lse=True, device="cpu")


def _packed(rng, lens_q=(3, 4), lens_k=(5, 2)):
    q = rng.standard_normal((sum(lens_q), 4, 8)).astype(np.float32)
    k = rng.standard_normal((sum(lens_k), 2, 8)).astype(np.float32)
    v = rng.standard_normal((sum(lens_k), 2, 8)).astype(np.float32)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    return q, k, v, cu_q, cu_k


BAD_VARLEN = [
    ("cu-float", lambda cq, ck_: dict(cu_seqlens_q=cq.astype(np.float64)), TypeError, "cu_seqlens_q"),
    ("cu-bool", lambda cq, ck_: dict(cu_seqlens_q=np.array([0, 1, 1], bool)), TypeError, "cu_seqlens_q"),
    ("cu-int64-beyond-int32", lambda cq, ck_: dict(cu_seqlens_q=np.array([0, 3, 2**31 + 7], np.int64)),
     ValueError, "cu_seqlens_q"),
    ("cu-2d", lambda cq, ck_: dict(cu_seqlens_q=cq[None]), ValueError, "cu_seqlens_q"),
    ("cu-not-monotone", lambda cq, ck_: dict(cu_seqlens_k=np.array([0, 8, 7], np.int32)), ValueError, "cu_seqlens_k"),
    ("cu-last-not-total", lambda cq, ck_: dict(cu_seqlens_q=np.array([0, 3, 6], np.int32)), ValueError, "cu_seqlens_q"),
    ("cu-not-from-zero", lambda cq, ck_: dict(cu_seqlens_k=np.array([1, 5, 7], np.int32)), ValueError, "cu_seqlens_k"),
    ("cu-count-mismatch", lambda cq, ck_: dict(cu_seqlens_k=np.array([0, 7], np.int32)), ValueError, "cu_seqlens_k"),
    ("cu-list", lambda cq, ck_: dict(cu_seqlens_q=[0, 3, 7]), TypeError, "cu_seqlens_q"),
    ("cu-on-gpu-with-host-q", lambda cq, ck_: dict(cu_seqlens_q=FakeGpuArray((3,), "<i4")), TypeError, "cu_seqlens_q"),
    ("max-seqlen-too-small", lambda cq, ck_: dict(max_seqlen_q=2), ValueError, "max_seqlen_q"),
    ("q-4d", lambda cq, ck_: dict(q=np.zeros((1, 7, 4, 8), np.float32)), ValueError, "q"),
]


@pytest.mark.parametrize("make, exc, name", [c[1:] for c in BAD_VARLEN], ids=[c[0] for c in BAD_VARLEN])
def test_bad_varlen_input_names_the_argument(rng, make, exc, name):
    q, k, v, cu_q, cu_k = _packed(rng)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, device="cpu")
    args.update(make(cu_q, cu_k))
    with pytest.raises(exc) as info:
        cf.attention_varlen(**args)
    assert str(info.value).startswith(f"{name}: got "), str(info.value)


def test_gpu_device_without_gpu_is_refused(rng, monkeypatch):
    from cupyflash import _interop

    monkeypatch.setattr(_interop, "gpu_available", lambda: False)
    q, k, v = _qkv(rng)
    with pytest.raises(RuntimeError, match="^device: got"):
        cf.attention(q, k, v, device="gpu")


# ---- the pure pieces ----------------------------------------------------------------------------

@pytest.mark.parametrize("window, causal, expected", [
    (None, False, (UNBOUNDED, UNBOUNDED)),
    (None, True, (UNBOUNDED, 0)),
    ((3, None), False, (3, UNBOUNDED)),
    ((-1, 2), False, (UNBOUNDED, 2)),
    ((4, 2), True, (4, 0)),
    ([0, 0], False, (0, 0)),
], ids=["none", "causal", "left-only", "minus-one", "causal-overrides-right", "list"])
def test_window_normalization(window, causal, expected):
    assert ck.check_window(window, causal) == expected


def test_options_resolve_defaults():
    dims = ck.Dims(2, 5, 7, 4, 2, 16, 8)
    opts = ck.make_options(dims, np, causal=True, causal_align="top_left", softcap=None,
                           alibi_slopes=np.array([0.5, 0.25, 0.125, 1.0]))
    assert opts.scale == pytest.approx(0.25)
    assert opts.causal and not opts.bottom_right and opts.softcap == 0.0
    assert opts.alibi_slopes.shape == (1, 4) and opts.alibi_slopes.dtype == np.float64
    assert opts.diag_offset(5, 7) == 0
    assert ck.make_options(dims, np).diag_offset(5, 7) == 2


@pytest.mark.parametrize("shape", [(7,), (5, 1), (4, 1, 1), (2, 1, 5, 7), (1, 4, 5, 7), (2, 4, 5, 7)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bias_broadcast_is_a_view(rng, shape):
    dims = ck.Dims(2, 5, 7, 4, 2, 16, 8)
    bias = rng.standard_normal(shape).astype(np.float32)
    b4 = ck.broadcast_4d("bias", bias, dims, "float", ck.ACCEPTED_DTYPES)
    assert b4.ndim == 4 and np.shares_memory(b4, bias)
    np.testing.assert_array_equal(np.broadcast_to(b4, (2, 4, 5, 7)), np.broadcast_to(bias, (2, 4, 5, 7)))


def test_accepted_dtypes_include_bfloat16():
    assert np.dtype(ml_dtypes.bfloat16) in ck.KERNEL_DTYPES
