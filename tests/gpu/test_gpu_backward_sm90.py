"""Hopper backward main kernel (kernels_cu/hopper/bwd.cu) against the float64 reference.

Same harness and criterion as tests/gpu/test_gpu_backward.py (``run_case``: NaN-poisoned gradients,
fresh random inputs, max error <= 2x the naive same-dtype backward + floor), with the Hopper
kernel forced (``kernel="sm90"``: a ValueError when it cannot run the call). Skipped on GPUs other
than compute capability 9.0. Also checks the launcher's choice under the default (kernel=None).
"""
from __future__ import annotations

import pytest

from gpu_util import BF16, cp, hopper_only  # noqa: E402  (skips without CuPy)
from test_gpu_backward import run_case  # noqa: E402  (pytest puts tests/ on sys.path)

from cupyflash._options import Options  # noqa: E402


pytestmark = [pytest.mark.gpu, hopper_only]

DTYPES = ["float16", "bfloat16"]


def sm90(rng, *args, **kw):
    name = run_case(rng, *args, kernel="sm90", **kw)
    assert name.startswith("bwd90_"), name
    return name


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_headdim_grid(rng, dtype, d):
    sm90(rng, dtype, 2, 113, 203, 4, 2, d)
    sm90(rng, dtype, 1, 203, 113, 2, 1, d, causal=True)


SEQLENS = [(1, 239), (239, 1), (113, 203), (1023, 1024), (1024, 1023), (128, 128), (64, 300),
           (700, 129)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SEQLENS)
@pytest.mark.parametrize("dtype,d", [("float16", 64), ("bfloat16", 128), ("bfloat16", 64),
                                     ("float16", 128)])
def test_seqlens(rng, dtype, d, s_q, s_k, causal):
    sm90(rng, dtype, 1, s_q, s_k, 2, 1, d, causal=causal)


OPTION_SETS = {
    "window": dict(window=(32, 16)),
    "window_left_only": dict(window=(50, -1)),
    "window_wide": dict(window=(200, 150)),
    "causal_top_left": dict(causal=True, bottom_right=False),
    "causal_window": dict(causal=True, window=(40, -1)),
    "scale": dict(scale=0.37),
}


@pytest.mark.parametrize("opt", list(OPTION_SETS))
@pytest.mark.parametrize("dtype,d", [("bfloat16", 64), ("float16", 128)])
def test_options(rng, dtype, d, opt):
    sm90(rng, dtype, 2, 157, 411, 4, 2, d, **OPTION_SETS[opt])


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_mqa(rng, dtype, h, h_k):
    sm90(rng, dtype, 2, 130, 290, h, h_k, 128, causal=True)


