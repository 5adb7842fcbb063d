"""float64 on the GPU: the portable kernels' f64_t instantiations (DMMA, double accumulators)
against an extended-precision reference (tests/gpu/xref.py: numpy.longdouble, exact products).

Criterion (docs/semantics.md §9), for out, lse, dq, dk, dv and dbias:

    max|got − ref| <= 2 · max|naive − ref| + 1e-13 · max(1, max|ref|)

where ref is the longdouble computation and naive the plain float64 CuPy computation
(gpu_util.naive_attention with float64 accumulation: matmul, softmax, matmul, and the backward
by hand), both from the same float64 inputs. Launcher-level tests poison every output with NaN
before the call; API-level tests check that a CuPy float64 call never leaves the device and
that NumPy float64 inputs under device="auto" run on the GPU. Inputs are fresh random normal
draws (CUPYFLASH_SEED replays one). ``pytest -s`` prints each case's errors.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

import gpu_util  # noqa: E402  (skips without CuPy)
from gpu_util import cp  # noqa: E402
import xref  # noqa: E402

import cupyflash as cf  # noqa: E402
from cupyflash import _checks  # noqa: E402

F64 = np.float64
FLOOR = 1e-13


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _nan(shape, dtype=F64):
    return cp.full(shape, cp.nan, dtype)


def _h(x):
    return cp.asnumpy(x).astype(F64)


def check(what, got, ref, naive):
    """The module's criterion for one output; got / naive float64 (NumPy), ref longdouble.
    Returns (error, naive error, bound) for the case's printed line."""
    got = np.asarray(got, F64)
    naive = np.asarray(naive, F64)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten or NaN-producing)"
    dead = np.isneginf(ref)
    np.testing.assert_array_equal(np.isneginf(got), dead, f"{what}: -inf pattern")
    live = ~dead
    if not live.any():
        return 0.0, 0.0, 0.0
    err = float(np.abs(got[live] - ref[live]).max())
    nerr = float(np.abs(naive[live] - ref[live]).max())
    bound = 2 * nerr + FLOOR * max(1.0, float(np.abs(ref[live]).max()))
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e} (plain float64 CuPy: {nerr:.3e})"
    return err, nerr, bound


def _report(case, rows):
    print(f"{case}: " + "  ".join(f"{w} {e:.1e}/{n:.1e}" for w, (e, n, _) in rows.items()))


def _keep(sq, sk, causal, window, bottom_right=True):
    wl, wr = (-1, -1) if window is None else tuple(-1 if x is None else x for x in window)
    if causal:
        wr = 0
    return gpu_util.keep_mask(sq, sk, wl, wr, bottom_right)


