"""GPU bias / mask / dbias and native varlen (the GENERAL kernels) against the float64 reference.

Launcher-level tests (cupyflash.gpu.fwd.forward / forward_varlen, cupyflash.gpu.bwd.backward /
backward_varlen) with every output poisoned with NaN before the call, and a few API-level ones.

Criterion (docs/semantics.md §9, as tests/gpu/test_gpu_forward.py and test_gpu_backward.py):
- float16 / bfloat16: max|x − ref| <= 2·max|x_naive − ref| + floor·max(1, max|ref|) for out, lse,
  dq, dk, dv, dbias, where x_naive is the materialized computation in the input dtype (matmuls
  round to the dtype, softmax in float32, P and dS rounded to the dtype before their products;
  the bias added in float32 as given; dbias summed in float32 and rounded to the bias's dtype);
  floor 1e-4 (float16) / 1e-3 (bfloat16) (lse: 1e-4, absolute), or FlashAttention's rounding
  floor where larger (gpu_util.grad_tolerance). The dense gradients' |x − ref| is taken less
  |given − ref| element by element, given the float64 gradients of a backward handed the
  forward's stored out (check_grad): the error out's rounding puts into D = rowsum(dO ∘ out),
  the same for every backward given that out.
- float32 (3xTF32): out and lse norm-wise relative error <= 1e-5; gradients (dbias included)
  max|x − ref| <= 5e-5·max(1, max|ref|) (docs/backward.md).
Rows that attend to nothing: out 0, lse -inf, dq 0. Inputs, bias and dout are fresh random
normal draws; masks are random with fully masked rows and batch entries planted.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

import gpu_util  # noqa: E402  (skips without CuPy)
from gpu_util import BF16, DTYPES, FLOOR, cp, hopper_only  # noqa: E402
from gpu_util import naive_attention as _naive  # noqa: E402

import cupyflash as cf  # noqa: E402
from cupyflash import _checks, reference  # noqa: E402

hopper = hopper_only
F32 = np.float32


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def _draw(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _nan_like(shape, dtype):
    return cp.full(shape, cp.nan, cp.float32).astype(dtype)


def bias_shape(kind, b, h, sq, sk):
    """The bias patterns of the issue (NumPy broadcasting: missing leading dims are 1)."""
    return {"bhqk": (b, h, sq, sk),        # pair bias
            "1hqk": (1, h, sq, sk),        # relative-position bias shared over the batch
            "b11k": (b, 1, 1, sk),         # key padding
            "b1qk": (b, 1, sq, sk),
            "bh1k": (b, h, 1, sk),         # per-head key bias, broadcast over rows
            "11qk": (1, 1, sq, sk),
            "bhq1": (b, h, sq, 1),         # constant along keys: dbias is exactly 0
            "qk": (sq, sk),
            "k": (sk,),
            "1111": (1, 1, 1, 1)}[kind]


def make_bias(rng, shape, dtype, layout="contig"):
    """(NumPy values, CuPy array) of a bias; layout "keys_strided": keys not contiguous;
    "row_padded" / "row_padded8": contiguous keys, rows 2 / 8 elements longer than s_k (a view;
    the padding is NaN)."""
    vals = (rng.standard_normal(shape) * 2).astype(dtype)
    if layout == "keys_strided" and len(shape) >= 2:
        buf = cp.asarray(np.ascontiguousarray(np.swapaxes(vals, -1, -2)))   # [..., sk, sq] storage
        return vals, cp.swapaxes(buf, -1, -2)
    if layout in ("row_padded", "row_padded8"):
        pad = 8 if layout == "row_padded8" else 2
        buf = cp.full(shape[:-1] + (shape[-1] + pad,), cp.nan, cp.float32).astype(dtype)
        buf[..., :shape[-1]] = cp.asarray(vals)
        return vals, buf[..., :shape[-1]]
    return vals, cp.asarray(vals)


def make_mask(rng, kind, b, h, sq, sk):
    """Boolean masks with fully masked rows planted (True = attend)."""
    if kind == "pad":          # (b, 1, 1, sk) key padding; batch 0 has no valid key at all
        lens = rng.integers(1, sk + 1, size=b)
        lens[0] = 0
        return (np.arange(sk)[None, :] < lens[:, None])[:, None, None, :]
    if kind == "rand2d":       # (sq, sk); rows 0 and sq // 2 see nothing
        m = rng.random((sq, sk)) > 0.3
        m[0] = False
        m[sq // 2] = False
        return m
    if kind == "full":         # (b, h, sq, sk)
        m = rng.random((b, h, sq, sk)) > 0.5
        m[-1, -1, -1] = False
        return m
    if kind == "rows":         # (1, 1, sq, 1): every other row sees nothing
        return (np.arange(sq) % 2 == 0)[None, None, :, None]
    raise ValueError(kind)


def _keep(sq, sk, causal, window, bottom_right=True):
    i = np.arange(sq)[:, None]
    diag = i + (sk - sq) if bottom_right else i
    j = np.arange(sk)[None, :]
    wl, wr = (-1, -1) if window is None else window
    if causal:
        wr = 0
    keep = np.ones((sq, sk), bool)
    if wl >= 0:
        keep &= j >= diag - wl
    if wr >= 0:
        keep &= j <= diag + wr
    return keep, diag[:, 0]


# ----------------------------------------------------------------------------------------------
# naive computation in the input dtype (CuPy float32 math on dtype-rounded values)
# ----------------------------------------------------------------------------------------------
def _h(x):
    return cp.asnumpy(x).astype(np.float64)


def check_out_lse(dtype_name, got_out, got_lse, ref_out, ref_lse, naive_out=None, naive_lse=None,
                  what=""):
    """The forward criterion (module docstring); got_* / ref_* NumPy float64, same shapes."""
    assert not np.isnan(got_out).any(), f"{what}: NaN in out (unwritten or NaN-producing)"
    assert not np.isnan(got_lse).any(), f"{what}: NaN in lse"
    dead = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(got_lse), dead, f"{what}: lse -inf pattern")
    live = ~dead
    err_out = np.abs(got_out - ref_out).max() if got_out.size else 0.0
    err_lse = np.abs(got_lse[live] - ref_lse[live]).max() if live.any() else 0.0
    if dtype_name == "float32":
        rel = np.linalg.norm(got_out - ref_out) / max(np.linalg.norm(ref_out), 1e-30)
        assert rel <= 1e-5, f"{what}: out relative error {rel:.3g}"
        rl = np.linalg.norm(got_lse[live] - ref_lse[live]) / max(np.linalg.norm(ref_lse[live]), 1.0)
        assert rl <= 1e-5, f"{what}: lse relative error {rl:.3g}"
        return
    n_out = np.abs(naive_out - ref_out).max() if got_out.size else 0.0
    n_lse = np.abs(naive_lse[live] - ref_lse[live]).max() if live.any() else 0.0
    tol_out = 2 * n_out + FLOOR[dtype_name]
    tol_lse = 2 * n_lse + 1e-4
    assert err_out <= tol_out, f"{what}: out err {err_out:.3g} > {tol_out:.3g} (naive {n_out:.3g})"
    assert err_lse <= tol_lse, f"{what}: lse err {err_lse:.3g} > {tol_lse:.3g} (naive {n_lse:.3g})"


def check_grad(dtype_name, w, got, ref, naive=None, given=None):
    """The gradient criterion (module docstring) for ``got`` against the float64 ``ref``. 16-bit:
    ``given``, the float64 gradient of a backward handed the forward's stored out (D = rowsum(dO
    ∘ out)), adds |given − ref| to the bound element by element: the part of the error that out's
    rounding puts into every backward given it (a dbias element of a key-only bias sums it over
    ~2000 rows: docs/hopper.md)."""
    assert not np.isnan(got).any(), f"NaN in {w} (unwritten or NaN-producing)"
    dev = np.abs(got - ref)
    sc = max(1.0, np.abs(ref).max() if ref.size else 0.0)
    if dtype_name == "float32":
        err = dev.max() if got.size else 0.0
        assert err <= 5e-5 * sc, f"{w}: error {err:.3g} > 5e-5 * {sc:.3g}"
        return
    if given is not None:
        dev = dev - np.abs(given - ref)
    err = dev.max() if got.size else 0.0
    n_err = np.abs(naive - ref).max() if got.size else 0.0
    tol = gpu_util.grad_tolerance(dtype_name, ref, n_err)
    where = ""
    if err > tol:   # the worst element: its value, reference (and given-out one) and naive value
        i = np.unravel_index(dev.argmax(), got.shape)
        where = f"at {tuple(int(x) for x in i)}: got {got[i]:.6g}, ref {ref[i]:.6g}, naive {naive[i]:.6g}"
        if given is not None:
            where += f", given-out ref {given[i]:.6g}"
    what = "err beyond the given-out part" if given is not None else "err"
    assert err <= tol, f"{w}: {what} {err:.3g} > {tol:.3g} (naive {n_err:.3g}, scale {sc:.3g}) {where}"


# ----------------------------------------------------------------------------------------------
# dense: bias and mask, forward and backward
# ----------------------------------------------------------------------------------------------
def run_dense(rng, dtype_name, b, sq, sk, h, hk, d, *, bias=None, bias_dtype=None,
              bias_layout="contig", mask=None, causal=False, window=None, softcap=0.0,
              alibi=False, backward=True, deterministic=False, repeats=1, kernel="portable",
              expect_fwd="_gen", bwd_kernel=None, expect_bwd=("_gen",)):
    """Forward (``kernel``; its variant name must end with ``expect_fwd``) and backward
    (``bwd_kernel``: None = the planner's choice; its name must contain each of ``expect_bwd``)
    against the reference; returns the backward's variant name (the forward's without
    backward)."""
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    dtype = DTYPES[dtype_name]
    bias_dtype = dtype if bias_dtype is None else np.dtype(bias_dtype)
    qn, kn, vn = _draw(rng, (b, sq, h, d), dtype), _draw(rng, (b, sk, hk, d), dtype), \
        _draw(rng, (b, sk, hk, d), dtype)
    don = _draw(rng, (b, sq, h, d), dtype)
    q, k, v, dout = (cp.asarray(x) for x in (qn, kn, vn, don))
    bias_n = bias_d = mask_n = None
    if bias is not None:
        bias_n, bias_d = make_bias(rng, bias_shape(bias, b, h, sq, sk), bias_dtype, bias_layout)
    if mask is not None:
        mask_n = make_mask(rng, mask, b, h, sq, sk)
    slopes = rng.uniform(0.01, 0.3, (b, h)).astype(np.float32) if alibi else None
    dims = _checks.check_qkv(q, k, v)
    opts = _checks.make_options(dims, cp, causal=causal, window=window, bias=bias_d,
                                mask=None if mask_n is None else cp.asarray(mask_n),
                                softcap=softcap or None, alibi_slopes=slopes,
                                deterministic=deterministic)
    out = _nan_like((b, sq, h, d), dtype)
    lse = cp.full((b, h, sq), cp.nan, cp.float32)
    name = gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kernel)
    cp.cuda.get_current_stream().synchronize()
    assert name.endswith(expect_fwd), name

    scale = 1.0 / math.sqrt(d)
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap or None,
              bias=None if bias_n is None else bias_n.astype(np.float64), mask=mask_n,
              alibi_slopes=slopes)
    ref_out, ref_lse = reference.attention(qn, kn, vn, return_lse=True, **kw)
    keep, diag = _keep(sq, sk, causal, window)
    keep = keep if mask_n is None else keep & np.broadcast_to(mask_n.reshape(
        (1,) * (4 - mask_n.ndim) + mask_n.shape), (b, h, sq, sk))
    bias4 = None
    if bias_n is not None:
        bias4 = cp.asarray(bias_n.astype(np.float32).reshape((1,) * (4 - bias_n.ndim) + bias_n.shape))
    # (the naive backward's D from the kernel's out, which the backward is given: gpu_util)
    naive = _naive(q, k, v, dout if backward else None, dtype, scale, keep, bias4, softcap,
                   None if slopes is None else cp.asarray(slopes), diag, bias_dtype, o_saved=out)
    check_out_lse(dtype_name, _h(out), _h(lse), ref_out, ref_lse, _h(naive[0]), _h(naive[1]),
                  what=name)
    dead = np.isneginf(ref_lse)
    assert (_h(out).transpose(0, 2, 1, 3)[dead] == 0).all(), "rows that see nothing must give 0"
    if not backward:
        return name

    results = []
    for _ in range(repeats):
        grads = [_nan_like(x.shape, dtype) for x in (q, k, v)]
        dbias = None if bias_d is None else _nan_like(opts.bias.shape, bias_dtype)
        bname = gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, dbias=dbias,
                                  kernel=bwd_kernel)
        cp.cuda.get_current_stream().synchronize()
        results.append([_h(x) for x in grads] + ([] if dbias is None else [_h(dbias)]))
    assert all(e in bname for e in expect_bwd), (bname, expect_bwd)
    for other in results[1:]:
        for w, x, y in zip(("dq", "dk", "dv", "dbias"), results[0], other):
            assert np.array_equal(x, y, equal_nan=True), f"{bname}: {w} differs between runs"
    refs = reference.attention_backward(don, qn, kn, vn, **kw)
    # 16-bit: the float64 gradients of a backward given this out (D = rowsum(dO ∘ out) from the
    # stored out, as the kernels' and the naive's D: o_saved), for check_grad's bound
    givens = (None,) * 4 if dtype_name == "float32" else \
        reference.attention_backward(don, qn, kn, vn, out=_h(out), **kw)
    got = results[0]
    assert (got[0].transpose(0, 2, 1, 3)[dead] == 0).all(), "rows that see nothing: dq must be 0"
    names = ("dq", "dk", "dv", "dbias")
    for i, (w, g) in enumerate(zip(names, got)):
        ref = refs[i]
        if w == "dbias":
            ref = ref.reshape(g.shape)
        nv = None if dtype_name == "float32" else _h(naive[2 + i]).reshape(g.shape)
        given = None if givens[i] is None else givens[i].reshape(g.shape)
        check_grad(dtype_name, f"{bname} {w}", g, ref, nv, given)
    return bname


BIAS_KINDS = ["bhqk", "1hqk", "b11k", "b1qk", "bhq1", "qk", "k", "1111"]


@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_bias_patterns_fwd_bwd(rng, dtype, kind):
    run_dense(rng, dtype, 2, 113, 203, 4, 2, 64, bias=kind)


@pytest.mark.parametrize("kind", ["bhqk", "1hqk", "b11k"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bias_hd128_causal(rng, dtype, kind):
    run_dense(rng, dtype, 2, 157, 131, 4, 1, 128, bias=kind, causal=True)


@pytest.mark.parametrize("bias_dtype,layout", [("float32", "contig"), ("float16", "contig"),
                                               ("bfloat16", "keys_strided"),
                                               ("float32", "keys_strided")],
                         ids=["f32_bias", "f16_bias_cast", "keys_strided", "f32_keys_strided"])
def test_bias_dtypes_and_strides_bf16(rng, bias_dtype, layout):
    dt = BF16 if bias_dtype == "bfloat16" else bias_dtype
    run_dense(rng, "bfloat16", 2, 97, 130, 4, 2, 59, bias="1hqk", bias_dtype=dt, bias_layout=layout)


@pytest.mark.parametrize("mask", ["pad", "rand2d", "full", "rows"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mask_patterns(rng, dtype, mask):
    run_dense(rng, dtype, 2, 101, 167, 4, 2, 64, mask=mask)


@pytest.mark.parametrize("opt", ["causal", "window", "softcap_alibi", "gqa_mqa"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_bias_mask_with_options(rng, dtype, opt):
    kw = {"causal": dict(causal=True), "window": dict(window=(40, 7)),
          "softcap_alibi": dict(softcap=6.0, alibi=True), "gqa_mqa": dict()}[opt]
    hk = 1 if opt == "gqa_mqa" else 2
    run_dense(rng, dtype, 2, 150, 97, 4, hk, 96, bias="b1qk", mask="pad", **kw)


@pytest.mark.parametrize("sq,sk", [(1, 61), (61, 1), (1, 1), (257, 129)])
def test_bias_awkward_lengths(rng, sq, sk):
    run_dense(rng, "bfloat16", 1, sq, sk, 2, 2, 32, bias="bhqk", mask="rand2d" if sq > 1 else None,
              causal=sq > sk)


@hopper
@pytest.mark.parametrize("kind", ["bhqk", "1hqk", "b11k", "b1qk", "qk", "k"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bias_hopper(rng, dtype, d, kind):
    """The Hopper kernel's BIAS variant (forced) on each broadcast pattern with a unit key
    stride; the portable backward runs on its out / lse (kernel="portable")."""
    bname = run_dense(rng, dtype, 2, 257, 200, 4, 2, d, bias=kind, kernel="sm90",
                      expect_fwd="_bias", bwd_kernel="portable")
    assert bname.endswith("_gen"), bname


@hopper
@pytest.mark.parametrize("opt", ["causal", "window", "softcap", "mqa", "f32_bias", "f16_bias",
                                 "strided", "seqlens"])
def test_bias_hopper_options(rng, opt):
    kw = {"causal": dict(causal=True), "window": dict(window=(50, 9)),
          "softcap": dict(softcap=6.0, causal=True), "f32_bias": dict(bias_dtype="float32"),
          "f16_bias": dict(bias_dtype="float16"), "strided": dict(bias_layout="row_padded")}.get(opt, {})
    b, sq, sk, h, hk = 2, 257, 200, 4, 2
    if opt == "mqa":
        h, hk = 6, 1
    if opt == "seqlens":
        sq, sk = 1, 130
    expect = "_bias32" if opt in ("f32_bias", "f16_bias") else "_bias"
    bname = run_dense(rng, "bfloat16", b, sq, sk, h, hk, 128, bias="bhqk", kernel="sm90",
                      expect_fwd=expect, bwd_kernel="portable", **kw)
    assert bname.endswith("_gen"), bname


# ---- the Hopper backward's BIAS variant (dbias on the Hopper kernel) -------------------------
@hopper
@pytest.mark.parametrize("kind", ["bhqk", "1hqk", "b11k", "b1qk", "bh1k", "11qk", "qk", "k"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("path", ["default", "accumulator"])
def test_bias_hopper_backward(rng, monkeypatch, path, dtype, d, kind):
    """Each broadcast pattern (dbias stored, summed over rows, atomically over batch / heads),
    GQA 4 / 2, s_q prime, s_k even, a partial last key tile; the bias in q's dtype. A bias with
    its query dimension (400-byte rows) is staged by TMA (BIAS_TMA), the others loaded. dbias
    two ways: the launcher's default (flash_bwd_dbias_sm90 for a bias with whole query and key
    dimensions, checked by a spy) and the Hopper main kernel's float32 accumulator
    (DBIAS_KERNEL off)."""
    from cupyflash.gpu.tuning import TUNING
    if path == "accumulator":
        monkeypatch.setattr(TUNING, "dbias_kernel", False)
    ran = _spy_dbias_sm90(monkeypatch)
    bname = run_dense(rng, dtype, 2, 257, 200, 4, 2, d, bias=kind, kernel="sm90", expect_fwd="_bias",
                      bwd_kernel="sm90", expect_bwd=("bwd90_", "_bias16"))
    assert bname.endswith("_tma") == ("q" in kind), bname
    want = 1 if path == "default" and "q" in kind and "k" in kind else 0
    assert len(ran) == want and all(r is not None and r.startswith("dbias90_") for r in ran), \
        (path, kind, ran)


@hopper
@pytest.mark.parametrize("opt", ["f32_bias", "f16_bias_cast", "causal", "causal_f32",
                                 "window", "mqa", "batch1_store", "batch1_1hqk", "sq1",
                                 "sq_lt_sk", "sq_gt_sk", "row_padded", "row_padded8", "auto"])
@pytest.mark.parametrize("d", [64, 128])
def test_bias_hopper_backward_options(rng, d, opt):
    """float32 bias (and a float16 one, taken as a float32 copy), causal / window (skipped and
    partially masked tiles), MQA (one work tile sums the group's heads into the same dbias
    element), batch 1 (plain stores), one query row, s_q != s_k both ways, padded bias rows, and
    the planner's default choice (kernel=None) on this device."""
    b, sq, sk, h, hk, kind = 2, 257, 200, 4, 2, "bhqk"
    kw, bias32 = {}, False
    if opt == "f32_bias":
        kw, bias32, kind = dict(bias_dtype="float32"), True, "1hqk"
    elif opt == "f16_bias_cast":
        kw, bias32 = dict(bias_dtype="float16"), True
    elif opt == "causal":
        kw, kind = dict(causal=True), "1hqk"
    elif opt == "causal_f32":
        kw, bias32, kind = dict(causal=True, bias_dtype="float32"), True, "b11k"
    elif opt == "window":
        kw, kind = dict(window=(50, 9)), "b1qk"
    elif opt == "mqa":
        h, hk, kind = 6, 1, "b1qk"
    elif opt == "batch1_store":
        b = 1
    elif opt == "batch1_1hqk":
        b, kind = 1, "1hqk"
    elif opt == "sq1":
        sq, sk = 1, 130
    elif opt == "sq_lt_sk":
        sq, sk, kw = 61, 386, dict(causal=True)
    elif opt == "sq_gt_sk":
        sq, sk, kw = 389, 66, dict(causal=True)
    elif opt in ("row_padded", "row_padded8"):   # 404-byte rows: loaded; 416: TMA, NaN past s_k
        kw = dict(bias_layout=opt)
    dtype = "float16" if opt in ("mqa", "sq_gt_sk") else "bfloat16"
    expect = "_bias32" if bias32 else "_bias16"
    run_dense(rng, dtype, b, sq, sk, h, hk, d, bias=kind, kernel="sm90",
              expect_fwd="_bias32" if bias32 else "_bias",
              bwd_kernel=None if opt == "auto" else "sm90", expect_bwd=("bwd90_", expect), **kw)


