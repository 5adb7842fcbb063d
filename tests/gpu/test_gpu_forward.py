"""GPU forward kernel (cupyflash.gpu.fwd.forward) against the float64 reference.

Criterion (docs/semantics.md §9, FlashAttention's own test): for float16 / bfloat16 the max abs error of
out (and lse) vs reference.attention in float64 is at most 2x the max abs error of the naive
computation done in the input dtype (Q Kᵀ and P V as matmuls in the dtype, softmax in float32,
P rounded to the dtype, like PyTorch's naive attention), plus a floor: 1e-4 (float16) /
1e-3 (bfloat16) for out, 1e-4 for lse -- about a quarter ulp of a value of 1 in each dtype,
which only matters where the naive computation happens to be exact (e.g. one key).
float32 (3xTF32 default): norm-wise relative error ||out - ref|| / ||ref|| <= 1e-5 for out and
lse (allow_tf32: 5e-3 for both). The tensor cores' float32 accumulation truncates, so an O summed
in it alone erred 8e-6 at 1k keys, 3e-5 at 4k, 1.2e-4 at 16k on random inputs (H200,
benchmarks/f32_error_growth.py); every float32 kernel now adds each step's P V to O in fp32
(1.4-3.0e-6 at 4k keys, 5-10e-6 at 16k), and test_float32_long_sums holds them to 2e-5 over
8192 keys (docs/choices.md).
Outputs are poisoned with NaN first; inputs are fresh random normal draws.

These tests force the portable (mma.sync) kernel, so it stays tested on a Hopper card too, where
the planner would pick hopper/fwd.cu; tests/gpu/test_gpu_forward_sm90.py runs the same cases on that.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_util import (DTYPES, FLOOR, WINDOW_OPTION_SETS, alloc, cp, keep_mask,  # noqa: E402
                      naive_attention)

from cupyflash import reference  # noqa: E402
from cupyflash._options import Options  # noqa: E402

FLOOR_LSE = 1e-4


def _gpu():
    from cupyflash.gpu import fwd
    return fwd


def _naive(q, k, v, dtype, scale, keep, softcap, alibi, diag):
    """(out, lse) of attention computed in `dtype` the naive way (gpu_util.naive_attention),
    like PyTorch's same-dtype math."""
    return naive_attention(q, k, v, None, dtype, scale, keep, None, softcap, alibi, diag)


