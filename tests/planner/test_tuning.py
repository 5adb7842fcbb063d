"""gpu.tuning: the switches the planners read at every call, and the context manager that sets
them for a block."""
from __future__ import annotations

import dataclasses

import pytest

from cupyflash.gpu import plan_bwd, plan_fwd_sm90
from cupyflash.gpu.tuning import TUNING, Tuning, tuning


def test_defaults_are_what_the_planners_do():
    assert TUNING == Tuning()
    assert dataclasses.asdict(TUNING) == dict(sm90_float32_auto=True, sm90_split_auto=True,
                                              hopper_sched_b=True, dbias_kernel=None,
                                              dbias_sm90=True, det_descending=None,
                                              det_group=None, portable_bwd_2d=True,
                                              bwd_sm90_d256=True)


def test_tuning_sets_for_the_block_and_restores(rng):
    value = bool(rng.integers(2))
    with tuning(dbias_kernel=value, dbias_sm90=False) as t:
        assert t is TUNING and TUNING.dbias_kernel is value and TUNING.dbias_sm90 is False
    assert TUNING == Tuning()
    with pytest.raises(RuntimeError):
        with tuning(hopper_sched_b=False):
            raise RuntimeError("restored on the way out")
    assert TUNING.hopper_sched_b is True


def test_unknown_switch_is_a_type_error():
    with pytest.raises(TypeError, match="dbias_kernels"):
        with tuning(dbias_kernels=True):
            pass
    assert TUNING == Tuning()


@pytest.mark.parametrize("auto", [True, False], ids=["split_auto", "no_split"])
def test_split_auto_decides_the_planners_split(auto):
    """A call whose last partial wave the model splits (132 SMs, 140 work tiles of many keys)."""
    with tuning(sm90_split_auto=auto):
        plan = plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 128 * 70, 16384, 2, 2, 128, 128,
                                               scale=0.1, num_sms=132)
    assert plan.variant.split is auto and (plan.split is not None) is auto


@pytest.mark.parametrize("on", [True, False], ids=["sched_b", "no_sched_b"])
def test_hopper_sched_b_decides_the_batch_fastest_bit(on):
    dplan = plan_bwd.dbias_plan((1, 4, 256, 256), 3, 4, False)   # dbias summed over the batch
    with tuning(hopper_sched_b=on):
        mode = plan_bwd.hopper_dbias_mode(dplan, 3, 4)
    assert bool(mode & plan_bwd.DBIAS_SCHED_B) is on


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("group", [None, 5])
def test_det_switches_decide_the_deterministic_order(descending, group):
    """TUNING.det_descending / det_group set the deterministic Hopper backward's Params.det_sched
    (plan_bwd_sm90.det_sched: 2 · pairs per draw group + descending)."""
    from cupyflash.gpu import plan_bwd_sm90
    with tuning(det_descending=descending, det_group=group):
        got = plan_bwd_sm90.det_sched(16, 128, 132)
    assert got == 2 * (plan_bwd_sm90.det_group(16, 128, 132) if group is None else group) + descending


@pytest.mark.parametrize("on", [True, False], ids=["2d", "slabs"])
def test_portable_bwd_2d_picks_the_backward_kernel(on):
    """16-bit calls without bias / mask / varlen at hd <= 128 (either shared-memory class) run
    flash_bwd_2d when the switch is on, flash_bwd otherwise; everything else runs flash_bwd."""
    with tuning(portable_bwd_2d=on):
        for d in (32, 64, 96, 128):
            v = plan_bwd.plan_backward("bfloat16", 1, 1024, 1024, 8, 8, d, d, scale=0.1,
                                       window_right=0).variant
            assert bool(v.wms) is on and v.template == ("flash_bwd_2d" if on else "flash_bwd")
        for kw in (dict(dtype_name="float32", d=64), dict(dtype_name="bfloat16", d=160)):
            d = kw["d"]
            v = plan_bwd.plan_backward(kw["dtype_name"], 1, 1024, 1024, 8, 8, d, d,
                                       scale=0.1).variant
            assert not v.wms
        assert not plan_bwd.plan_backward("bfloat16", 1, 1024, 1024, 8, 8, 64, 64, scale=0.1,
                                          has_bias=True).variant.wms
        small = plan_bwd.plan_backward("bfloat16", 1, 1024, 1024, 8, 8, 64, 64, scale=0.1,
                                       smem_optin=99 * 1024).variant   # 99 KB: its own tiles
        assert bool(small.wms) is on and small.smem_bytes <= 99 * 1024