@hopper
def test_bias_hopper_backward_falls_back_where_it_cannot(rng):
    """Odd s_k (dbias key pairs), a mask, deterministic mode and a key-broadcast bias run the
    portable backward under kernel=None; kernel="sm90" says why it cannot."""
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    q, k, v, do = (cp.asarray(_draw(rng, (1, 64, 2, 64), BF16)) for _ in range(4))

    def call(kv_len, kernel, **kw):
        kk, vv = k[:, :kv_len], v[:, :kv_len]
        opts = _checks.make_options(_checks.check_qkv(q, kk, vv), cp, **kw)
        out, lse = cp.empty_like(q), cp.empty((1, 2, 64), cp.float32)
        gpu_fwd.forward(q, kk, vv, out, lse, opts)
        grads = [cp.empty_like(x) for x in (q, kk, vv)]
        dbias = None if opts.bias is None else cp.empty(opts.bias.shape, opts.bias.dtype)
        return gpu_bwd.backward(do, q, kk, vv, out, lse, *grads, opts, dbias=dbias,
                                 kernel=kernel)

    odd = dict(bias=cp.asarray(_draw(rng, (1, 2, 64, 63), BF16)))
    masked = dict(bias=cp.asarray(_draw(rng, (1, 2, 64, 64), BF16)),
                  mask=cp.asarray(rng.random((64, 64)) > 0.3))
    det = dict(bias=cp.asarray(_draw(rng, (1, 2, 64, 64), BF16)), deterministic=True)
    keyb = dict(bias=cp.asarray(_draw(rng, (1, 2, 64, 1), BF16)))
    mask_only = dict(mask=cp.asarray(rng.random((64, 64)) > 0.3))
    for kv_len, kw, why in ((63, odd, "odd seqlen_k"), (64, masked, "mask"), (64, mask_only, "mask"),
                            (64, det, "deterministic"), (64, keyb, "key stride 0")):
        assert call(kv_len, None, **kw).endswith("_gen")
        with pytest.raises(ValueError, match=why):
            call(kv_len, "sm90", **kw)