def run_dense(rng, b, sq, sk, h, hk, d, dv=None, *, causal=False, window=None, softcap=0.0,
              alibi=False, bias=None, bias_dtype=F64, mask=None, deterministic=False,
              backward=True, repeats=1, case=""):
    """Forward and backward through the launchers (fwd.forward, bwd.backward) with NaN-poisoned
    outputs, against xref and the plain float64 computation. ``bias``: a bias shape (4-D);
    ``mask``: a boolean mask (NumPy, broadcastable to (b, h, sq, sk))."""
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    dv = d if dv is None else dv
    qn, kn = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hk, d))
    vn, don = rng.standard_normal((b, sk, hk, dv)), rng.standard_normal((b, sq, h, dv))
    q, k, v, dout = (cp.asarray(x) for x in (qn, kn, vn, don))
    bias_n = bias_d = None
    if bias is not None:
        bias_n = (rng.standard_normal(bias) * 2).astype(bias_dtype)
        bias_d = cp.asarray(bias_n)
    slopes = rng.uniform(0.01, 0.3, (b, h)) if alibi else None
    dims = _checks.check_qkv(q, k, v)
    opts = _checks.make_options(dims, cp, causal=causal, window=window, bias=bias_d,
                                mask=None if mask is None else cp.asarray(mask),
                                softcap=softcap or None, alibi_slopes=slopes,
                                deterministic=deterministic, dtype=F64)
    out, lse = _nan((b, sq, h, dv)), _nan((b, h, sq))
    name = gpu_fwd.forward(q, k, v, out, lse, opts)
    cp.cuda.get_current_stream().synchronize()
    assert "f64" in name, name

    scale = 1.0 / math.sqrt(d)
    keep, diag = _keep(sq, sk, causal, window)
    keep = np.broadcast_to(keep, (b, h, sq, sk))
    if mask is not None:
        keep = keep & np.broadcast_to(mask, (b, h, sq, sk))
    bias4 = None if bias_n is None else bias_n.astype(F64)
    ref = xref.attention(qn, kn, vn, don if backward else None, scale=scale, keep=keep,
                         bias=bias4, softcap=softcap, slopes=slopes, diag=diag, xp=cp)
    naive = gpu_util.naive_attention(q, k, v, dout if backward else None, cp.float64, scale,
                                     keep, None if bias4 is None else cp.asarray(bias4), softcap,
                                     None if slopes is None else cp.asarray(slopes), diag,
                                     bias_dtype, acc=cp.float64)
    rows = {"out": check(f"{name} out", _h(out), ref[0], _h(naive[0])),
            "lse": check(f"{name} lse", _h(lse), ref[1], _h(naive[1]))}
    dead = np.isneginf(np.asarray(ref[1], F64))
    assert (_h(out).transpose(0, 2, 1, 3)[dead] == 0).all(), "rows that see nothing must give 0"
    if not backward:
        _report(case or name, rows)
        return name, None
    results = []
    for _ in range(repeats):
        grads = [_nan(x.shape) for x in (q, k, v)]
        dbias = None if bias_d is None else _nan(bias_d.shape, bias_dtype)
        bname = gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, dbias=dbias)
        cp.cuda.get_current_stream().synchronize()
        results.append([_h(g) for g in grads] + ([] if dbias is None else [_h(dbias)]))
    assert "f64" in bname, bname
    for other in results[1:]:
        for w, x, y in zip(("dq", "dk", "dv", "dbias"), results[0], other):
            assert np.array_equal(x, y), f"{bname}: {w} differs between runs (deterministic)"
    for i, (w, g) in enumerate(zip(("dq", "dk", "dv", "dbias"), results[0])):
        r, n = ref[2 + i], naive[2 + i]
        if w == "dbias":
            r, n = np.asarray(r).reshape(g.shape), _h(n).reshape(g.shape)
            if bias_dtype != F64:   # a float32 bias: dbias rounded once to float32
                tol = float(np.abs(np.asarray(r, F64)).max()) * 2.0**-23 + FLOOR
                err = float(np.abs(g - np.asarray(r, F64)).max())
                assert err <= tol, f"{bname} dbias (float32): {err:.3e} > {tol:.3e}"
                rows[w] = (err, 0.0, tol)
                continue
        else:
            n = _h(n)
        rows[w] = check(f"{bname} {w}", g, r, n)
    assert (results[0][0].transpose(0, 2, 1, 3)[dead] == 0).all(), "dq of rows that see nothing"
    _report(case or f"{name} / {bname}", rows)
    return name, bname


# ----------------------------------------------------------------------------------------------
# the grid: every head dim, FlashAttention's awkward seqlens, causal and not
# ----------------------------------------------------------------------------------------------
HEAD_DIMS = (32, 40, 64, 96, 128, 256)
SEQLENS = ((1, 1), (113, 203), (128, 217), (256, 512), (1023, 1024))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"hd{d}" for d in HEAD_DIMS])
def test_grid(rng, d, sq, sk, causal):
    hk = 1 if d in (40, 96, 256) else 2    # GQA (2 query heads per kv head) on half the dims
    run_dense(rng, 1, sq, sk, 2, hk, d, causal=causal, case=f"grid hd{d} {sq}x{sk} causal={causal}")


# ----------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------
OPTIONS = {
    "gqa_6_2": dict(h=6, hk=2),
    "mqa": dict(h=4, hk=1, causal=True),
    "window": dict(window=(32, 16)),
    "window_left_causal": dict(window=(40, None), causal=True),
    "softcap": dict(softcap=7.5),
    "alibi": dict(alibi=True, causal=True),
    "softcap_alibi_window": dict(softcap=3.0, alibi=True, window=(64, 8)),
    "deterministic": dict(deterministic=True, repeats=2),
    "dv_256_d64": dict(d=64, dv=256),      # the forward in two 128-column launches
    "dv_200_d256": dict(d=256, dv=200, causal=True),
    "dv_32_d160": dict(d=160, dv=32),
}


@pytest.mark.parametrize("opt", list(OPTIONS), ids=list(OPTIONS))
def test_options(rng, opt):
    kw = dict(OPTIONS[opt])
    h, hk, d = kw.pop("h", 2), kw.pop("hk", 2), kw.pop("d", 64)
    run_dense(rng, 2, 173, 301, h, hk, d, case=f"option {opt}", **kw)


