"""CPU tests of the float64 (f64_t) planning: tiles that fit, the O-column pieces, the float64
scalars in Params, the dtype routing. No GPU needed."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _checks
from cupyflash.gpu import (params as gpu_params, plan_bwd, plan_bwd_sm90, plan_fwd, plan_fwd_sm90,
                           variants as gpu_variants)

SMEMS = {"small_99k": 99 * 1024, "sm80_163k": 163 * 1024, "sm90_227k": 227 * 1024}


@pytest.mark.parametrize("smem", SMEMS.values(), ids=list(SMEMS))
def test_forward_f64_variants_fit(smem):
    """Every float64 forward variant fits, has one 16-row slab per warp (MT = 1: the double O
    accumulator) and a key tile of whole n8 fragments; every bucket has one."""
    vs = [v for v in plan_fwd.variants(smem) if v.elem == "f64_t"]
    assert {v.d for v in vs} == set(gpu_variants.HEAD_DIM_BUCKETS)
    for v in vs:
        assert v.smem_bytes <= smem, v.name
        assert v.bm == 16 * v.nw and v.bn % 16 == 0 and v.stages == 1, v.name


def test_forward_f64_smem_formula():
    # D = 128, BM 64, BN 32: Q [64, 136], K [32, 136], V [32, 130] doubles
    assert plan_fwd.smem_bytes("f64_t", 128, 64, 32) == (64 * 136 + 32 * 136 + 32 * 130) * 8
    # D = 256: V holds O_COLS_F64 = 128 columns (+ 2)
    assert plan_fwd.smem_bytes("f64_t", 256, 32, 16) == (32 * 264 + 16 * 264 + 16 * 130) * 8


@pytest.mark.parametrize("smem", SMEMS.values(), ids=list(SMEMS))
def test_backward_f64_variants_fit_and_meet_the_static_asserts(smem):
    """Float64 backward variants fit; above D = 160 the small class has none (planner:
    NotImplementedError). Registers: dK + dV (D / WD / 2 doubles each per lane) and Sᵀ + dPᵀ (BM / 2
    doubles each) take at most 128 of the 255 32-bit registers, 160 in sm_90's wide tiles
    (plan_bwd._TILES_F64_WIDE: a few spilled registers, measured faster)."""
    vs = [v for v in plan_bwd.variants(smem) if v.elem == "f64_t"]
    want = {d for d in gpu_variants.HEAD_DIM_BUCKETS if smem >= gpu_variants.BIG_SMEM or d <= 160}
    assert {v.d for v in vs} == want
    for v in vs:
        wmq = v.bm // 16
        assert v.smem_bytes <= smem, v.name
        assert v.nw % v.wd == 0 and v.bn % 16 == 0 and v.nw % wmq == 0, v.name
        assert (v.d // v.wd) % 8 == 0 and (v.d // (v.nw // wmq)) % 8 == 0, v.name
        wide = (v.bm, v.nw, v.wd, v.nbuf) == plan_bwd._TILES_F64_WIDE.get(v.d)
        assert 2 * (v.d // v.wd) + 2 * v.bm <= (160 if wide else 128), v.name


def test_backward_f64_too_big_for_small_class():
    with pytest.raises(NotImplementedError, match="shared memory"):
        plan_bwd.plan_backward("float64", 1, 64, 64, 1, 1, 256, 256, scale=0.1,
                               smem_optin=SMEMS["small_99k"])


def test_backward_f64_smem_formula():
    # D = 128, BM 32, NW 8, WD 4 (BN 32), one buffer: K, V [32, 132], Q, dO [32, 132], dSᵀ [32, 36]
    # doubles, lse / D [32] doubles
    assert plan_bwd.smem_bytes("f64_t", 128, 32, 32, 1) == \
        (2 * 32 * 132 + 2 * 32 * 132 + 32 * 36) * 8 + 2 * 32 * 8


def test_plan_forward_float64():
    pl = plan_fwd.plan_forward("float64", 2, 300, 500, 8, 2, 128, 128, scale=0.09, window_right=0,
                               smem_optin=SMEMS["sm90_227k"])
    assert pl.variant.elem == "f64_t" and pl.variant.d == 128 and pl.variant.window
    assert pl.grid == (-(-300 // pl.variant.bm), 8, 2)
    assert "f64" in pl.variant.name


def test_float64_scalars_in_double():
    """The f64 kernels read scale, scale·log2(e) and softcap's factors from *_f64 fields, unrounded;
    the float32 fields keep their float32 values."""
    scale, cap = 1 / np.sqrt(96.0), 7.3
    for prm in (plan_fwd.plan_forward("float64", 1, 10, 10, 1, 1, 96, 96, scale=scale,
                                      softcap=cap).params,
                plan_bwd.plan_backward("float64", 1, 10, 10, 1, 1, 96, 96, scale=scale,
                                       softcap=cap).params):
        assert prm["scale_log2_f64"] == scale * gpu_params.LOG2E
        assert prm["scale_f64"] == scale
        assert prm["softcap_pre_f64"] == scale / cap
        assert prm["softcap_post_f64"] == cap * gpu_params.LOG2E
        assert prm["scale_log2"] == np.float32(scale * gpu_params.LOG2E)
        assert prm["softcap_post"] == np.float32(cap * gpu_params.LOG2E)


def test_dtype_routing():
    assert gpu_variants.DTYPE_NAMES[np.dtype(np.float64)] == "float64"
    assert gpu_variants.elem_tag("float64", False) == "f64_t"
    assert gpu_variants.ACC_SIZE["f64_t"] == 8 and gpu_variants.ACC_SIZE["f32x3_t"] == 4
    assert np.dtype(np.float64) in _checks.KERNEL_DTYPES


def test_hopper_planners_refuse_float64():
    """The Hopper kernels take 16-bit / float32 only: their planners name float64 as the reason,
    so the dispatchers run the portable f64_t kernels."""
    why = plan_fwd_sm90.why_unsupported("float64", 128, 128, scale=0.1, softcap=0.0,
                                        has_alibi=False, cc=90, smem_optin=SMEMS["sm90_227k"])
    assert why is not None and "float64" in why
    why = plan_bwd_sm90.why_unsupported("float64", 128, 128, scale=0.1, softcap=0.0,
                                        has_alibi=False, deterministic=False, cc=90,
                                        smem_optin=SMEMS["sm90_227k"])
    assert why is not None and "float64" in why


def test_no_float64_dbias_kernel():
    """float64 dbias comes from flash_bwd's double accumulator: no flash_bwd_dbias variant."""
    assert all(v.elem != "f64_t" for v in plan_bwd.dbias_variants())


class _FakeXp:
    """Stands for CuPy in check_alibi (any module that is not NumPy)."""
    asarray = staticmethod(np.asarray)
    ascontiguousarray = staticmethod(np.ascontiguousarray)


@pytest.mark.parametrize("dtype,want", [(np.float64, np.float64), (np.float32, np.float32),
                                        (np.float16, np.float32)])
def test_alibi_slopes_dtype_on_the_gpu(dtype, want):
    """GPU ALiBi slopes are float32, float64 for float64 inputs (the f64 kernels read doubles)."""
    dims = _checks.Dims(2, 5, 5, 3, 3, 8, 8)
    slopes = _checks.check_alibi(np.array([0.1, 0.2, 0.3]), dims, _FakeXp, dtype)
    assert slopes.dtype == want and slopes.shape == (1, 3)