@hopper
def test_bias_hopper_falls_back_where_it_cannot(rng):
    """Odd s_k (no column pairs) and a mask run the portable kernel under kernel="auto", and
    kernel="sm90" says why it cannot."""
    from cupyflash.gpu import fwd as gpu_fwd
    q, k, v = (cp.asarray(_draw(rng, (1, 64, 2, 64), BF16)) for _ in range(3))
    k, v = k[:, :63], v[:, :63]
    bias = cp.asarray(_draw(rng, (1, 2, 64, 63), BF16))
    opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, bias=bias)
    out, lse = cp.empty_like(q), cp.empty((1, 2, 64), cp.float32)
    assert gpu_fwd.forward(q, k, v, out, lse, opts).endswith("_gen")
    with pytest.raises(ValueError, match="bias layout"):
        gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")


DBIAS_KERNEL_CASES = {   # id: (dtype, d, bias kind, run_dense keywords)
    "hopper-bf16-128-1hqk-causal": ("bfloat16", 128, "1hqk", dict(causal=True)),
    "hopper-f16-64-11qk": ("float16", 64, "11qk", {}),
    "hopper-bf16-64-bhqk-window": ("bfloat16", 64, "bhqk", dict(window=(50, 9))),
    "portable-bf16-96-b1qk-softcap-alibi-mask": ("bfloat16", 96, "b1qk",
                                                 dict(softcap=6.0, alibi=True, mask="pad")),
    "portable-f16-128-qk-mqa": ("float16", 128, "qk", {}),
    "portable-f32-64-1hqk-det": ("float32", 64, "1hqk", dict(deterministic=True, repeats=2)),
}