@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 8), ("sstride", 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, dtype, layout, pad):
    sm90(rng, dtype, 2, 150, 170, 4, 2, 64, causal=True, layout=layout, pad=pad)
    sm90(rng, dtype, 1, 300, 290, 2, 1, 128, layout=layout, pad=pad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(rng, dtype):
    sm90(rng, dtype, 1, 300, 100, 2, 1, 64, causal=True)             # rows before the diagonal
    sm90(rng, dtype, 1, 260, 110, 2, 2, 128, window=(0, 0))
    sm90(rng, dtype, 1, 200, 100, 2, 2, 64, window=(5, 3), bottom_right=False)


def test_long_sequence(rng):
    sm90(rng, "bfloat16", 1, 2048, 2048, 2, 1, 128, causal=True)
    sm90(rng, "float16", 1, 1500, 3001, 2, 2, 64)


@pytest.mark.parametrize("kw,expect", [
    (dict(), "bwd90_bf16_d128"),
    (dict(window_left=10, window_right=0), "bwd90_bf16_d128_64x128_window"),
    (dict(d=64), "bwd90_bf16_d64"),
    (dict(d=96), "bwd_bf16_d96"),                   # head dim not covered
    (dict(softcap=5.0), "bwd_bf16_d128"),           # softcap: portable
    (dict(deterministic=True), "bwd90_bf16_d128_64x128_det"),   # ordered dQ (DET)
    (dict(deterministic=True, d=96), "bwd_bf16_d96"),    # deterministic, not covered: portable
    (dict(d=256, d256_on=False), "bwd_bf16_d256"),       # TUNING.bwd_sm90_d256 off: portable
    (dict(d=256), "bwd90_bf16_d256_64x64_red"),          # on (the default): Hopper
    (dict(d=256, deterministic=True), "bwd90_bf16_d256_64x64_red_det"),
], ids=["d128", "window", "d64", "d96", "softcap", "deterministic", "deterministic_d96",
        "d256_switch_off", "d256_switch_on", "d256_deterministic"])
def test_launcher_picks_sm90_where_covered(kw, expect):
    from cupyflash.gpu.tuning import tuning
    kw = dict(kw)
    d = kw.pop("d", 128)
    with tuning(bwd_sm90_d256=kw.pop("d256_on", True)):
        _launcher_case(kw, d, expect)


def _launcher_case(kw, d, expect):
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    q, k, v, do = (cp.random.standard_normal((1, 100, 2, d), dtype=cp.float32).astype(BF16)
                   for _ in range(4))
    opts = Options(scale=0.1, **kw)
    out, lse = cp.empty_like(q), cp.empty((1, 2, 100), cp.float32)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    name = gpu_bwd.backward(do, q, k, v, out, lse, cp.empty_like(q), cp.empty_like(k),
                             cp.empty_like(v), opts)
    assert name.startswith(expect), name


# ---------------------------------------------------------------------------------------------
# Head dim 256 (flash_bwd_sm90<E, 256, ...>: 64-key tiles, the consumers split the head dim,
# hopper/bwd_split_consumer.cuh), forced: seqlen 1, primes, s_q != s_k both ways under causal,
# windows, GQA 32 / 8 and MQA 16 / 1, strided views, fully masked rows, a long causal sequence.
# ---------------------------------------------------------------------------------------------
def d256(rng, dtype, *args, **kw):
    name = sm90(rng, dtype, *args, **kw)
    assert "_d256_64x64" in name, name
    return name


D256_SEQLENS = [(1, 1), (1, 239), (239, 1), (113, 203), (1021, 509), (509, 1021), (64, 64),
                (127, 131), (700, 129)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q,s_k", D256_SEQLENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_d256_seqlens(rng, dtype, s_q, s_k, causal):
    d256(rng, dtype, 1, s_q, s_k, 2, 1, 256, causal=causal)


@pytest.mark.parametrize("opt", list(OPTION_SETS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_d256_options(rng, dtype, opt):
    d256(rng, dtype, 2, 157, 411, 4, 2, 256, **OPTION_SETS[opt])


@pytest.mark.parametrize("h,h_k", [(32, 8), (16, 1)], ids=["gqa32_8", "mqa16_1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d256_gqa(rng, h, h_k, causal):
    d256(rng, "bfloat16", 1, 130, 290, h, h_k, 256, causal=causal)


@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 8), ("sstride", 0)])
def test_d256_strided_views_and_masked_rows(rng, layout, pad):
    d256(rng, "bfloat16", 2, 150, 170, 4, 2, 256, causal=True, layout=layout, pad=pad)
    d256(rng, "float16", 1, 300, 100, 2, 1, 256, causal=True, layout=layout, pad=pad)
    d256(rng, "bfloat16", 1, 260, 110, 2, 2, 256, window=(0, 0))


def test_d256_long_sequence(rng):
    d256(rng, "bfloat16", 1, 2048, 2048, 2, 1, 256, causal=True)
    d256(rng, "float16", 2, 1500, 1001, 4, 2, 256)


# ---------------------------------------------------------------------------------------------
# Deterministic mode (flash_bwd_sm90<..., DET = true>: dQ tiles added in key-tile order through
# semaphores). Forced onto the Hopper kernel (kernel="sm90", name ending in _det); run_case's
# repeats compare the bits of dq, dk, dv between calls, and the accuracy criterion is the
# default mode's (2x the naive same-dtype backward + floor).
# ---------------------------------------------------------------------------------------------
def det(rng, *args, repeats=2, **kw):
    name = run_case(rng, *args, kernel="sm90", deterministic=True, repeats=repeats, **kw)
    assert name.startswith("bwd90_") and name.endswith("_det"), name
    return name


DET_SEQLENS = [(1, 1), (1, 239), (239, 1), (113, 203), (1021, 509), (509, 1021), (128, 128),
               (700, 129), (2048, 2048)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q,s_k", DET_SEQLENS)
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_seqlens(rng, d, s_q, s_k, causal):
    det(rng, "bfloat16", 2 if s_q * s_k < 1 << 20 else 1, s_q, s_k, 4, 2, d, causal=causal)


@pytest.mark.parametrize("h,h_k", [(32, 8), (16, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_gqa(rng, h, h_k, causal):
    det(rng, "bfloat16", 1, 389, 517, h, h_k, 128, causal=causal)
    det(rng, "float16", 1, 517, 389, h, h_k, 64, causal=causal)


@pytest.mark.parametrize("opt", list(OPTION_SETS))
def test_deterministic_options(rng, opt):
    det(rng, "bfloat16", 2, 157, 411, 4, 2, 128, **OPTION_SETS[opt])
    det(rng, "float16", 2, 411, 157, 4, 2, 64, **OPTION_SETS[opt])


def test_deterministic_fully_masked_rows_and_strided_views(rng):
    det(rng, "bfloat16", 1, 300, 100, 2, 1, 64, causal=True)       # rows before the diagonal
    det(rng, "float16", 1, 260, 110, 2, 2, 128, window=(0, 0))
    det(rng, "bfloat16", 2, 150, 170, 4, 2, 64, causal=True, layout="bhsd")
    det(rng, "float16", 1, 300, 290, 2, 1, 128, layout="padded", pad=8)


@pytest.mark.parametrize("order", [(False, 1), (True, 1), (True, 3), (False, None), (True, 1000)],
                         ids=["asc_g1", "desc_g1", "desc_g3", "asc_auto", "desc_all"])
def test_deterministic_orders(rng, order):
    """Every addition order and draw-group size (TUNING.det_descending / det_group, the
    kernel's p.det_sched) gives bit-identical runs within the criterion."""
    from cupyflash.gpu.tuning import tuning
    descending, group = order
    with tuning(det_descending=descending, det_group=group):
        det(rng, "bfloat16", 2, 1021, 509, 4, 2, 128, causal=True)
        det(rng, "float16", 3, 300, 700, 4, 4, 64)
        det(rng, "bfloat16", 1, 517, 389, 8, 2, 64, window=(100, 30))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (113, 203), (1021, 509), (509, 1021), (700, 129)])
def test_d256_deterministic(rng, s_q, s_k, causal):
    """Head dim 256's ordered dQ adds (one semaphore per dQ tile and column half)."""
    name = det(rng, "bfloat16", 1, s_q, s_k, 4, 2, 256, causal=causal)
    assert "_d256_" in name, name


def test_d256_deterministic_gqa_options(rng):
    det(rng, "bfloat16", 1, 389, 517, 32, 8, 256, causal=True)
    det(rng, "float16", 1, 517, 389, 16, 1, 256, window=(100, 30))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_bits_on_two_streams(rng, d, causal):
    """The same deterministic backward launched three times on each of two streams at once (the
    launches overlap, so one launch's blocks start while the other holds SMs: the counter's
    draws keep the semaphores deadlock-free) gives the bits of a lone launch on the default
    stream; the atomic mode's gradients agree with them to a few ulps."""
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    b, s, h, h_k = 2, 4096, 8, 2
    q = cp.asarray(rng.standard_normal((b, s, h, d), dtype="float32")).astype(BF16)
    k, v = (cp.asarray(rng.standard_normal((b, s, h_k, d), dtype="float32")).astype(BF16)
            for _ in range(2))
    do = cp.asarray(rng.standard_normal((b, s, h, d), dtype="float32")).astype(BF16)
    opts = Options(scale=d ** -0.5, window_right=0 if causal else -1, deterministic=True)
    out, lse = cp.empty_like(q), cp.empty((b, h, s), cp.float32)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    ref = [cp.empty_like(x) for x in (q, k, v)]
    name = gpu_bwd.backward(do, q, k, v, out, lse, *ref, opts, kernel="sm90")
    assert name.endswith("_det"), name
    cp.cuda.get_current_stream().synchronize()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    runs = []
    for _ in range(3):
        for st in streams:
            with st:
                g = [cp.empty_like(x) for x in (q, k, v)]
                gpu_bwd.backward(do, q, k, v, out, lse, *g, opts, kernel="sm90")
                runs.append(g)
    for st in streams:
        st.synchronize()
    for g in runs:
        for w, x, y in zip(("dq", "dk", "dv"), g, ref):
            assert cp.array_equal(x.view(cp.uint16), y.view(cp.uint16)), f"{name}: {w} differs"
    # and the values are the atomic mode's up to the order of the float32 additions
    atomic = [cp.empty_like(x) for x in (q, k, v)]
    gpu_bwd.backward(do, q, k, v, out, lse, *atomic, Options(scale=d ** -0.5,
                     window_right=0 if causal else -1), kernel="sm90")
    for w, x, y in zip(("dq", "dk", "dv"), atomic, ref):
        x, y = x.astype(cp.float32), y.astype(cp.float32)
        tol = 2 ** -6 * float(cp.abs(y).max())   # a few bf16 ulps of the largest element
        assert float(cp.abs(x - y).max()) <= tol, w
