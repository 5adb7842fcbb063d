"""GPU backward (cupyflash.gpu.bwd.backward) against the float64 reference.

out and lse come from the GPU forward (cupyflash.gpu.fwd.forward); dq, dk, dv are poisoned with
NaN before the call; inputs and dout are fresh random normal draws.

Criterion (docs/semantics.md §9, FlashAttention's own test), per gradient g in (dq, dk, dv):
- float16 / bfloat16: max|g − ref| <= 2 · max|g_naive − ref| + floor · max(1, max|ref|), where
  g_naive is the materialized backward done in the input dtype (every matmul takes dtype
  operands, accumulates in float32 and rounds its result to the dtype; softmax in float32, P
  and dS rounded to the dtype before their products; GQA group sums in float32), and the
  floor is 1e-4 (float16) / 1e-3 (bfloat16): a quarter ulp of 1 in each dtype.
- float32 (3xTF32 default): max|g − ref| <= 5e-5 · max(1, max|ref|); allow_tf32: 5e-3 · (same).
  Measured on the H200 (docs/backward.md): <= 1e-5 relative up to s = 256; up to 2.8e-5 at
  s_q, s_k ~ 1k (dK, dV sum ~1k query rows inside the tensor-core accumulator); the max(1, .)
  covers gradients that are zero in exact arithmetic (every row sees one key: dS = 0) where
  float32 rounding leaves ~1e-5.
Rows that see no key (lse = -inf) must give exactly zero dq; deterministic mode must give
bit-identical dq, dk, dv over three calls.

These tests force the portable main kernel (portable/bwd.cu), so it stays tested on a Hopper card too;
tests/gpu/test_gpu_backward_sm90.py runs the Hopper one (hopper/bwd.cu) on the cases it covers.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_util import (DTYPES, WINDOW_OPTION_SETS, alloc, cp, grad_tolerance, keep_mask,  # noqa: E402
                      naive_attention)

from cupyflash import reference  # noqa: E402
from cupyflash._options import Options  # noqa: E402


def _naive_bwd(q, k, v, do, dtype, scale, keep, softcap, alibi, diag):
    """(dq, dk, dv) of the materialized backward in `dtype` (gpu_util.naive_attention; see the
    module docstring)."""
    return naive_attention(q, k, v, do, dtype, scale, keep, None, softcap, alibi, diag)[2:5]


def run_case(rng, dtype_name, b, s_q, s_k, h, h_k, d, d_v=None, *, causal=False, window=None,
             bottom_right=True, softcap=0.0, alibi=None, scale=None, layout="bshd", pad=0,
             allow_tf32=False, deterministic=False, repeats=1, kernel="portable"):
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    d_v = d if d_v is None else d_v
    dtype = DTYPES[dtype_name]
    draw = lambda shape: rng.standard_normal(shape, dtype=np.float32).astype(dtype)  # noqa: E731
    qn, kn, vn = draw((b, s_q, h, d)), draw((b, s_k, h_k, d)), draw((b, s_k, h_k, d_v))
    don = draw((b, s_q, h, d_v))

    def dev(a, shape=None):
        x = alloc(a.shape if shape is None else shape, dtype, layout, pad)
        if a is not None:
            x[...] = cp.asarray(a)
        return x

    q, k, v, dout = dev(qn), dev(kn), dev(vn), dev(don)
    out = alloc((b, s_q, h, d_v), dtype, layout, pad)
    lse = cp.empty((b, h, s_q), cp.float32)

    wl, wr = (-1, -1) if window is None else window
    if causal:
        wr = 0
    scale_ = 1.0 / math.sqrt(d) if scale is None else scale
    slopes = None
    if alibi == "bh":
        slopes = rng.uniform(0.01, 0.5, (b, h)).astype(np.float32)
    elif alibi == "1h":
        slopes = rng.uniform(0.01, 0.5, (1, h)).astype(np.float32)
    opts = Options(scale=scale_, window_left=wl, window_right=wr, bottom_right=bottom_right,
                   softcap=softcap, alibi_slopes=None if slopes is None else cp.asarray(slopes),
                   allow_tf32=allow_tf32, deterministic=deterministic)
    gpu_fwd.forward(q, k, v, out, lse, opts)

    results = []
    for _ in range(repeats):
        grads = [alloc(x.shape, dtype, layout, pad) for x in (q, k, v)]
        nan = cp.asarray(np.full((), np.nan, np.float32)).astype(dtype)
        for gr in grads:
            gr[...] = nan
        name = gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, kernel=kernel)
        cp.cuda.get_current_stream().synchronize()
        results.append([cp.asnumpy(gr).astype(np.float64) for gr in grads])
    assert isinstance(name, str) and name
    if repeats > 1:
        for other in results[1:]:
            for w, x, y in zip("qkv", results[0], other):
                assert np.array_equal(x, y, equal_nan=True), f"{name}: d{w} differs between runs"
    got = results[0]

    ref = reference.attention_backward(
        don, qn, kn, vn, scale=scale_, window=(wl, wr), softcap=softcap or None,
        causal_align="bottom_right" if bottom_right else "top_left", bias=None, mask=None,
        alibi_slopes=None if slopes is None else np.broadcast_to(slopes, (b, h)))[:3]
    errs = [np.abs(g_ - r).max() for g_, r in zip(got, ref)]
    scales = [max(np.abs(r).max(), 1e-30) for r in ref]
    log = os.environ.get("CUPYFLASH_ERRLOG")   # one line per case: the measured errors
    if log:
        with open(log, "a") as f:
            f.write(f"{name} {dtype_name} b{b} sq{s_q} sk{s_k} h{h}/{h_k} d{d}/{d_v} "
                    f"w({wl},{wr}) br{int(bottom_right)} cap{softcap} alibi{alibi} "
                    f"{layout}{pad} det{int(deterministic)} | err "
                    + " ".join(f"{e:.3g}/{sc:.3g}" for e, sc in zip(errs, scales))
                    + " nan " + " ".join(str(int(np.isnan(g_).sum())) for g_ in got) + "\n")
    for w, g_ in zip("qkv", got):
        assert not np.isnan(g_).any(), f"{name}: NaN in d{w} (unwritten or NaN-producing)"
    dead = np.isneginf(cp.asnumpy(lse))                 # [b, h, s_q]
    assert (got[0].transpose(0, 2, 1, 3)[dead] == 0).all(), "rows that see no key: dq must be 0"
    if dtype_name == "float32":
        tol = 5e-3 if allow_tf32 else 5e-5
        for w, e, sc in zip("qkv", errs, scales):
            rel = e / max(1.0, sc)
            assert rel <= tol, f"{name}: d{w} error {e:.3g} / max(1, max|ref| {sc:.3g}) > {tol}"
    else:
        keep, diag = keep_mask(s_q, s_k, wl, wr, bottom_right)
        naive = _naive_bwd(cp.asarray(qn), cp.asarray(kn), cp.asarray(vn), cp.asarray(don),
                           dtype, scale_, keep, softcap,
                           None if slopes is None else cp.asarray(np.broadcast_to(slopes, (b, h))),
                           diag)
        n_errs = [np.abs(cp.asnumpy(n_).astype(np.float64) - r).max() for n_, r in zip(naive, ref)]
        if log:
            with open(log, "a") as f:
                f.write("    naive err " + " ".join(f"{e:.3g}" for e in n_errs) + "\n")
        for w, e, sc, n_err, r in zip("qkv", errs, scales, n_errs, ref):
            tol = grad_tolerance(dtype_name, r, n_err)
            assert e <= tol, f"{name}: d{w} err {e:.3g} > {tol:.3g} (naive {n_err:.3g}, max|ref| {sc:.3g})"
    return name


HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtype_headdim_grid(rng, dtype, d):
    run_case(rng, dtype, 2, 113, 203, 4, 2, d)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtype_headdim_grid_causal(rng, dtype, d):
    run_case(rng, dtype, 1, 203, 113, 2, 1, d, causal=True)


SEQLENS = [(1, 239), (113, 203), (1023, 1024), (1024, 1023)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SEQLENS)
@pytest.mark.parametrize("dtype,d", [("float16", 64), ("bfloat16", 128), ("float32", 64)])
def test_seqlens(rng, dtype, d, s_q, s_k, causal):
    run_case(rng, dtype, 1, s_q, s_k, 2, 1, d, causal=causal)


OPTION_SETS = {
    **WINDOW_OPTION_SETS,
    "softcap": dict(softcap=5.0),
    "alibi_bh": dict(alibi="bh"),
    "alibi_1h_causal": dict(alibi="1h", causal=True),
    "softcap_alibi_window": dict(softcap=8.0, alibi="bh", window=(60, 10)),
    "negative_scale": dict(scale=-0.1),
}


@pytest.mark.parametrize("opt", list(OPTION_SETS))
@pytest.mark.parametrize("dtype,d", [("bfloat16", 59), ("float16", 128), ("float32", 96)])
def test_options(rng, dtype, d, opt):
    run_case(rng, dtype, 2, 157, 211, 4, 2, d, **OPTION_SETS[opt])


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gqa_mqa(rng, dtype, h, h_k):
    run_case(rng, dtype, 2, 130, 190, h, h_k, 64, causal=True)


@pytest.mark.parametrize("d,d_v", [(64, 32), (40, 128), (128, 64), (17, 200)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_head_dim_v_differs(rng, dtype, d, d_v):
    run_case(rng, dtype, 1, 77, 130, 2, 1, d, d_v, causal=True)


@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 3), ("sstride", 0)])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_strided_views(rng, dtype, layout, pad):
    run_case(rng, dtype, 2, 150, 170, 4, 2, 64, causal=True, layout=layout, pad=pad)
    run_case(rng, dtype, 1, 70, 90, 2, 1, 96, 80, layout=layout, pad=pad)


@pytest.mark.parametrize("kernel", ["portable", None])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_long_sums(rng, causal, kernel):
    """dK / dV sum 4096 query rows: the tensor cores' float32 accumulation rounds toward zero, so
    the kernels add each step's product in fp32 (round to nearest); before that the portable
    kernel's dK reached 5.8e-5·max|ref| here (benchmarks/f32_bwd_accuracy.py). kernel=None: the
    planner's choice (the Hopper float32 backward on compute capability 9.0)."""
    run_case(rng, "float32", 1, 4096, 4096, 2, 1, 64, causal=causal, kernel=kernel)