@pytest.mark.parametrize("case", list(DBIAS_KERNEL_CASES))
def test_dbias_kernel_forced(rng, monkeypatch, case):
    """flash_bwd_dbias for every eligible bias (DBIAS_KERNEL forced; by default it runs in
    deterministic mode and when the float32 accumulator does not fit): after the Hopper main
    kernel (even s_k, hd 64 / 128) and after the portable one (odd s_k), with masks and score
    modifications, summed over batch, heads or both. (DBIAS_SM90 off: flash_bwd_dbias_sm90 has
    its own cases below.)"""
    from cupyflash.gpu.tuning import TUNING
    monkeypatch.setattr(TUNING, "dbias_kernel", True)
    monkeypatch.setattr(TUNING, "dbias_sm90", False)
    dtype, d, kind, kw = DBIAS_KERNEL_CASES[case]
    h, hk = (6, 1) if "mqa" in case else (4, 2)
    if case.startswith("hopper"):
        if gpu_util.compute_capability() != 90:
            pytest.skip("the Hopper kernel needs compute capability 9.0")
        kw = dict(kw, kernel="sm90", expect_fwd="_bias", bwd_kernel="sm90", expect_bwd=("bwd90_",))
        run_dense(rng, dtype, 2, 157, 200, h, hk, d, bias=kind, **kw)
    else:
        run_dense(rng, dtype, 2, 157, 131, h, hk, d, bias=kind, **kw)


