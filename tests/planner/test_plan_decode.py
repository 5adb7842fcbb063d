"""The split-KV decode planner (cupyflash/gpu/plan_decode.py): pure Python, no GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash.gpu import plan_decode as pd

H200 = dict(sm_count=132, smem_optin=227 * 1024)
A100 = dict(sm_count=108, smem_optin=163 * 1024)
RTX4090 = dict(sm_count=128, smem_optin=99 * 1024)   # the 99 KB class: sm_86, sm_89, sm_120


def test_params_record_matches_the_kernel_struct_order():
    """DecodeParams' field order is the struct's (pointers, strides, ints, floats), naturally
    aligned; the source declares the same names in the same order."""
    src = open(pd.__file__.replace("cupyflash/gpu/plan_decode.py", "kernels_cu/portable/decode.cu")).read()
    body = src[src.index("struct DecodeParams {"):src.index("};", src.index("struct DecodeParams {"))]
    import re

    names = []
    for line in body.splitlines()[1:]:
        names += re.findall(r"(\w+)\s*[,;]", line.split("//")[0])
    assert names == list(pd.DECODE_PARAMS_DTYPE.names)
    assert pd.DECODE_PARAMS_DTYPE.itemsize % 8 == 0


@pytest.mark.parametrize("d", pd.DECODE_HEAD_DIMS)
@pytest.mark.parametrize("dev", [H200, A100, RTX4090], ids=["h200", "a100", "99kb"])
def test_every_variant_fits_and_rings_are_deep(d, dev):
    for rows in (1, 16, 17, 64):
        v, per_sm = pd.variant_for("bf16_t", d, rows, dev["smem_optin"])
        assert v.smem_bytes <= dev["smem_optin"]
        assert per_sm * (v.smem_bytes + 1024) <= dev["smem_optin"] + 2048
        assert v.stages >= 2
        assert v.mt == (1 if rows <= 16 or d > 128 else 2)


@pytest.mark.parametrize("smem", [99 * 1024, 163 * 1024, 227 * 1024])
def test_variants_list_every_head_dim(smem):
    """variants() (the compile sweep's list) plans every element type and head dim."""
    vs = pd.variants(smem)
    assert {(v.elem, v.d) for v in vs} == {(e, d) for e in pd.DECODE_ELEMS for d in pd.DECODE_HEAD_DIMS}


def test_99kb_halves_the_warps_only_where_four_rings_do_not_fit():
    """At 99 KB four warps' 2-stage rings do not fit at d 192 / 256 (106 / 140 KB): two warps
    with one CTA per SM; d <= 128 and the larger classes keep TUNING["nw"] = 4 warps."""
    got = {d: pd.variant_for("bf16_t", d, 1, RTX4090["smem_optin"]) for d in pd.DECODE_HEAD_DIMS}
    assert {d: (v.nw, v.stages, per_sm) for d, (v, per_sm) in got.items()} == \
        {64: (4, 5, 1), 128: (4, 2, 1), 192: (2, 3, 1), 256: (2, 2, 1)}
    for dev in (A100, H200):
        assert {v.nw for v in pd.variants(dev["smem_optin"])} == {pd.NW}


def test_h200_hd128_runs_two_ctas_with_three_stages():
    v, per_sm = pd.variant_for("bf16_t", 128, 4, H200["smem_optin"])
    assert (per_sm, v.stages, v.mt, v.nw) == (2, 3, 1, 4)
    assert v.name == "decode_bf16_t_d128_m16_w4_s3"
    assert v.name_expression == "flash_decode<bf16_t, 128, 1, 4, 3>"
    assert "flash_decode_combine<bf16_t, 128>" in v.helper_expressions


@pytest.mark.parametrize("b, s, h, hk, want", [
    (1, 131072, 32, 8, 33),     # 8 CTAs: split to fill 264 slots once
    (8, 8192, 32, 8, 4),        # 64 CTAs
    (64, 4096, 32, 32, 1),      # 2048 CTAs: already 7.8 waves
    (4, 32768, 32, 32, 2),      # 128 CTAs
    (32, 16384, 32, 8, 1),      # 256 CTAs: one wave
], ids=["1x131k_gqa", "8x8k_gqa", "64x4k_mha", "4x32k_mha", "32x16k_gqa"])
def test_split_counts_on_the_h200(b, s, h, hk, want):
    plan = pd.plan_decode("bfloat16", b, 1, h, hk, 128, s, 0, **H200)
    assert plan.num_splits == want
    assert plan.grid == (hk, want, b) and plan.head_fastest
    assert plan.fused_combine == (want > 1)
    # every split keeps at least 8 tiles per warp
    assert math.ceil(s / 16) / want >= pd.NW * pd.MIN_TILES_PER_WARP


def test_split_count_never_exceeds_the_keys():
    assert pd.choose_splits(1, 10, 264) == 1                 # 160 keys: no split
    assert pd.choose_splits(1, 10**6, 264) == pd.MAX_SPLITS   # 16M keys: as many as allowed
    assert pd.choose_splits(0, 100, 264) == 1


def test_forced_split_counts_are_capped_at_the_tiles():
    assert pd.plan_decode("float16", 2, 1, 8, 8, 64, 100, 5, **H200).num_splits == 5
    assert pd.plan_decode("float16", 2, 1, 8, 8, 64, 40, 50, **H200).num_splits == 3


def test_gqa_packing_rows_and_m_tiles():
    # 7 query rows x 4 heads per kv head = 28 packed rows: one 32-row tile
    plan = pd.plan_decode("bfloat16", 3, 7, 32, 8, 128, 4096, 0, **H200)
    assert plan.variant.mt == 2 and plan.num_m_tiles == 1 and plan.grid[2] == 3
    # 128 query rows x 4 = 512 rows: 16 tiles per batch entry
    plan = pd.plan_decode("bfloat16", 2, 128, 8, 2, 128, 4096, 0, **H200)
    assert plan.num_m_tiles == 16 and plan.grid[2] == 2 * 16
    # head dim 256 keeps 16-row tiles (register budget)
    plan = pd.plan_decode("bfloat16", 2, 8, 8, 2, 256, 4096, 0, **H200)
    assert plan.variant.mt == 1 and plan.num_m_tiles == 2


@pytest.mark.parametrize("args, reason", [
    (("float32", 128, 128, 90, True), "dtype"),
    (("bfloat16", 96, 96, 90, True), "head dim"),
    (("bfloat16", 128, 64, 90, True), "head dim"),
    (("float16", 128, 128, 75, True), "compute capability"),
    (("float16", 128, 128, 80, False), "16 bytes"),
])
def test_why_unsupported(args, reason):
    assert reason in pd.why_unsupported(*args)
    assert pd.why_unsupported("bfloat16", 128, 128, 90, True) is None


@pytest.mark.parametrize("args, want", [
    (("bfloat16", 1, 1, 4096, 32, 8, 128, 128, False, 132), True),    # decode, GQA
    (("bfloat16", 2, 1, 4096, 16, 16, 128, 128, False, 132), False),  # MHA on 9.0: Hopper forward
    (("bfloat16", 2, 1, 4096, 16, 16, 128, 128, False, 108, 80), True),   # MHA, sm_80, few blocks
    (("bfloat16", 64, 1, 4096, 32, 32, 128, 128, False, 108, 80), False),  # MHA, grid full
    (("bfloat16", 1, 1, 256, 32, 8, 128, 128, False, 132), False),    # few keys
    (("bfloat16", 1, 64, 4096, 32, 8, 128, 128, False, 132), False),  # many rows
    (("bfloat16", 1, 1, 4096, 32, 8, 128, 128, True, 132), False),    # bias / mask
    (("float32", 1, 1, 4096, 32, 8, 128, 128, False, 132), False),
    (("bfloat16", 1, 1, 4096, 32, 8, 80, 80, False, 132), False),
], ids=["gqa", "mha_sm90", "mha_sm80_few", "mha_sm80_full", "few_keys", "many_rows", "bias",
        "float32", "hd80"])
def test_route_attention(args, want):
    assert pd.route_attention(*args) is want


def test_new_params_defaults():
    prm = pd.new_params()
    assert int(prm["window_left"][0]) == -1 and int(prm["window_right"][0]) == -1
    assert int(prm["bottom_right"][0]) == 1 and int(prm["q"][0]) == 0
    assert prm.dtype == np.dtype(pd.DECODE_PARAMS_FIELDS, align=True)


def test_tuning_switches_change_the_grid_order_and_combine(monkeypatch):
    monkeypatch.setitem(pd.TUNING, "head_fastest", False)
    monkeypatch.setitem(pd.TUNING, "fused_combine", False)
    plan = pd.plan_decode("bfloat16", 8, 1, 32, 8, 128, 8192, 0, **H200)
    assert plan.grid == (4, 8, 8) and not plan.head_fastest and not plan.fused_combine


def test_more_ctas_per_sm_and_fewer_warps(monkeypatch):
    """TUNING ctas_per_sm 3: 2-stage rings (H200, hd 128: 74 KB each); nw 2 with 4 per SM."""
    monkeypatch.setitem(pd.TUNING, "ctas_per_sm", 3)
    v, per_sm = pd.variant_for("bf16_t", 128, 4, H200["smem_optin"])
    assert (per_sm, v.stages, v.nw) == (3, 2, 4) and 3 * (v.smem_bytes + 1024) <= H200["smem_optin"] + 2048
    monkeypatch.setitem(pd.TUNING, "ctas_per_sm", 4)
    monkeypatch.setitem(pd.TUNING, "nw", 2)
    v, per_sm = pd.variant_for("bf16_t", 128, 4, H200["smem_optin"])
    assert (per_sm, v.stages, v.nw) == (4, 3, 2) and v.threads == 64


@pytest.mark.parametrize("args, want", [
    ((90, 32, 32, False, False, 0, 2 << 30), True),      # MHA, 2 GiB of K / V
    ((90, 32, 8, False, False, 0, 2 << 30), False),      # GQA: the decode kernel's packing
    ((80, 32, 32, False, False, 0, 2 << 30), False),     # no Hopper forward
    ((90, 32, 32, True, False, 0, 2 << 30), False),      # paged
    ((90, 32, 32, False, True, 0, 2 << 30), False),      # lengths on the device
    ((90, 32, 32, False, False, 2, 2 << 30), False),     # forced split count
    ((90, 32, 32, False, False, 0, 256 << 20), False),   # small: host replanning would show
], ids=["mha", "gqa", "sm80", "paged", "device_lengths", "num_splits", "small"])
def test_route_forward(args, want, monkeypatch):
    assert pd.route_forward(*args) is want
    monkeypatch.setitem(pd.TUNING, "mha_forward", False)
    assert pd.route_forward(*args) is False


def test_fused_combine_weights_fit_the_merge_area():
    v, _ = pd.variant_for("bf16_t", 128, 1, H200["smem_optin"])
    assert pd.fused_fits(v, 1024)
    v, _ = pd.variant_for("bf16_t", 256, 1, H200["smem_optin"])
    assert pd.fused_fits(v, 1024)