def run_case(rng, dtype_name, b, s_q, s_k, h, h_k, d, d_v=None, *, causal=False, window=None,
             bottom_right=True, softcap=0.0, alibi=None, scale=None, layout="bshd", pad=0,
             allow_tf32=False, kernel="portable", out_tol=None, key_ramp=0.0):
    """One forward call against the float64 reference; returns the variant name. ``out_tol``
    (float32 only) replaces the norm-wise out bound of 1e-5 (the long-sum tests: 2e-5).
    ``key_ramp``: key j scaled by 1 + key_ramp·j / s_k (scores that grow along the keys); a
    negative ramp scales key j by 1 + |key_ramp|·(s_k − 1 − j) / s_k (scores that grow towards key
    0: the Hopper kernels walk the keys right to left, so their running max rises tile by tile)."""
    d_v = d if d_v is None else d_v
    dtype = DTYPES[dtype_name]
    qn = rng.standard_normal((b, s_q, h, d), dtype=np.float32).astype(dtype)
    kn = rng.standard_normal((b, s_k, h_k, d), dtype=np.float32)
    j = np.arange(s_k, dtype=np.float32) if key_ramp >= 0 else s_k - 1 - np.arange(s_k, dtype=np.float32)
    kn = (kn * (1 + abs(key_ramp) * j / s_k)[:, None, None]).astype(dtype)
    vn = rng.standard_normal((b, s_k, h_k, d_v), dtype=np.float32).astype(dtype)
    q = alloc(qn.shape, dtype, layout, pad)
    k = alloc(kn.shape, dtype, layout, pad)
    v = alloc(vn.shape, dtype, layout, pad)
    q[...] = cp.asarray(qn)
    k[...] = cp.asarray(kn)
    v[...] = cp.asarray(vn)
    out = alloc((b, s_q, h, d_v), dtype, layout, pad)
    out[...] = cp.asarray(np.full((), np.nan, np.float32)).astype(dtype)
    lse = cp.full((b, h, s_q), cp.nan, cp.float32)

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
                   allow_tf32=allow_tf32)
    name = _gpu().forward(q, k, v, out, lse, opts, kernel=kernel)
    cp.cuda.get_current_stream().synchronize()
    assert isinstance(name, str) and name

    ref_out, ref_lse = reference.attention(
        qn, kn, vn, scale=scale_, window=(wl, wr), softcap=softcap or None,
        causal_align="bottom_right" if bottom_right else "top_left",
        alibi_slopes=None if slopes is None else np.broadcast_to(slopes, (b, h)),
        return_lse=True)
    got_out = cp.asnumpy(out).astype(np.float64)
    got_lse = cp.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got_out).any(), "NaN in out (unwritten or NaN-producing)"
    assert not np.isnan(got_lse).any(), "NaN in lse"
    dead = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(got_lse), dead, "lse -inf pattern")
    assert (got_out.transpose(0, 2, 1, 3)[dead] == 0).all(), "fully masked rows must give 0"
    live = ~dead
    err_out = np.abs(got_out - ref_out).max()
    err_lse = np.abs(got_lse[live] - ref_lse[live]).max() if live.any() else 0.0
    if dtype_name == "float32":
        # 3xTF32: 1e-5 norm-wise for out and lse (every float32 kernel adds each step's P V to
        # O in fp32, so the error does not grow with s_k the way the tensor cores' truncating
        # accumulation alone did: 3e-5 at 4k keys); out_tol: another out bound (long sums)
        tol = 5e-3 if allow_tf32 else 1e-5
        tol_out = tol if out_tol is None else out_tol
        rel = np.linalg.norm(got_out - ref_out) / max(np.linalg.norm(ref_out), 1e-30)
        assert rel <= tol_out, f"{name}: out relative error {rel:.3g} > {tol_out}"
        ref_l = ref_lse[live]
        lse_rel = np.linalg.norm(got_lse[live] - ref_l) / max(np.linalg.norm(ref_l), 1.0)
        assert lse_rel <= tol, f"{name}: lse relative error {lse_rel:.3g} > {tol}"
        return name
    naive_dtype, floor_out, floor_lse = dtype, FLOOR[dtype_name], FLOOR_LSE
    # max abs error against the naive computation in the same dtype
    keep, diag = keep_mask(s_q, s_k, wl, wr, bottom_right)
    n_out, n_lse = _naive(cp.asarray(qn), cp.asarray(kn), cp.asarray(vn), naive_dtype, scale_,
                          keep, softcap, None if slopes is None else
                          cp.asarray(np.broadcast_to(slopes, (b, h))), diag)
    n_out = cp.asnumpy(n_out).astype(np.float64)
    n_lse = cp.asnumpy(n_lse).astype(np.float64)
    naive_out = np.abs(n_out - ref_out).max()
    naive_lse = np.abs(n_lse[live] - ref_lse[live]).max() if live.any() else 0.0
    tol_out = 2 * naive_out + floor_out
    tol_lse = 2 * naive_lse + floor_lse
    assert err_out <= tol_out, f"{name}: out err {err_out:.3g} > {tol_out:.3g} (naive {naive_out:.3g})"
    assert err_lse <= tol_lse, f"{name}: lse err {err_lse:.3g} > {tol_lse:.3g} (naive {naive_lse:.3g})"
    return name


HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtype_headdim_grid(rng, dtype, d):
    run_case(rng, dtype, 2, 113, 203, 4, 2, d)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtype_headdim_grid_causal(rng, dtype, d):
    run_case(rng, dtype, 1, 203, 113, 2, 1, d, causal=True)


@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("d", [64, 128, 200])
def test_tf32_mode(rng, dtype, d):
    name = run_case(rng, dtype, 2, 100, 150, 2, 2, d, allow_tf32=True)
    assert "tf32" in name