DBIAS_SM90_CASES = {   # id: (dtype, d, bias kind, h, h_k, run_dense keywords)
    # after the Hopper main kernel (bias in q's type, even s_k)
    "bf16-128-1hqk-causal-main90": ("bfloat16", 128, "1hqk", 4, 2,
                                    dict(causal=True, kernel="sm90", expect_fwd="_bias",
                                         bwd_kernel="sm90", expect_bwd=("bwd90_",))),
    "f16-64-11qk": ("float16", 64, "11qk", 4, 2, dict(expect_bwd=("bwd90_",))),
    "bf16-64-bhqk-window": ("bfloat16", 64, "bhqk", 4, 2,
                            dict(window=(50, 9), expect_bwd=("bwd90_",))),
    "f16-128-b1qk-mqa": ("float16", 128, "b1qk", 6, 1, dict(expect_bwd=("bwd90_",))),
    "bf16-128-1hqk-causal-short-keys": ("bfloat16", 128, "1hqk", 4, 2,
                                        dict(causal=True, expect_bwd=("bwd90_",))),
    # deterministic mode (the portable main kernel, then this one), repeated: bit-identical
    "bf16-128-1hqk-det": ("bfloat16", 128, "1hqk", 4, 2, dict(deterministic=True, repeats=2)),
    # a float32 bias with 16-bit q (deterministic: dbias is not its own float32 accumulator)
    "bf16-128-1hqk-f32bias-det": ("bfloat16", 128, "1hqk", 4, 2,
                                  dict(bias_dtype=np.float32, deterministic=True, repeats=2)),
    "f16-64-b1qk-f32bias-window-det": ("float16", 64, "b1qk", 4, 2,
                                       dict(bias_dtype=np.float32, window=(70, 3),
                                            deterministic=True)),
}


def _spy_dbias_sm90(monkeypatch):
    """Records what each gpu.dbias_sm90.launch returned (None: it fell back)."""
    from cupyflash.gpu import dbias_sm90
    ran, launch = [], dbias_sm90.launch

    def spy(*a, **kw):
        ran.append(launch(*a, **kw))
        return ran[-1]
    monkeypatch.setattr(dbias_sm90, "launch", spy)
    return ran


@hopper
@pytest.mark.parametrize("case", list(DBIAS_SM90_CASES))
def test_dbias_sm90_forced(rng, monkeypatch, case):
    """flash_bwd_dbias_sm90 (DBIAS_KERNEL and DBIAS_SM90 forced) against the reference, as
    test_dbias_kernel_forced does for flash_bwd_dbias: summed over batch, heads or both, causal
    (s_q < s_k and s_q > s_k), window, GQA / MQA, 16-bit and float32 biases, ragged s_q = 157,
    s_k = 200 (64 for "short-keys"); the spy checks this kernel ran (not the fallback)."""
    from cupyflash.gpu.tuning import TUNING
    monkeypatch.setattr(TUNING, "dbias_kernel", True)
    monkeypatch.setattr(TUNING, "dbias_sm90", True)
    ran = _spy_dbias_sm90(monkeypatch)
    dtype, d, kind, h, hk, kw = DBIAS_SM90_CASES[case]
    sk = 64 if "short-keys" in case else 200
    run_dense(rng, dtype, 2, 157, sk, h, hk, d, bias=kind, **kw)
    assert ran and all(r is not None and r.startswith("dbias90_") for r in ran), ran


