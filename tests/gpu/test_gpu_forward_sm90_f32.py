"""Hopper float32 forward kernel (kernels_cu/hopper/fwd_f32.cu, 3xTF32 on wgmma) against the
float64 reference.

Same harness as tests/gpu/test_gpu_forward.py (``run_case``: NaN-poisoned outputs, fresh random
inputs; float32: norm-wise relative error <= 1e-5 for out and lse, 5e-3 with allow_tf32), with
the Hopper kernel forced (``kernel="sm90"``). Skipped on GPUs other than compute capability 9.0.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_util import SM90_F32_OPTION_SETS, cp, hopper_only, launches_on_two_streams  # noqa: E402
from test_gpu_forward import run_case  # noqa: E402

from cupyflash._options import Options  # noqa: E402

pytestmark = [pytest.mark.gpu, hopper_only]

HEAD_DIMS = [64, 128]


def sm90(rng, *args, **kw):
    name = run_case(rng, "float32", *args, kernel="sm90", **kw)
    assert name.startswith("fwd90_f32x3_" if not kw.get("allow_tf32") else "fwd90_tf32_"), name
    return name


SEQLENS = [(1, 239), (239, 1), (113, 203), (1023, 1024), (1024, 1023), (128, 128), (3, 3)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SEQLENS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_seqlens(rng, d, s_q, s_k, causal):
    sm90(rng, 1, s_q, s_k, 2, 2, d, causal=causal)


@pytest.mark.parametrize("opt", list(SM90_F32_OPTION_SETS))
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_options(rng, d, opt):
    sm90(rng, 2, 157, 411, 4, 2, d, **SM90_F32_OPTION_SETS[opt])


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_mqa(rng, d, h, h_k):
    sm90(rng, 2, 130, 390, h, h_k, d, causal=True)


@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 4), ("sstride", 0)])
def test_strided_views(rng, layout, pad):
    sm90(rng, 2, 150, 170, 4, 2, 64, causal=True, layout=layout, pad=pad)
    sm90(rng, 1, 300, 290, 2, 1, 128, layout=layout, pad=pad)


@pytest.mark.parametrize("ramp", [6.0, 40.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rising_scores(rng, d, causal, ramp):
    """Scores that grow along the keys: the running max rises from key tile to key tile, by a
    little and by more than 2^8 (tests/gpu/test_gpu_forward_sm90.py::test_rising_scores)."""
    sm90(rng, 1, 257, 1500, 2, 1, d, causal=causal, key_ramp=ramp)


def test_fully_masked_rows(rng):
    sm90(rng, 1, 300, 100, 2, 1, 64, causal=True)            # rows before the diagonal
    sm90(rng, 1, 260, 110, 2, 2, 128, window=(0, 0))         # empty windows
    sm90(rng, 1, 200, 100, 2, 2, 64, window=(5, 3), bottom_right=False)
    sm90(rng, 1, 700, 100, 2, 2, 128, causal=True)            # whole query tiles see nothing


def test_long_sequence(rng):
    """Many wraps of the K/V ring, the converters and the consumers' turns."""
    sm90(rng, 1, 2048, 4096, 2, 1, 128)
    sm90(rng, 1, 1500, 3001, 2, 2, 64, causal=True)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_allow_tf32(rng, d):
    sm90(rng, 1, 333, 517, 2, 1, d, causal=True, allow_tf32=True)


def test_routing():
    """float32 runs the Hopper kernel under kernel="auto" while SM90_FLOAT32_AUTO is True (the
    portable one otherwise); kernel="sm90" forces the Hopper kernel; uncovered float32 calls
    name the reason."""
    from cupyflash.gpu import fwd as gpu_fwd
    from cupyflash.gpu.tuning import TUNING
    q = cp.random.standard_normal((1, 64, 2, 64), dtype=cp.float32)
    out, lse = cp.empty_like(q), cp.empty((1, 2, 64), cp.float32)
    name = gpu_fwd.forward(q, q, q, out, lse, Options(scale=0.125))
    assert name.startswith("fwd90_f32x3_" if TUNING.sm90_float32_auto else "fwd_f32x3_"), name
    assert gpu_fwd.forward(q, q, q, out, lse, Options(scale=0.125), kernel="sm90").startswith("fwd90_")
    with pytest.raises(ValueError, match="Hopper kernel cannot run this call.*softcap"):
        gpu_fwd.forward(q, q, q, out, lse, Options(scale=0.125, softcap=5.0), kernel="sm90")
    q96 = cp.random.standard_normal((1, 16, 1, 96), dtype=cp.float32)
    with pytest.raises(ValueError, match="head dims 96"):
        gpu_fwd.forward(q96, q96, q96, cp.empty_like(q96), cp.empty((1, 1, 16), cp.float32),
                     Options(scale=0.1), kernel="sm90")


def test_repeated_launches_two_streams():
    """The work-tile counter is per stream and left zeroed: many launches on two streams, each
    checked against the portable float32 kernel."""
    def check(out, ref, lse, ref_lse):
        rel = float(cp.linalg.norm(out - ref) / cp.linalg.norm(ref))
        assert rel < 1e-5, rel
        assert float(cp.abs(lse - ref_lse).max()) < 1e-4
    launches_on_two_streams(cp.float32, 6, "sm90", check)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_long_sums(rng, d, causal):
    """Each key tile's P V goes to a zeroed accumulator added to O in fp32 (O_RN; hd 128 in two
    column halves), so out over 8192 keys stays within 2e-5 norm-wise (the tensor cores'
    accumulation alone, which rounds toward zero, gave ~6e-5 at 8k keys)."""
    sm90(rng, 1, 256, 8192, 2, 1, d, causal=causal, out_tol=2e-5)
