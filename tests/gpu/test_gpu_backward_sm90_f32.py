"""Float32 Hopper backward (kernels_cu/hopper/bwd_f32.cu, forced with kernel="sm90") against the
float64 reference: tests/gpu/test_gpu_backward.py's harness and float32 criterion (NaN-poisoned
gradients, fresh random inputs, max error / max(1, max|ref|) <= 5e-5); and the planner's choice of
it for float32 calls it covers. Every case runs at head dim 64 (design S: 128-key work tiles) and
128 (design T: 64-key work tiles, consumers owning column halves; docs/f32-backward-design.md
section 15). Skipped on GPUs other than compute capability 9.0.
"""
from __future__ import annotations

import pytest

from gpu_util import SM90_F32_OPTION_SETS, cp, hopper_only  # noqa: E402,F401  (skips without CuPy)
from test_gpu_backward import run_case  # noqa: E402  (pytest puts tests/ on sys.path)

pytestmark = [pytest.mark.gpu, hopper_only]


HEAD_DIMS = [64, 128]


def f32(rng, *args, **kw):
    name = run_case(rng, "float32", *args, kernel="sm90", **kw)
    assert name.startswith(f"bwd90_f32_d{args[5]}"), name
    return name


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_one_tile(rng, d):
    """The first case to look at: one work tile (128 keys at hd 64; two of 64 at hd 128), four
    32-row steps, one head."""
    f32(rng, 1, 128, 128, 1, 1, d)


def test_one_tile_one_step_hd128(rng):
    """hd 128's smallest case: one 64-key work tile, one 32-row step (both consumers' handoffs
    once)."""
    f32(rng, 1, 32, 64, 1, 1, 128)


SEQLENS = [(1, 1), (1, 239), (239, 1), (7, 33), (113, 203), (1023, 1024), (1024, 1023),
           (128, 128), (64, 300), (700, 129), (2048, 2048)]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SEQLENS)
def test_seqlens(rng, s_q, s_k, causal, d):
    f32(rng, 1, s_q, s_k, 2, 1, d, causal=causal)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("opt", list(SM90_F32_OPTION_SETS))
def test_options(rng, opt, d):
    f32(rng, 2, 157, 411, 4, 2, d, **SM90_F32_OPTION_SETS[opt])


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 3)])
def test_gqa_mqa(rng, h, h_k, d):
    f32(rng, 2, 130, 290, h, h_k, d, causal=True)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 8), ("sstride", 0)])
def test_strided_views(rng, layout, pad, d):
    f32(rng, 2, 150, 170, 4, 2, d, causal=True, layout=layout, pad=pad)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fully_masked_rows(rng, d):
    f32(rng, 1, 300, 100, 2, 1, d, causal=True)
    f32(rng, 1, 260, 110, 2, 2, d, window=(0, 0))


def test_planner_picks_it_where_it_covers_the_call(rng):
    """kernel=None (the planner): hopper/bwd_f32.cu for float32 hd 64 and 128, the portable
    backward for other float32 head dims and for allow_tf32."""
    for d in HEAD_DIMS:
        assert run_case(rng, "float32", 2, 97, 203, 4, 2, d, causal=True, kernel=None).startswith(
            f"bwd90_f32_d{d}")
    assert not run_case(rng, "float32", 1, 97, 203, 2, 1, 96, kernel=None).startswith("bwd90")
    assert not run_case(rng, "float32", 1, 97, 203, 2, 1, 128, allow_tf32=True,
                        kernel=None).startswith("bwd90")


def test_refusals(rng):
    """Other head dims and allow_tf32 are not in this kernel: kernel="sm90" raises a ValueError
    naming why."""
    with pytest.raises(ValueError, match="sm90.*head dims"):
        run_case(rng, "float32", 1, 64, 64, 1, 1, 96, kernel="sm90")
    with pytest.raises(ValueError, match="sm90.*allow_tf32"):
        run_case(rng, "float32", 1, 64, 64, 1, 1, 64, kernel="sm90", allow_tf32=True)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_misaligned_base_falls_back(rng, d):
    """q starting 4 bytes past a 16-byte boundary: TMA cannot take it, so the planner runs the
    portable backward (gradients still match the reference) and kernel="sm90" raises naming why."""
    import math

    import numpy as np

    from cupyflash import reference
    from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
    from cupyflash._options import Options

    s, h = 70, 2
    qn, kn, vn, don = (rng.standard_normal((1, s, h, d), dtype=np.float32) for _ in range(4))
    base = cp.empty(1 + qn.size, cp.float32)
    q = base[1:].reshape(qn.shape)                     # 4 bytes past the allocation's start
    q[...] = cp.asarray(qn)
    assert q.data.ptr % 16
    k, v, dout = (cp.asarray(x) for x in (kn, vn, don))
    out, lse = cp.empty_like(dout), cp.empty((1, h, s), cp.float32)
    opts = Options(scale=1 / math.sqrt(d), window_right=0)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    g = [cp.full(x.shape, cp.nan, cp.float32) for x in (q, k, v)]
    name = gpu_bwd.backward(dout, q, k, v, out, lse, *g, opts)
    assert not name.startswith("bwd90"), name
    ref = reference.attention_backward(don, qn, kn, vn, causal=True)[:3]
    for a, r in zip(g, ref):
        assert np.abs(cp.asnumpy(a) - r).max() <= 5e-5 * max(1.0, np.abs(r).max())
    with pytest.raises(ValueError, match="sm90.*aligned"):
        gpu_bwd.backward(dout, q, k, v, out, lse, *g, opts, kernel="sm90")