@hopper
@pytest.mark.parametrize("kind, causal", [("1hqk", False), ("bhqk", True), ("11qk", False)])
def test_dbias_sm90_matches_portable(rng, monkeypatch, kind, causal):
    """The Hopper and the portable dbias kernels on the same call: the same float32 sums up to
    the order of the products' additions, so at most a unit in the last place of bf16 apart."""
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    from cupyflash.gpu.tuning import TUNING
    monkeypatch.setattr(TUNING, "dbias_kernel", True)
    ran = _spy_dbias_sm90(monkeypatch)
    b, s, h, d = 3, 296, 4, 128   # ragged (296 = 2·128 + 40); rows of 592 bytes, as TMA needs 16
    q, k, v, dout = (cp.asarray(_draw(rng, (b, s, h, d), BF16)) for _ in range(4))
    bias = cp.asarray(_draw(rng, bias_shape(kind, b, h, s, s), BF16))
    opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, bias=bias, causal=causal)
    out, lse = cp.empty_like(q), cp.empty((b, h, s), cp.float32)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    got = []
    for on in (True, False):
        monkeypatch.setattr(TUNING, "dbias_sm90", on)
        dbias = _nan_like(bias.shape, BF16)
        gpu_bwd.backward(dout, q, k, v, out, lse, *(cp.empty_like(x) for x in (q, k, v)), opts,
                          dbias=dbias)
        got.append(_h(dbias))
    assert len(ran) == 1 and ran[0] is not None and ran[0].startswith("dbias90_"), ran
    assert not np.isnan(got[0]).any()
    scale = np.abs(got[1]).max()
    assert np.abs(got[0] - got[1]).max() <= 2 ** -7 * scale, np.abs(got[0] - got[1]).max() / scale