BIASES = {   # (shape, dtype, extra options)
    "bhqk": ("bhqk", F64, {}),
    "1hqk_causal": ("1hqk", F64, dict(causal=True)),
    "b11k_key_padding": ("b11k", F64, {}),
    "bh1k_rows_broadcast": ("bh1k", F64, {}),
    "bhq1_zero_grad": ("bhq1", F64, {}),
    "bhqk_float32_bias": ("bhqk", np.float32, {}),
    "1hqk_deterministic": ("1hqk", F64, dict(deterministic=True, repeats=2)),
    "11qk_gqa_hd128": ("11qk", F64, dict(hk=1, d=128)),
}


def _bias_shape(kind, b, h, sq, sk):
    return tuple(n if c in "bhqk"[i] else 1 for i, (c, n) in enumerate(zip(kind, (b, h, sq, sk))))


@pytest.mark.parametrize("kind", list(BIASES), ids=list(BIASES))
def test_bias_dbias(rng, kind):
    shape, bdt, kw = BIASES[kind]
    kw = dict(kw)
    b, h, hk, d, sq, sk = 2, 2, kw.pop("hk", 2), kw.pop("d", 64), 150, 260
    run_dense(rng, b, sq, sk, h, hk, d, bias=_bias_shape(shape, b, h, sq, sk), bias_dtype=bdt,
              case=f"bias {kind}", **kw)


def test_mask(rng):
    b, h, sq, sk = 2, 2, 97, 211
    mask = rng.random((b, 1, sq, sk)) > 0.3
    mask[0, 0, 5] = False                    # a row that sees nothing
    run_dense(rng, b, sq, sk, h, 2, 64, mask=mask, bias=(b, h, sq, sk), case="mask + bias")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 256], ids=["hd64", "hd256"])
def test_varlen(rng, d, causal):
    """Packed sequences (one launch set) against xref sequence by sequence; NaN-poisoned."""
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    lens_q, lens_k = [1, 300, 0, 77, 513], [5, 301, 9, 0, 400]
    h, hk = 4, 2
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    tq, tk = int(cq[-1]), int(ck[-1])
    qn, kn = rng.standard_normal((tq, h, d)), rng.standard_normal((tk, hk, d))
    vn, don = rng.standard_normal((tk, hk, d)), rng.standard_normal((tq, h, d))
    q, k, v, dout = (cp.asarray(x)[None] for x in (qn, kn, vn, don))
    dims = _checks.Dims(len(lens_q), tq, tk, h, hk, d, d)
    opts = _checks.make_options(dims, cp, causal=causal, dtype=F64)
    out, lse = _nan((1, tq, h, d)), _nan((h, tq))
    cqd, ckd = cp.asarray(cq, cp.int32), cp.asarray(ck, cp.int32)
    name = gpu_fwd.forward_varlen(q, k, v, cqd, ckd, max(lens_q), max(lens_k), out, lse, opts)
    grads = [_nan(x.shape) for x in (q, k, v)]
    bname = gpu_bwd.backward_varlen(dout, q, k, v, out, lse, cqd, ckd, max(lens_q), max(lens_k),
                                    *grads, opts)
    cp.cuda.get_current_stream().synchronize()
    assert "f64" in name and "f64" in bname, (name, bname)
    got = [_h(out[0]), _h(lse)] + [_h(g[0]) for g in grads]
    assert not any(np.isnan(x).any() for x in got), "unwritten varlen rows"
    scale = 1.0 / math.sqrt(d)
    for i in range(len(lens_q)):
        sq_, sk_ = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        nq, nk = lens_q[i], lens_k[i]
        if nq == 0 or nk == 0:   # no queries: nothing to check but zero dk / dv; no keys: out 0
            if nk and not nq:
                assert (got[3][sk_] == 0).all() and (got[4][sk_] == 0).all()
            if nq and not nk:
                assert (got[0][sq_] == 0).all() and np.isneginf(got[1][:, sq_]).all()
            continue
        keep, diag = _keep(nq, nk, causal, None)
        a = [x[None] for x in (qn[sq_], kn[sk_], vn[sk_], don[sq_])]
        ref = xref.attention(*a, scale=scale, keep=keep, diag=diag, xp=cp)
        naive = gpu_util.naive_attention(*(cp.asarray(x) for x in a), cp.float64, scale, keep,
                                         acc=cp.float64)
        what = f"{name} seq {i} ({nq}x{nk})"
        rows = {"out": check(f"{what} out", got[0][sq_], ref[0][0], _h(naive[0][0])),
                "lse": check(f"{what} lse", got[1][:, sq_], ref[1][0], _h(naive[1][0]))}
        for j, w in enumerate(("dq", "dk", "dv")):
            part = got[2 + j][sq_ if w == "dq" else sk_]
            rows[w] = check(f"{what} {w}", part, ref[2 + j][0], _h(naive[2 + j][0]))
        _report(f"varlen hd{d} causal={causal} seq {i} {nq}x{nk}", rows)