def test_tf32_mode(rng):
    name = run_case(rng, "float32", 2, 100, 150, 2, 2, 128, allow_tf32=True)
    assert "tf32" in name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fully_masked_rows(rng, dtype):
    run_case(rng, dtype, 1, 300, 100, 2, 1, 64, causal=True)          # first 200 rows see nothing
    run_case(rng, dtype, 1, 260, 110, 2, 2, 64, window=(0, 0))
    run_case(rng, dtype, 1, 200, 100, 2, 2, 32, window=(5, 3), bottom_right=False)


@pytest.mark.parametrize("dtype,kw", [("bfloat16", dict(causal=True)), ("float16", dict()),
                                      ("float32", dict(window=(30, 20)))])
def test_deterministic_bit_identical(rng, dtype, kw):
    name = run_case(rng, dtype, 2, 333, 517, 8, 2, 64, deterministic=True, repeats=3, **kw)
    assert name


@pytest.mark.parametrize("dtype,kw", [("bfloat16", dict(causal=True)), ("float32", dict(window=(700, 90)))])
def test_deterministic_blocks_take_several_key_tiles(rng, dtype, kw):
    """Enough (kv head, batch) pairs that G = dq_slabs < key tiles: blocks add key tiles x, x + G,
    ... into one slab in order (the shapes above have a slab per key tile)."""
    from cupyflash.gpu import bwd as gpu_bwd, plan_bwd

    b, s_q, s_k, h = 4, 300, 1500, 16
    num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    plan = plan_bwd.plan_backward(dtype, b, s_q, s_k, h, h, 64, 64, scale=0.125,
                                  deterministic=True, num_sms=num_sms)
    plan = plan_bwd.with_dq_slabs(plan, gpu_bwd._resident_blocks(
        plan.variant, cp.cuda.runtime.getDevice(), num_sms))    # as the launcher plans it
    assert plan.grid[0] < -(-s_k // plan.variant.bn)
    run_case(rng, dtype, b, s_q, s_k, h, h, 64, deterministic=True, repeats=3, **kw)


def test_empty_and_zero_keys(rng):
    from cupyflash.gpu.bwd import backward
    opts = Options(scale=0.125)
    q = cp.asarray(rng.standard_normal((1, 5, 2, 64), dtype=np.float32)).astype(cp.float16)
    k = cp.empty((1, 0, 2, 64), cp.float16)
    dq = cp.full(q.shape, cp.nan, cp.float16)
    lse = cp.full((1, 2, 5), -cp.inf, cp.float32)
    backward(q, q, k, k, q, lse, dq, k.copy(), k.copy(), opts)
    assert (dq == 0).all()


@pytest.mark.parametrize("d,spec", [(64, "128,8,4,4,4,2,1"), (128, "64,8,2,4,2,2,1"),
                                    (64, "64,4,2,2,2,2,0"), (128, "64,8,2,4,2,1,0"),
                                    (128, "32,4,2,2,2,2,0")],
                         ids=["hd64-pair", "hd128-pair", "hd64-4warps", "hd128-1buf", "hd128-4warps"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_bwd_2d_other_tiles(rng, dtype, d, spec):
    """flash_bwd_2d tiles the planner does not pick on this GPU (lab/ab_bwd_portable.py's
    candidates: S with dP and dV with dK in one k loop, 4 warps, one Q / dO buffer), forced:
    causal GQA with a ragged end, and window + softcap + ALiBi."""
    from cupyflash.gpu import plan_bwd
    bm, nw, wms, wnkv, wmq, nbuf, pair = (int(x) for x in spec.split(","))
    for kw in (dict(causal=True), dict(window=(60, 10), softcap=5.0, alibi="bh")):
        auto = plan_bwd.plan_backward(dtype, 1, 64, 64, 1, 1, d, d, scale=1.0,
                                      window_right=10 if kw.get("window") else 0,
                                      softcap=kw.get("softcap", 0.0),
                                      has_alibi="alibi" in kw).variant
        v = auto.replace(bm=bm, nw=nw, wd=1, nbuf=nbuf, wms=wms, wnkv=wnkv, wmq=wmq, pair=bool(pair))
        v.check_2d()
        name = run_case(rng, dtype, 2, 150, 333, 4, 2, d, kernel=v, **kw)
        assert name == v.name