@pytest.mark.parametrize("d,d_v", [(64, 32), (40, 128), (128, 64), (17, 200)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_head_dim_v_differs(rng, dtype, d, d_v):
    run_case(rng, dtype, 1, 77, 130, 2, 1, d, d_v, causal=True)


SEQLENS = [(1, 239), (239, 1), (113, 203), (1023, 1024), (1024, 1023), (128, 128), (257, 63),
           (3, 3)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SEQLENS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_seqlens(rng, dtype, d, s_q, s_k, causal):
    run_case(rng, dtype, 1, s_q, s_k, 2, 2, d, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_float32_long_sums(rng, d, causal):
    """O sums 8192 keys: the portable kernel adds each k-step's P V product to O in fp32 (round to
    nearest), so out stays within 2e-5 norm-wise (H200: 5-10e-6 at 16k keys); summed in the tensor
    cores' accumulator alone (which rounds toward zero) it was ~6e-5 at 8k keys
    (benchmarks/f32_error_growth.py)."""
    run_case(rng, "float32", 1, 256, 8192, 2, 1, d, causal=causal, kernel="portable", out_tol=2e-5)


@pytest.mark.parametrize("s_q,s_k", [(1023, 1024), (1, 239), (239, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens_float32(rng, s_q, s_k, causal):
    run_case(rng, "float32", 1, s_q, s_k, 2, 1, 64, causal=causal)


OPTION_SETS = {
    **WINDOW_OPTION_SETS,
    "softcap": dict(softcap=5.0),
    "alibi_bh": dict(alibi="bh"),
    "alibi_1h_causal": dict(alibi="1h", causal=True),
    "softcap_alibi_window": dict(softcap=8.0, alibi="bh", window=(60, 10)),
    "scale": dict(scale=0.37),
    "negative_scale": dict(scale=-0.1),
}


@pytest.mark.parametrize("opt", list(OPTION_SETS))
@pytest.mark.parametrize("d", [59, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_options(rng, dtype, d, opt):
    run_case(rng, dtype, 2, 157, 211, 4, 2, d, **OPTION_SETS[opt])


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gqa_mqa(rng, dtype, h, h_k):
    run_case(rng, dtype, 2, 130, 190, h, h_k, 64, causal=True)


@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 8), ("padded", 3), ("sstride", 0)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_strided_views(rng, dtype, layout, pad):
    run_case(rng, dtype, 2, 150, 170, 4, 2, 64, causal=True, layout=layout, pad=pad)
    run_case(rng, dtype, 1, 70, 90, 2, 1, 96, 80, layout=layout, pad=pad)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fully_masked_rows(rng, dtype):
    # causal bottom-right with s_q > s_k: the first s_q - s_k rows see no key
    run_case(rng, dtype, 1, 300, 100, 2, 1, 64, causal=True)
    # causal top-left with s_q > s_k is fine; a window that excludes everything for some rows:
    # left = right = 0 bottom-right puts row i on key i - 150, absent for i < 150
    run_case(rng, dtype, 1, 260, 110, 2, 2, 64, window=(0, 0))
    # window to the right only, far beyond the last key for late rows (top-left alignment)
    run_case(rng, dtype, 1, 200, 100, 2, 2, 32, window=(-1, 0), bottom_right=False)
    run_case(rng, dtype, 1, 200, 100, 2, 2, 32, window=(5, 3), bottom_right=False)


def test_zero_keys_and_empty(rng):
    from cupyflash.gpu.fwd import forward
    opts = Options(scale=0.125)
    q = cp.asarray(rng.standard_normal((1, 5, 2, 64), dtype=np.float32)).astype(cp.float16)
    k = cp.empty((1, 0, 2, 64), cp.float16)
    out = cp.full((1, 5, 2, 64), cp.nan, cp.float16)
    lse = cp.full((1, 2, 5), cp.nan, cp.float32)
    forward(q, k, k, out, lse, opts)
    assert (out == 0).all() and cp.isneginf(lse).all()


@pytest.mark.parametrize("kernel", ["portable", "auto"])
def test_int64_offsets(rng, kernel):
    """A K/V batch stride past 2^31 elements: int64 offsets in the kernel (the Hopper kernel's
    tensor maps too, under "auto" on a Hopper card)."""
    free, _ = cp.cuda.runtime.memGetInfo()
    b, s_k, h, d = 3, 1 << 20, 8, 128            # 2^30 elements per batch: batch 2 ends at 3·2^30
    if free < 12 * b * s_k * h * d:
        pytest.skip("not enough device memory")
    k = cp.empty((b, s_k, h, d), cp.float16)
    v = cp.empty((b, s_k, h, d), cp.float16)
    for t in (k, v):  # fill batch by batch with random values
        for i in range(b):
            t[i] = cp.random.standard_normal((s_k, h, d), dtype=cp.float32).astype(cp.float16)
    q = cp.asarray(rng.standard_normal((b, 4, h, d), dtype=np.float32)).astype(cp.float16)
    out = cp.full((b, 4, h, d), cp.nan, cp.float16)
    lse = cp.full((b, h, 4), cp.nan, cp.float32)
    # window: the last 300 keys of each batch (batch 2's offsets are past 2^31 elements)
    opts = Options(scale=0.1, window_left=299, window_right=0)
    from cupyflash.gpu.fwd import forward
    forward(q, k, v, out, lse, opts, kernel=kernel)
    kk = k[b - 1, -303:].astype(cp.float32)   # rows see keys s_k-4+i-299 .. s_k-4+i
    vv = v[b - 1, -303:].astype(cp.float32)
    for i in range(4):
        ks = kk[i:i + 300]
        s = cp.einsum("hd,khd->hk", q[b - 1, i].astype(cp.float32), ks) * 0.1
        m = s.max(-1, keepdims=True)
        p = cp.exp(s - m)
        ref = cp.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), vv[i:i + 300])
        assert float(cp.abs(out[b - 1, i].astype(cp.float32) - ref).max()) < 3e-3
        ref_lse = (cp.log(p.sum(-1)) + m[:, 0])
        assert float(cp.abs(lse[b - 1, :, i] - ref_lse).max()) < 2e-3
    del k, v