@pytest.mark.parametrize("kind", ["1hqk", "b11k", "qk", "bhqk"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dbias_deterministic_bit_identical(rng, dtype, kind):
    run_dense(rng, dtype, 3, 129, 211, 4, 2, 64, bias=kind, causal=True, deterministic=True,
              repeats=3)


def test_api_dbias_in_the_bias_shape(rng):
    q, k, v = (cp.asarray(_draw(rng, (2, 77, 4, 64), BF16)) for _ in range(3))
    bias = cp.asarray(_draw(rng, (4, 1, 77), np.float32))        # (h, 1, s_k): broadcast over rows
    out, vjp = cf.attention_vjp(q, k, v, bias=bias, causal=True)
    dout = cp.asarray(_draw(rng, out.shape, BF16))
    dq, dk, dv, dbias = vjp(dout)
    assert dbias.shape == (4, 1, 77) and dbias.dtype == np.float32
    ref = reference.attention_backward(*(cp.asnumpy(x) for x in (dout, q, k, v)), causal=True,
                                       bias=cp.asnumpy(bias))[3]
    assert np.abs(cp.asnumpy(dbias) - ref).max() <= 2e-2 * max(1, np.abs(ref).max())


def test_api_numpy_bias_and_mask_run_on_the_gpu(rng):
    q, k, v = (_draw(rng, (1, 50, 2, 32), np.float16) for _ in range(3))
    mask = rng.random((50, 50)) > 0.5
    bias = rng.standard_normal(50)                      # float64: a float32 copy on the GPU
    out = cf.attention(q, k, v, mask=mask, bias=bias, device="gpu")
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    ref = reference.attention(q, k, v, mask=mask, bias=bias)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=4e-3, atol=4e-3)


# ----------------------------------------------------------------------------------------------
# varlen
# ----------------------------------------------------------------------------------------------
def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


LENS = {
    "mixed": ((5, 1, 0, 130, 64, 257, 3), (7, 65, 3, 129, 0, 300, 3)),
    "same": ((64, 200, 1), (64, 200, 1)),
    "long_short": ((1000, 17, 1), (1000, 31, 40)),
}


def run_varlen(rng, dtype_name, lens_q, lens_k, h, hk, d, *, causal=False, window=None,
               softcap=0.0, alibi=False, backward=True, deterministic=False, repeats=1,
               kernel="auto", bwd_kernel="auto", expect_bwd=None, causal_align="bottom_right"):
    """Forward (``kernel``) and backward (``bwd_kernel``; its name must start with
    ``expect_bwd`` when given) against the reference, sequence by sequence; returns the
    forward's variant name."""
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    dtype = DTYPES[dtype_name]
    cq, ck = _cu(lens_q), _cu(lens_k)
    tq, tk, nseq = int(cq[-1]), int(ck[-1]), len(lens_q)
    qn, kn, vn = _draw(rng, (tq, h, d), dtype), _draw(rng, (tk, hk, d), dtype), \
        _draw(rng, (tk, hk, d), dtype)
    don = _draw(rng, (tq, h, d), dtype)
    q, k, v, dout = (cp.asarray(x)[None] for x in (qn, kn, vn, don))
    slopes = rng.uniform(0.01, 0.3, (nseq, h)).astype(np.float32) if alibi else None
    dims = _checks.Dims(nseq, tq, tk, h, hk, d, d)
    opts = _checks.make_options(dims, cp, causal=causal, window=window, softcap=softcap or None,
                                alibi_slopes=slopes, deterministic=deterministic,
                                causal_align=causal_align)
    out = _nan_like((1, tq, h, d), dtype)
    lse = cp.full((h, tq), cp.nan, cp.float32)
    cqd, ckd = cp.asarray(cq), cp.asarray(ck)
    name = gpu_fwd.forward_varlen(q, k, v, cqd, ckd, max(lens_q), max(lens_k), out, lse, opts,
                               kernel=kernel)
    cp.cuda.get_current_stream().synchronize()
    assert name.endswith("_varlen"), name
    got_out, got_lse = _h(out[0]), _h(lse)
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any(), "unwritten varlen rows"

    grads = None
    if backward:
        results = []
        for _ in range(repeats):
            gr = [_nan_like(x.shape, dtype) for x in (q, k, v)]
            bname = gpu_bwd.backward_varlen(dout, q, k, v, out, lse, cqd, ckd, max(lens_q),
                                             max(lens_k), *gr, opts, kernel=bwd_kernel)
            if expect_bwd is not None:
                assert bname.startswith(expect_bwd), bname
            # a Hopper backward of a packed call must be the VARLEN variant
            assert not bname.startswith("bwd90_") or "_varlen" in bname, bname
            cp.cuda.get_current_stream().synchronize()
            results.append([_h(x[0]) for x in gr])
        for other in results[1:]:
            for w, x, y in zip(("dq", "dk", "dv"), results[0], other):
                assert np.array_equal(x, y, equal_nan=True), f"varlen {w} differs between runs"
        grads = results[0]

    scale = 1.0 / math.sqrt(d)
    for i in range(nseq):
        sq_, sk_ = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if lens_q[i] == 0:
            continue
        what = f"{name} seq {i} ({lens_q[i]}x{lens_k[i]})"
        sl = None if slopes is None else slopes[i:i + 1]
        kw = dict(scale=scale, causal=causal, window=window, softcap=softcap or None,
                  alibi_slopes=sl)
        if causal_align != "bottom_right":
            kw["causal_align"] = causal_align
        if lens_k[i] == 0:   # no key: out 0, lse -inf, dq 0
            assert (got_out[sq_] == 0).all() and np.isneginf(got_lse[:, sq_]).all(), what
            if grads is not None:
                assert (grads[0][sq_] == 0).all(), what
            continue
        ref_out, ref_lse = reference.attention(qn[None, sq_], kn[None, sk_], vn[None, sk_],
                                               return_lse=True, **kw)
        keep, diag = _keep(lens_q[i], lens_k[i], causal, window,
                           bottom_right=causal_align == "bottom_right")
        naive = _naive(q[:, sq_], k[:, sk_], v[:, sk_], dout[:, sq_] if backward else None, dtype,
                       scale, keep, None, softcap, None if sl is None else cp.asarray(sl), diag)
        check_out_lse(dtype_name, got_out[sq_][None], got_lse[None, :, sq_], ref_out, ref_lse,
                      _h(naive[0]), _h(naive[1]), what)
        # the dense call on this sequence alone agrees to the same tolerance
        dense, dense_lse = cf.attention(q[:, sq_], k[:, sk_], v[:, sk_], return_lse=True,
                                        causal=causal, window=window, softcap=softcap or None,
                                        alibi_slopes=None if sl is None else cp.asarray(sl),
                                        causal_align=causal_align)
        diff = np.abs(got_out[sq_][None] - _h(dense)).max()
        tol = (2e-5 * max(1.0, np.abs(ref_out).max()) if dtype_name == "float32" else
               2 * np.abs(_h(naive[0]) - ref_out).max() + FLOOR[dtype_name])
        assert diff <= tol, f"{what}: varlen vs dense {diff:.3g} > {tol:.3g}"
        if grads is not None:
            refs = reference.attention_backward(don[None, sq_], qn[None, sq_], kn[None, sk_],
                                                vn[None, sk_], **kw)
            for j, (w, g, sl_) in enumerate(zip(("dq", "dk", "dv"), grads, (sq_, sk_, sk_))):
                nv = None if dtype_name == "float32" else _h(naive[2 + j])[0]
                check_grad(dtype_name, f"{what} {w}", g[sl_], refs[j][0], nv)
    if grads is not None:   # keys of sequences without queries: zero gradients
        for i in range(nseq):
            if lens_q[i] == 0 and lens_k[i]:
                sk_ = slice(ck[i], ck[i + 1])
                assert (grads[1][sk_] == 0).all() and (grads[2][sk_] == 0).all()
    return name


@pytest.mark.parametrize("lens", list(LENS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_varlen_mixed_lengths(rng, dtype, causal, lens):
    run_varlen(rng, dtype, *LENS[lens], 4, 2, 64, causal=causal)


@pytest.mark.parametrize("opt", ["window", "softcap", "alibi", "mqa_hd128"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_options(rng, dtype, opt):
    lens_q, lens_k = (33, 1, 190, 0, 77), (50, 9, 120, 5, 77)
    if opt == "mqa_hd128":
        run_varlen(rng, dtype, lens_q, lens_k, 4, 1, 128, causal=True)
    else:
        kw = {"window": dict(window=(20, 5)), "softcap": dict(softcap=4.0, causal=True),
              "alibi": dict(alibi=True, causal=True)}[opt]
        run_varlen(rng, dtype, lens_q, lens_k, 4, 2, 59, **kw)


HOPPER_LENS = ((5, 1, 0, 300, 64, 129, 3, 700), (7, 65, 3, 257, 0, 300, 3, 650))


@hopper
@pytest.mark.parametrize("opt", ["plain", "causal", "left_window", "window", "softcap", "mqa"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_hopper(rng, d, opt):
    """The Hopper kernel's VARLEN variant (forced): tiles that straddle sequence ends, empty
    sequences, sequences without keys, per-sequence causal alignment; the backward (portable)
    runs on its out / lse."""
    kw = {"plain": {}, "causal": dict(causal=True), "window": dict(window=(40, 7)),
          "softcap": dict(softcap=5.0, causal=True), "mqa": dict(causal=True)}.get(opt, {})
    if opt == "left_window":
        kw = dict(window=(-1, 0))   # the causal band spelled as a window
    name = run_varlen(rng, "bfloat16", *HOPPER_LENS, 4, 1 if opt == "mqa" else 2, d,
                      backward=d != 256, kernel="sm90", **kw)
    assert name.startswith("fwd90_") and name.endswith("_varlen"), name


@hopper
def test_varlen_hopper_float16_gqa(rng):
    name = run_varlen(rng, "float16", *LENS["mixed"], 6, 3, 128, causal=True, kernel="sm90")
    assert name.startswith("fwd90_"), name


# The Hopper backward's VARLEN variant (forced; its name is checked): tiles that straddle
# sequence ends in both q and k, sequences of length 0 and 1, without keys or without queries,
# primes, s_q != s_k per sequence (bottom-right and top-left causal), GQA / MQA, both head dims and
# 16-bit dtypes. Several key tiles per sequence (700 / 650 rows) and query tiles per step.
HOPPER_BWD_LENS = {
    "mixed": HOPPER_LENS,
    "primes": ((127, 131, 1, 257, 61, 0, 2), (127, 131, 1, 257, 61, 5, 0)),
}


@hopper
@pytest.mark.parametrize("opt", ["plain", "causal", "causal_top_left", "window", "gqa", "mqa"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_varlen_backward_hopper(rng, dtype, d, opt):
    kw = {"causal": dict(causal=True), "causal_top_left": dict(causal=True, causal_align="top_left"),
          "window": dict(window=(40, 7)), "gqa": dict(causal=True)}.get(opt, {})
    h, hk = {"gqa": (6, 2), "mqa": (4, 1)}.get(opt, (4, 2))
    lens = HOPPER_BWD_LENS["primes" if opt in ("gqa", "mqa") else "mixed"]
    run_varlen(rng, dtype, *lens, h, hk, d, bwd_kernel="sm90", expect_bwd="bwd90_", **kw)


@hopper
@pytest.mark.parametrize("opt", ["plain", "causal", "window", "mqa"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_backward_hopper_deterministic(rng, d, opt):
    """The deterministic VARLEN variant (forced): bit-identical over three calls (run_varlen's
    repeats) and within the criterion, per sequence."""
    kw = {"causal": dict(causal=True), "window": dict(window=(40, 7)),
          "mqa": dict(causal=True)}.get(opt, {})
    h, hk = (4, 1) if opt == "mqa" else (4, 2)
    lens = HOPPER_BWD_LENS["primes" if opt == "mqa" else "mixed"]
    name = (f"bwd90_bf16_d{d}_64x{64 if d == 256 else 128}{'_window' if kw else ''}"
            f"{'_kv2' if d == 64 else ''}{'_red' if d == 256 else ''}_varlen_det")
    run_varlen(rng, "bfloat16", *lens, h, hk, d, bwd_kernel="sm90", deterministic=True,
               repeats=3, expect_bwd=name, **kw)


@hopper
def test_varlen_backward_hopper_routing(rng):
    """auto takes the Hopper backward where it covers the call, the portable one elsewhere;
    kernel='sm90' names why it cannot run a call."""
    from cupyflash.gpu import bwd as gpu_bwd
    lens = ((33, 1, 190, 0, 77), (50, 9, 120, 5, 77))
    run_varlen(rng, "bfloat16", *lens, 4, 2, 128, causal=True, expect_bwd="bwd90_")
    run_varlen(rng, "bfloat16", *lens, 4, 2, 128, bwd_kernel="portable", expect_bwd="bwd_bf16")
    run_varlen(rng, "bfloat16", *lens, 4, 2, 64, deterministic=True,
               expect_bwd="bwd90_bf16_d64_64x128_kv2_varlen_det")
    run_varlen(rng, "bfloat16", *lens, 4, 2, 96, expect_bwd="bwd_bf16")
    with pytest.raises(ValueError, match="softcap"):
        run_varlen(rng, "bfloat16", *lens, 4, 2, 64, softcap=5.0, bwd_kernel="sm90")
    with pytest.raises(ValueError, match="kernel='x'"):
        gpu_bwd.backward_varlen(*([None] * 13), None, kernel="x")


def test_varlen_top_left_api(rng):
    lens_q, lens_k = (40, 3, 100), (20, 50, 100)
    cq, ck = _cu(lens_q), _cu(lens_k)
    q = _draw(rng, (cq[-1], 2, 64), BF16)
    k = _draw(rng, (ck[-1], 2, 64), BF16)
    v = _draw(rng, (ck[-1], 2, 64), BF16)
    out, lse = cf.attention_varlen(*(cp.asarray(x) for x in (q, k, v, cq, ck)), causal=True,
                                   causal_align="top_left", return_lse=True)
    out, lse = cp.asnumpy(out).astype(np.float64), cp.asnumpy(lse)
    for i in range(3):
        sq_, sk_ = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ro, rl = reference.attention(q[None, sq_], k[None, sk_], v[None, sk_], causal=True,
                                     causal_align="top_left", return_lse=True)
        assert np.abs(out[sq_] - ro[0]).max() < 2e-2
        live = np.isfinite(rl[0])
        assert (np.isneginf(lse[:, sq_]) == ~live).all()
        assert np.abs(lse[:, sq_][live] - rl[0][live]).max() < 2e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_deterministic_bit_identical(rng, dtype):
    run_varlen(rng, dtype, (300, 1, 0, 129), (257, 64, 9, 130), 4, 2, 64, causal=True,
               deterministic=True, repeats=3)


def test_varlen_api_backward_matches_reference(rng):
    lens_q, lens_k = (17, 0, 90), (30, 4, 60)
    cq, ck = _cu(lens_q), _cu(lens_k)
    q = _draw(rng, (cq[-1], 4, 64), np.float16)
    k = _draw(rng, (ck[-1], 2, 64), np.float16)
    v = _draw(rng, (ck[-1], 2, 64), np.float16)
    args = [cp.asarray(x) for x in (q, k, v, cq, ck)]
    out, lse = cf.attention_varlen(*args, causal=True, return_lse=True)
    dout = _draw(rng, out.shape, np.float16)
    dq, dk, dv = cf.attention_varlen_backward(cp.asarray(dout), *args[:3], out, lse, *args[3:],
                                              causal=True)
    for i in range(3):
        sq_, sk_ = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        refs = reference.attention_backward(dout[None, sq_], q[None, sq_], k[None, sk_],
                                            v[None, sk_], causal=True)
        for g, r, sl in zip((dq, dk, dv), refs[:3], (sq_, sk_, sk_)):
            np.testing.assert_allclose(cp.asnumpy(g[sl]).astype(np.float64), r[0], rtol=2e-2,
                                       atol=2e-2)