# ----------------------------------------------------------------------------------------------
# the public API: no host round trip, NumPy inputs on the GPU
# ----------------------------------------------------------------------------------------------
class _NoGet(cp.ndarray):
    """A CuPy array whose copy to the host fails: ``get`` (what cupy.asnumpy calls) raises."""

    def get(self, *args, **kwargs):
        raise AssertionError("a float64 GPU call copied an array to the host")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cupy_float64_stays_on_device(rng, monkeypatch, layout):
    """A CuPy float64 call (forward, backward, with a bias) runs the f64 kernels: no array goes
    to the host (cupy.asnumpy and .get raise) and the CPU implementation is not called."""
    from cupyflash import cpu

    def refuse(*a, **k):
        raise AssertionError("the CPU implementation ran a CuPy float64 call")

    b, s, h, d = 2, 129, 3, 64
    shape = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
    q, k, v, do = (cp.asarray(rng.standard_normal(shape)).view(type=_NoGet) for _ in range(4))
    bias = cp.asarray(rng.standard_normal((1, h, s, s))).view(type=_NoGet)
    monkeypatch.setattr(cpu, "forward", refuse)
    monkeypatch.setattr(cpu, "backward", refuse)
    monkeypatch.setattr(cp, "asnumpy", lambda *a, **k: refuse())
    out, lse = cf.attention(q, k, v, causal=True, layout=layout, return_lse=True)
    grads = cf.attention_backward(do, q, k, v, out, lse, causal=True, layout=layout)
    out_b, vjp = cf.attention_vjp(q, k, v, bias=bias, layout=layout)
    grads_b = vjp(do)
    monkeypatch.undo()
    assert out.dtype == F64 and lse.dtype == F64 and all(g.dtype == F64 for g in grads)
    assert isinstance(out, cp.ndarray) and len(grads_b) == 4
    to_bshd = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 2, 1, 3))
    qn, kn, vn, don = (to_bshd(_h(x.view(type=cp.ndarray))) for x in (q, k, v, do))
    keep, diag = _keep(s, s, True, None)
    ref = xref.attention(qn, kn, vn, don, scale=d ** -0.5, keep=keep, diag=diag, xp=cp)
    for w, got, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:5])):
        err = float(np.abs(to_bshd(_h(got)) - np.asarray(r, F64)).max())
        assert err < 1e-12, f"{w}: {err:.3e}"


def test_numpy_float64_runs_on_the_gpu(rng, monkeypatch):
    """NumPy float64 inputs with device="auto" run the GPU kernels (as other dtypes do) and come
    back as NumPy float64; the CPU implementation is not called."""
    from cupyflash import cpu

    def refuse(*a, **k):
        raise AssertionError("the CPU implementation ran a NumPy float64 call with a GPU present")

    monkeypatch.setattr(cpu, "forward", refuse)
    monkeypatch.setattr(cpu, "backward", refuse)
    q, k, v, do = (rng.standard_normal((1, 200, 2, 96)) for _ in range(4))
    out, lse = cf.attention(q, k, v, return_lse=True, window=(50, 10))
    dq, dk, dv = cf.attention_backward(do, q, k, v, out, lse, window=(50, 10))
    assert all(isinstance(x, np.ndarray) and x.dtype == F64 for x in (out, lse, dq, dk, dv))
    keep, diag = _keep(200, 200, False, (50, 10))
    ref = xref.attention(q, k, v, do, scale=96 ** -0.5, keep=keep, diag=diag, xp=cp)
    for w, got, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert float(np.abs(got - np.asarray(r, F64)).max()) < 1e-12, w


def test_forced_hopper_kernel_refuses_float64(rng):
    """kernel="sm90" names why it cannot take float64 (the Hopper kernels are 16-bit / float32)."""
    from cupyflash.gpu import fwd as gpu_fwd
    if gpu_util.compute_capability() != 90:
        pytest.skip("compute capability 9.0 only")
    q = cp.asarray(rng.standard_normal((1, 64, 2, 64)))
    opts = _checks.make_options(_checks.check_qkv(q, q, q), cp, dtype=F64)
    with pytest.raises(ValueError, match="float64"):
        gpu_fwd.forward(q, q, q, cp.empty_like(q), cp.empty((1, 2, 64)), opts, kernel="sm90")
