"""Planner of the Hopper forward kernel (pure Python, no GPU): coverage, tiles, TMA geometry."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash.gpu import params as gpu_params
from cupyflash.gpu import plan_fwd_sm90
from cupyflash.gpu import tma as gpu_tma
from cupyflash.gpu import variants as gpu_variants
from cupyflash.gpu.tuning import TUNING

ROOT = Path(__file__).resolve().parents[2]
H200_SMEM = 227 * 1024


def _kernel_source(rel: str) -> str:
    """kernels_cu/<rel> with the kernels_cu/ headers it includes spliced in, each once (the text
    NVRTC compiles): the mirrors below hold wherever the entry keeps a piece."""
    seen = set()

    def expand(path: str) -> str:
        if path in seen:
            return ""
        seen.add(path)
        text = (ROOT / "kernels_cu" / path).read_text()
        return re.sub(r'#include "([^"]+)"', lambda m: expand(m.group(1)), text)

    return expand(rel)


def _unsupported(dtype="bfloat16", d=128, d_v=None, *, scale=0.1, softcap=0.0, has_alibi=False,
                 cc=90, smem=H200_SMEM, tensors=()):
    return plan_fwd_sm90.why_unsupported(dtype, d, d if d_v is None else d_v, scale=scale,
                                  softcap=softcap, has_alibi=has_alibi, cc=cc, smem_optin=smem,
                                  tensors=tensors)


def _contig(shape):
    b, s, h, d = shape
    return shape, (s * h * d, h * d, d, 1)


def test_variants_fit_and_are_distinct():
    vs = plan_fwd_sm90.variants()
    # dtypes x head dims x window x softcap x varlen, plus hd 64's dense two-consumer
    # short-window variant, plus the bias variants (16-bit / float32 bias, hd 64 and 128), plus
    # the wide-key-tile variants (hd 128, causal / window, no softcap), plus the SPLIT twin of
    # each dense variant without window, softcap, varlen or bias (one per head dim), plus the
    # max-free softmax's dense variant and its SPLIT twin (hd 128, which long dense rows take
    # instead of the wide tiles)
    assert len(vs) == (2 * 3 * 2 * 2 * 2 + 2 + 2 * len(plan_fwd_sm90.SM90_BIAS_HEAD_DIMS) * 2 * 2 * 2
                       + 2 * len(plan_fwd_sm90.SM90_TILES_WIDE)
                       + 2 * len(plan_fwd_sm90.SM90_HEAD_DIMS)
                       + 2 * len(plan_fwd_sm90.SM90_MAXFREE_HEAD_DIMS) * 2)
    assert all(not (v.window or v.softcap or v.varlen or v.bias) and v.bn == 128
               for v in vs if v.maxfree)
    assert all(not (v.window or v.softcap or v.varlen or v.bias) for v in vs if v.split)
    assert {v.d for v in vs if v.bias} == set(plan_fwd_sm90.SM90_BIAS_HEAD_DIMS)
    assert all(v.nc == 2 and not v.varlen for v in vs if v.bias)
    assert len({v.name for v in vs}) == len(vs) == len({v.name_expression for v in vs})
    for v in vs:
        assert v.smem_bytes <= H200_SMEM, v
        assert v.bn % 16 == 0 and v.d % 64 == 0
        assert v.file == "hopper/fwd.cu" and "-arch=sm_90a" in v.arch_options


@pytest.mark.parametrize("kw,why", [
    (dict(), None),
    (dict(dtype="float16", d=64), None),
    (dict(d=256, softcap=30.0), None),
    (dict(scale=-0.5, softcap=5.0), None),
    (dict(cc=80), "compute capability 8.0"),
    (dict(cc=120), "compute capability 12.0"),
    (dict(dtype="float32"), None),                       # hopper/fwd_f32.cu
    (dict(dtype="float32", d=64), None),
    (dict(dtype="float32", d=256), "head dims 256"),
    (dict(dtype="float32", softcap=5.0), "softcap"),
    (dict(dtype="float64"), "dtype float64"),
    (dict(d=96), "head dims 96"),
    (dict(d=128, d_v=64), "head dims 128 / 64"),
    (dict(has_alibi=True), "alibi"),
    (dict(scale=0.0), "scale 0.0"),
    (dict(smem=99 * 1024), "shared memory"),
], ids=["bf16_d128", "f16_d64", "d256_softcap", "negative_scale_softcap", "sm80", "sm120",
        "float32", "float32_d64", "float32_d256", "float32_softcap", "float64", "d96",
        "dv_differs", "alibi", "zero_scale", "small_smem"])
def test_coverage(kw, why):
    got = _unsupported(**kw)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


def test_strides_tma_accepts():
    bshd = _contig((2, 100, 4, 128))
    assert _unsupported(tensors=[bshd]) is None
    # bhsd storage viewed as bshd
    b, s, h, d = 2, 100, 4, 128
    assert _unsupported(tensors=[((b, s, h, d), (h * s * d, d, s * d, 1))]) is None
    # a row pitch of d + 3 elements: 262-byte rows are not 16-byte multiples
    bad = ((b, s, h, d), (s * h * (d + 3), h * (d + 3), d + 3, 1))
    assert "strides" in _unsupported(tensors=[bad])
    # size-1 dimensions may have any stride
    assert _unsupported(tensors=[((1, 1, 1, 128), (7, 5, 3, 1))]) is None
    # a broadcast (zero-stride) sequence dimension cannot be described
    assert "strides" in _unsupported(tensors=[((1, 10, 1, 128), (0, 0, 0, 1))])
    # a non-contiguous last dimension
    assert not gpu_tma.tma_strides_ok((1, 10, 1, 128), (2560, 256, 128, 2), 2)


def test_tma_tensor_geometry():
    dims, strides, box = gpu_tma.tma_tensor((2, 100, 4, 128), (51200, 512, 128, 1), 2, 128)
    assert dims == (128, 100, 4, 2)                   # innermost first: d, s, h, b
    assert strides == (1024, 256, 102400)             # bytes of s, h, b
    assert box == (64, 128, 1, 1)                     # 128-byte rows (the swizzle width)
    dims, strides, box = gpu_tma.tma_tensor((1, 1, 1, 64), (9, 9, 9, 1), 2, 64)
    assert all(st % 16 == 0 and st > 0 for st in strides)   # stand-ins for size-1 dims
    assert box == (64, 64, 1, 1)


def test_plan_fills_params_and_grid():
    plan = plan_fwd_sm90.plan_forward_sm90("bfloat16", 3, 1000, 777, 8, 2, 128, 128, scale=0.125,
                                   window_left=-1, window_right=0, softcap=0.0)
    v = plan.variant
    assert isinstance(v, plan_fwd_sm90.Sm90Variant) and v.window and not v.softcap
    # persistent grid: min(work tiles, SMs) blocks over 8 query tiles x 8 heads x 3 batches
    assert plan.grid == (132, 1, 1) and plan.block == (384, 1, 1) and plan.smem == v.smem_bytes
    small = plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 200, 200, 2, 2, 64, 64, scale=0.1, num_sms=132)
    assert small.grid == (4, 1, 1) and not small.variant.split   # tiles of 2 key tiles: whole
    prm = plan.params
    assert prm["h_per_hk"] == 4 and prm["diag_offset"] == 777 - 1000
    assert prm["window_right"] == 0 and prm["window_left"] == 1000 + 777
    assert prm["num_m_blocks"] == 8
    assert np.isclose(prm["scale_log2"], 0.125 * gpu_params.LOG2E)


def test_plan_rejects_a_forced_variant_that_cannot_compute():
    v = plan_fwd_sm90.Sm90Variant("bf16_t", 128, 128, 2, False, False)
    with pytest.raises(ValueError, match="cannot compute"):
        plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 10, 10, 1, 1, 128, 128, scale=0.1,
                                window_left=5, variant=v)
    with pytest.raises(ValueError, match="cannot compute"):
        plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 10, 10, 1, 1, 128, 128, scale=0.1, softcap=3.0,
                                variant=v)


def test_wgmma_header_is_generated_and_current():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_wgmma.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_smem_layout_mirror():
    """sm90_smem_bytes mirrors sm90::Layout in hopper/fwd.cu (the kernel traps on a mismatch)."""
    src = _kernel_source("hopper/fwd.cu")
    assert "TILE = BARS + 8 * (2 + 5 * STAGES)" in src and "BYTES = TILE + 8" in src and "if (smem_given < L::BYTES + 1024) __trap();" in src
    assert "O_SMEM = !VARLEN && RING_BYTES + NC * O_WG + 1024 <= SMEM_MAX" in src
    assert "constexpr int SMEM_MAX = 227 * 1024;" in src
    ring = 2 * 128 * (128 + 4 * 128) + 8 * 13 + 1024
    # O [128, 128] staged for the TMA store; not with packed sequences
    assert plan_fwd_sm90.sm90_smem_bytes(128, 128, 2) == ring + 2 * 128 * 128
    assert plan_fwd_sm90.sm90_smem_bytes(128, 128, 2, varlen=True) == ring
    # three consumer warpgroups: a 192-row Q tile (and O)
    assert plan_fwd_sm90.sm90_smem_bytes(64, 128, 2, 3) == 2 * 64 * (192 + 4 * 128) + 8 * 13 + 1024 + 2 * 64 * 192


@pytest.mark.parametrize("d,bn,stages,nc,varlen,staged", [
    (64, 128, 2, 3, False, True), (64, 128, 2, 2, False, True), (128, 128, 2, 2, False, True),
    (128, 128, 2, 2, True, False),      # packed sequences: O stored directly
    (128, 176, 2, 2, False, False),     # 208 KB of ring: 32 KB more does not fit in 227
    (256, 80, 2, 2, False, False)], ids=["d64_nc3", "d64_nc2", "d128", "d128_varlen", "d128_wide", "d256"])
def test_o_staged_where_it_fits(d, bn, stages, nc, varlen, staged):
    v = plan_fwd_sm90.Sm90Variant("bf16_t", d, bn, stages, False, False, nc, varlen)
    assert v.o_smem is staged
    assert v.smem_bytes <= gpu_variants.SM90_SMEM_MAX
    assert (v.smem_bytes + 2 * d * 64 * nc <= gpu_variants.SM90_SMEM_MAX) is (staged or varlen)


@pytest.mark.parametrize("d,bn,varlen,dtype_name,align", [
    (64, 128, False, "bfloat16", 16), (128, 128, False, "float16", 16),   # O staged: TMA store
    (128, 176, False, "bfloat16", 4), (256, 80, False, "float16", 4),    # O stored as 16-bit pairs
    (128, 128, True, "bfloat16", 4)], ids=["d64", "d128", "d128_wide", "d256", "d128_varlen"])
def test_out_alignment_the_forward_needs(d, bn, varlen, dtype_name, align):
    """A kernel that stages O has only the TMA store (out 16-byte aligned); the others store
    16-bit pairs (4 bytes); float32 quads need 16 (the launcher sends other bases to the
    portable kernel)."""
    from cupyflash.gpu.plan_fwd_sm90 import sm90_out_align
    v = plan_fwd_sm90.Sm90Variant("bf16_t", d, bn, 2, False, False, 2, varlen)
    assert sm90_out_align(v, dtype_name) == align
    assert sm90_out_align(v, "float32") == 16


# ---------------------------------------------------------------------------------------------
# Hopper backward (cupyflash/gpu/plan_bwd_sm90.py)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,why", [
    (dict(), None),
    (dict(dtype="float16", d=64), None),
    (dict(d=256), None),
    (dict(d=256, deterministic=True), None),
    (dict(d=256, has_bias=True), "a bias at head dim 256"),
    (dict(d=128, d_v=64), "head dims 128 / 64"),
    (dict(softcap=3.0), "softcap"),
    (dict(has_alibi=True), "alibi"),
    (dict(deterministic=True), None),
    (dict(deterministic=True, d=64, dtype="float16"), None),
    (dict(deterministic=True, has_bias=True), "deterministic=True with a bias"),
    (dict(has_bias=True), None),
    (dict(scale=-1.0), "scale -1.0"),
    (dict(cc=80), "compute capability 8.0"),
    (dict(dtype="float32"), "dtype float32"),
], ids=["bf16_d128", "f16_d64", "d256", "d256_det", "d256_bias", "dv_differs", "softcap", "alibi", "deterministic",
        "deterministic_f16_d64", "deterministic_bias", "bias", "negative_scale", "sm80",
        "float32"])
def test_backward_coverage(kw, why):
    from cupyflash.gpu import plan_bwd_sm90
    args = dict(dtype="bfloat16", d=128, d_v=None, scale=0.1, softcap=0.0, has_alibi=False,
                deterministic=False, cc=90)
    args.update(kw)
    d = args.pop("d")
    d_v = args.pop("d_v") or d
    got = plan_bwd_sm90.why_unsupported(args.pop("dtype"), d, d_v, smem_optin=H200_SMEM, **args)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


def test_backward_variants_fit_and_layout_mirror():
    from cupyflash.gpu import plan_bwd_sm90
    vs = plan_bwd_sm90.variants()
    assert len(vs) == 72 and len({v.name for v in vs}) == 72 == len({v.name_expression for v in vs})
    assert {(v.varlen, v.bias, v.det) for v in vs} == {
        (False, 0, False), (False, 1, False), (False, 2, False), (False, 3, False),
        (True, 0, False), (False, 0, True), (True, 0, True)}
    assert all(v.smem_bytes <= H200_SMEM for v in vs)
    assert {(v.d, v.kvbuf) for v in vs} == {(64, 2), (128, 1), (256, 1)}
    # head dim 256: dense and varlen, deterministic or not, no bias, dQ from registers, 64-key tiles
    assert {(v.varlen, v.bias, v.det, v.dq_bulk, v.bn) for v in vs if v.d == 256} == {
        (vl, 0, det, False, 64) for vl in (False, True) for det in (False, True)}
    src = _kernel_source("hopper/bwd.cu")
    for expr in ("V = K + KVBUF * KV_TILE", "Q = V + KVBUF * KV_TILE", "DQ = DS + 2 * DS_TILE",
                 "DQ_PITCH = D * 4;", "BIAS_PANEL = BM * 128;",
                 "BIAS_TILE = BIAS_SMEM ? (BN / PANEL_COLS) * BIAS_PANEL : 0;",
                 "BIAS = DQ + (SPLIT_D ? 0 : BM * DQ_PITCH)", "ROWS = BIAS + NBUF * BIAS_TILE",
                 "BN = SPLIT_D ? 64 : sm90b::BN", "PT = DS + DS_TILE",
                 "TILE = ROWS + NBUF * 2 * BM * 4",
                 "constexpr int BIAS_NONE = 0;", "constexpr int BIAS_LD16 = 1;",
                 "constexpr int BIAS_LD32 = 2;", "constexpr int BIAS_TMA = 3;",
                 "JOB = TILE + 16", "BARS = JOB + (DET ? 32 : 16)",
                 "BYTES = BARS + 8 * (2 * KVBUF + 2 * NBUF + 2 + 2 * TILE_RING + (SPLIT_D ? 2 : 0))",
                 "if (smem_given < L::BYTES + 1024) __trap();"):
        assert expr in src, expr
    assert plan_bwd_sm90.smem_bytes(128) == (2 * 128 * 128 * 2 + 2 * 2 * 64 * 128 * 2 + 2 * 128 * 64 * 2
                                   + 64 * 128 * 4 + 1024 + 32 + 8 * 12 + 1024)
    assert plan_bwd_sm90.smem_bytes(64) == (2 * 2 * 128 * 64 * 2 + 2 * 2 * 64 * 64 * 2 + 2 * 128 * 64 * 2
                                  + 64 * 64 * 4 + 1024 + 32 + 8 * 14 + 1024)
    # d = 256: 64-key K, V; dSᵀ and Pᵀ [64, 64]; no dQ tile; Pᵀ's two mbarriers
    assert plan_bwd_sm90.smem_bytes(256) == (2 * 64 * 256 * 2 + 2 * 2 * 64 * 256 * 2 + 2 * 64 * 64 * 2
                                             + 1024 + 32 + 8 * 14 + 1024) <= H200_SMEM
    # a second K / V buffer does not fit at d = 128; the staged bias tiles do
    assert plan_bwd_sm90.smem_bytes(128, 2) > H200_SMEM
    assert plan_bwd_sm90.smem_bytes(128, 1, True) == plan_bwd_sm90.smem_bytes(128) + 2 * 64 * 128 * 2 <= H200_SMEM
    assert plan_bwd_sm90.smem_bytes(64, 2, True) == plan_bwd_sm90.smem_bytes(64) + 2 * 64 * 128 * 2
    # DET: two more u64 fields of the dQ job
    for d in (64, 128):
        assert plan_bwd_sm90.smem_bytes(d, det=True) == plan_bwd_sm90.smem_bytes(d) + 16


def test_backward_bias_variant_names():
    from cupyflash.gpu import plan_bwd_sm90
    v = plan_bwd_sm90.variant_for("bf16_t", 128, False, 1)
    assert v.name == "bwd90_bf16_d128_64x128_bias16"
    assert v.name_expression == "flash_bwd_sm90<bf16_t, 128, false, true, 1, false, 1>"
    v = plan_bwd_sm90.variant_for("f16_t", 64, True, 2)
    assert v.name == "bwd90_f16_d64_64x128_window_kv2_bias32"
    assert v.name_expression == "flash_bwd_sm90<f16_t, 64, true, true, 2, false, 2>"
    assert plan_bwd_sm90.variant_for("f16_t", 64, True).name_expression.endswith(", 2, false, 0>")
    # the bias reads / dbias writes take no shared memory
    assert v.smem_bytes == plan_bwd_sm90.smem_bytes(64)


@pytest.mark.parametrize("strides,s_k,ptr,itemsize,why", [
    ((0, 1024, 32, 1), 32, 256, 2, None),            # (1, h, s, s)
    ((32, 0, 0, 1), 32, 256, 4, None),               # (b, 1, 1, s_k) float32
    ((0, 0, 0, 0), 32, 256, 2, "key stride 0"),      # (1, 1, 1, 1): constant along keys
    ((0, 0, 1, 32), 32, 256, 2, "key stride 32"),    # a transposed view
    ((0, 0, 31, 1), 31, 256, 2, "odd seqlen_k 31"),
    ((0, 0, 33, 1), 32, 256, 2, "aligned pairs"),    # odd row stride
    ((0, 0, 32, 1), 32, 258, 4, "aligned pairs"),    # float32 pair not 8-byte aligned
], ids=["h_s_s", "b_1_1_s_f32", "key_broadcast", "transposed", "odd_sk", "odd_stride",
        "misaligned"])
def test_backward_bias_layout(strides, s_k, ptr, itemsize, why):
    from cupyflash.gpu import plan_bwd_sm90
    got = plan_bwd_sm90.bias_unsupported(strides, s_k, ptr, itemsize)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got, got


@pytest.mark.parametrize("shape,strides,s_q,ptr,why", [
    ((1, 16, 1024, 1024), (0, 1 << 20, 1024, 1), 1024, 256, None),         # (1, h, s, s)
    ((2, 1, 257, 200), (257 * 200, 0, 200, 1), 257, 512, None),            # 400-byte rows
    ((1, 1, 1, 130), (0, 0, 0, 1), 1, 512, None),                          # s_q = 1
    ((2, 1, 1, 200), (200, 0, 0, 1), 257, 512, "broadcast over queries"),  # key padding
    ((1, 4, 257, 202), (0, 257 * 202, 202, 1), 257, 512, "16-byte"),       # 404-byte rows
    ((1, 4, 64, 64), (0, 64 * 64, 64, 1), 64, 520, "16-byte"),             # address
], ids=["h_s_s", "b_1_q_k", "sq1", "key_padding", "rows_404", "misaligned"])
def test_backward_bias_tma_layout(shape, strides, s_q, ptr, why):
    from cupyflash.gpu import tma as gpu_tma
    got = gpu_tma.bias_tma_unsupported(shape, strides, s_q, ptr, 2)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got, got


@pytest.mark.parametrize("s_q,window,softcap,nc,bn,blocks", [
    (4096, False, False, 3, 128, 1), (1024, False, False, 3, 128, 1), (4096, True, False, 3, 128, 1),
    (2560, True, False, 3, 128, 1), (2048, True, False, 1, 64, 3), (1024, True, False, 1, 64, 3),
    (1, True, False, 1, 64, 3), (4096, False, True, 2, 128, 1), (1024, True, True, 2, 128, 1),
    (2048, True, True, 2, 128, 1),
], ids=["long", "short", "long_causal", "2.5k_causal", "2k_causal", "short_causal", "one_row_causal",
        "softcap", "short_causal_softcap", "2k_causal_softcap"])
def test_hd64_consumer_count(s_q, window, softcap, nc, bn, blocks):
    """hd 64: three consumer warpgroups (192-row tiles), but causal / window calls of at most
    SM90_FEW_ROWS_SQ queries run one consumer with 64-key tiles, three blocks per SM, and softcap
    calls two consumers."""
    pl = plan_fwd_sm90.plan_forward_sm90("bfloat16", 2, s_q, s_q, 64, 64, 64, 64, scale=0.125,
                                 window_right=0 if window else -1, softcap=30.0 if softcap else 0.0)
    v = pl.variant
    assert v.nc == nc and v.bm == 64 * nc and v.bn == bn and pl.block == (128 * (nc + 1), 1, 1)
    assert v.blocks_per_sm == blocks
    assert pl.params["num_m_blocks"] == -(-s_q // v.bm)
    assert pl.grid == (min(pl.params["num_m_blocks"] * 64 * 2, 132 * blocks), 1, 1)
    assert v in plan_fwd_sm90.variants()


def test_blocks_per_sm_mirror_the_kernel():
    """Sm90Variant.blocks_per_sm is hopper/fwd.cu's BlocksPerSm: two blocks with one consumer (three
    with 64-key tiles) as far as an SM's shared memory holds them (1 KB reserved per block), one
    otherwise; the kernel's __launch_bounds__ asks for that many."""
    src = _kernel_source("hopper/fwd.cu")
    assert "WANT = NC == 1 ? (BN <= 64 ? 3 : 2) : 1;" in src
    assert "FIT = sm90::SMEM_PER_SM / (sm90::Layout<D, BN, STAGES, NC, VARLEN>::BYTES + 2048);" in src
    assert "constexpr int SMEM_PER_SM = 228 * 1024;" in src
    assert "__launch_bounds__(128 * (NC + 1), BlocksPerSm<D, BN, STAGES, NC, VARLEN>::VALUE)" in src
    assert plan_fwd_sm90.SM90_SMEM_PER_SM == 228 * 1024
    for v in plan_fwd_sm90.variants():
        want = (3 if v.bn <= 64 else 2) if v.nc == 1 else 1
        fit = plan_fwd_sm90.SM90_SMEM_PER_SM // (v.smem_bytes + 1024)   # smem_bytes = BYTES + 1024
        assert v.blocks_per_sm == min(want, fit), v.name
    one = plan_fwd_sm90.Sm90Variant("bf16_t", 128, 64, 2, True, False, 1)    # 99 KB: two fit, not three
    assert one.blocks_per_sm == 2
    assert plan_fwd_sm90.Sm90Variant("bf16_t", 128, 128, 2, True, False, 1).blocks_per_sm == 1



@pytest.mark.parametrize("s_k,kw,bn", [
    (8192, {}, 128), (6144, {}, 128), (4096, {}, 128), (16384, dict(window_right=0), 176),
    (12288, dict(window_right=0), 176), (8192, dict(window_right=0), 128), (2048, {}, 128),
    (1024, dict(window_right=0), 128), (8192, dict(softcap=30.0), 128),
    (8192, dict(window_left=1000, window_right=1000), 128),
    (16384, dict(window_left=10000, window_right=0), 176),
    (16384, dict(window_left=5000, window_right=0), 128),
], ids=["8k", "6k", "4k", "16k_causal", "12k_causal", "8k_causal", "2k", "1k_causal", "softcap",
        "narrow_window", "wide_window", "window_5000"])
def test_hd128_key_tile_width(s_k, kw, bn):
    """hd 128: key tiles of 176 where query rows see at least SM90_WIDE_MIN_KEYS keys on
    average in a causal / window band (no softcap, no bias), 128 otherwise: dense calls without
    a band take the max-free softmax on 128-key tiles instead (SM90_MAXFREE_MIN_KEYS)."""
    pl = plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, s_k, s_k, 16, 16, 128, 128, scale=0.088, **kw)
    v = pl.variant
    assert v.bn == bn and v.bm == 128 and v in plan_fwd_sm90.variants() and pl.smem == v.smem_bytes
    keys = plan_fwd_sm90.sm90_keys(s_k, s_k, kw.get("window_left", -1), kw.get("window_right", -1))
    band = "window_right" in kw or "window_left" in kw
    assert (keys >= plan_fwd_sm90.SM90_WIDE_MIN_KEYS and band) == (bn == 176) or "softcap" in kw
    assert v.maxfree == (not band and "softcap" not in kw and keys >= plan_fwd_sm90.SM90_MAXFREE_MIN_KEYS)


@pytest.mark.parametrize("bottom_right", [True, False], ids=["bottom_right", "top_left"])
def test_sm90_keys_is_the_mean_over_rows(rng, bottom_right):
    """sm90_keys's closed form against a count over rows, on random lengths and windows."""
    for _ in range(200):
        s_q, s_k = (int(x) for x in rng.integers(1, 400, 2))
        wl, wr = (int(rng.choice([-1, 0, rng.integers(1, 500)])) for _ in range(2))
        diag = s_k - s_q if bottom_right else 0
        i = np.arange(s_q)
        hi = np.full(s_q, s_k) if wr < 0 else np.clip(i + diag + wr + 1, 0, s_k)
        lo = np.zeros(s_q) if wl < 0 else np.clip(i + diag - wl, 0, s_k)
        want = np.maximum(hi - lo, 0).mean()
        assert plan_fwd_sm90.sm90_keys(s_q, s_k, wl, wr, bottom_right) == pytest.approx(want, abs=1e-9), \
            (s_q, s_k, wl, wr)


def test_wide_key_tiles_only_at_hd128_dense():
    """Bias and varlen calls keep 128-key tiles at any length, and so do hd 64 and hd 256."""
    many = 4 * plan_fwd_sm90.SM90_WIDE_MIN_KEYS
    assert plan_fwd_sm90.sm90_variant("bf16_t", 128, False, False, bias=1, keys=many).bn == 128
    assert plan_fwd_sm90.sm90_variant("bf16_t", 128, True, False, varlen=True, keys=many).bn == 128
    assert plan_fwd_sm90.sm90_variant("bf16_t", 64, False, False, keys=many) == \
        plan_fwd_sm90.sm90_variant("bf16_t", 64, False, False)
    assert plan_fwd_sm90.sm90_variant("bf16_t", 256, False, False, keys=many).bn == 80

@pytest.mark.parametrize("d,s_k,kw,maxfree", [
    (128, 1024, {}, True), (128, 4096, {}, True), (128, 1023, {}, False), (128, 512, {}, False),
    (128, 16384, {}, True), (128, 4096, dict(window_right=0), False),
    (128, 4096, dict(window_left=3000, window_right=3000), False),
    (128, 4096, dict(softcap=30.0), False), (64, 4096, {}, False), (256, 4096, {}, False),
], ids=["1k", "4k", "1023", "512", "16k", "causal", "window", "softcap", "hd64", "hd256"])
def test_maxfree_choice(d, s_k, kw, maxfree):
    """The max-free softmax (MAXFREE) where its measured gain is: dense hd 128 calls without a
    band or softcap whose rows see at least SM90_MAXFREE_MIN_KEYS keys, on 128-key tiles (long
    rows too, which took 176-key tiles before); its variants are compiled (sm90_variants) and
    named."""
    pl = plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 512, s_k, 16, 16, d, d, scale=0.088, **kw)
    v = pl.variant
    assert v.maxfree == maxfree and v in plan_fwd_sm90.variants()
    assert ("_maxfree" in v.name) == maxfree and v.name_expression.endswith(
        f"{'true' if maxfree else 'false'}>")
    if maxfree:
        assert v.bn == 128 and not (v.window or v.softcap or v.varlen or v.bias)
    many = 4 * plan_fwd_sm90.SM90_MAXFREE_MIN_KEYS
    assert not plan_fwd_sm90.sm90_variant("bf16_t", 128, False, False, bias=1, keys=many).maxfree
    assert not plan_fwd_sm90.sm90_variant("bf16_t", 128, False, False, varlen=True, keys=many).maxfree


@pytest.mark.parametrize("kw", [dict(window_right=0), dict(window_left=100), dict(softcap=30.0)],
                         ids=["causal", "window", "softcap"])
def test_forced_maxfree_refuses_what_it_cannot_compute(kw):
    """A forced MAXFREE variant (dense, no band or softcap) on a causal, windowed or softcapped
    call: a ValueError naming the kernel, before any launch."""
    v = plan_fwd_sm90.sm90_variant("bf16_t", 128, False, False, keys=4096)
    assert v.maxfree
    with pytest.raises(ValueError, match=f"kernel {v.name} cannot compute"):
        plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 4096, 4096, 2, 2, 128, 128, scale=0.1, variant=v,
                                **kw)


@pytest.mark.parametrize("window,softcap", [(False, False), (True, False), (False, True)],
                         ids=["plain", "causal", "softcap"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_plan(d, window, softcap):
    """Packed sequences: the VARLEN variant, one work tile per (BM rows of the longest sequence,
    head, sequence), totals as s_q / s_k, causal aligned per sequence."""
    pl = plan_fwd_sm90.plan_forward_varlen_sm90("bfloat16", 5, 3000, 2800, 1100, 900, 8, 2, d, d,
                                        scale=0.1, window_right=0 if window else -1,
                                        softcap=20.0 if softcap else 0.0, num_sms=132)
    v, prm = pl.variant, pl.params
    assert v.varlen and v.window == window and v.softcap == softcap and v in plan_fwd_sm90.variants()
    assert v.nc == 2 and "_varlen" in v.name and v.name_expression.endswith(", true, 0, false, false>")
    assert (int(prm["b"]), int(prm["s_q"]), int(prm["s_k"])) == (5, 3000, 2800)
    assert int(prm["num_m_blocks"]) == -(-1100 // v.bm) and int(prm["diag_offset"]) == 0
    assert int(prm["varlen_bottom_right"]) == 1 and int(prm["h_per_hk"]) == 4
    assert pl.grid == (min(132, -(-1100 // v.bm) * 8 * 5), 1, 1)
    assert pl.block == (v.threads, 1, 1) and pl.smem == v.smem_bytes
    if window:
        assert int(prm["window_left"]) == 3000 + 2800 and int(prm["window_right"]) == 0
    # a dense call cannot take the varlen instantiation, nor a varlen call the dense one
    with pytest.raises(ValueError, match="cannot compute"):
        plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 10, 10, 8, 2, d, d, scale=0.1,
                                window_right=0 if window else -1,
                                softcap=20.0 if softcap else 0.0, variant=v)


def test_backward_varlen_variant_names():
    """VARLEN is the sixth template argument (after KVBUF); its names end in _varlen; the dense
    names are unchanged."""
    from cupyflash.gpu import plan_bwd_sm90
    dense = plan_bwd_sm90.variant_for("bf16_t", 128, True)
    vl = plan_bwd_sm90.variant_for("bf16_t", 128, True, varlen=True)
    assert dense.name == "bwd90_bf16_d128_64x128_window" and not dense.varlen
    assert dense.name_expression == "flash_bwd_sm90<bf16_t, 128, true, true, 1, false, 0>"
    assert vl.name == "bwd90_bf16_d128_64x128_window_varlen"
    assert vl.name_expression == "flash_bwd_sm90<bf16_t, 128, true, true, 1, true, 0>"
    v64 = plan_bwd_sm90.variant_for("f16_t", 64, False, varlen=True)
    assert v64.name == "bwd90_f16_d64_64x128_kv2_varlen" and v64.kvbuf == 2
    assert v64.name_expression == "flash_bwd_sm90<f16_t, 64, false, true, 2, true, 0>"
    assert vl.smem_bytes == dense.smem_bytes
    assert {v.name for v in plan_bwd_sm90.variants() if v.varlen and not v.det} == {
        f"bwd90_{e}_d{d}_64x128{w}{kv}_varlen" for e in ("f16", "bf16") for d in (64, 128)
        for w in ("", "_window") for kv in (("_kv2",) if d == 64 else ("",))} | {
        f"bwd90_{e}_d256_64x64{w}_red_varlen" for e in ("f16", "bf16") for w in ("", "_window")}


@pytest.mark.parametrize("mode", ["plain", "causal", "causal_top_left", "window", "left_window"])
@pytest.mark.parametrize("lens", [((5, 1, 0, 300, 64, 129, 3, 260), (7, 65, 3, 257, 0, 300, 3, 250)),
                                  ((127, 131, 1, 257, 61, 0, 2), (127, 131, 1, 257, 61, 5, 0))],
                         ids=["mixed", "primes"])
@pytest.mark.parametrize("bn", [128, 64], ids=["bn128", "bn64_d256"])
def test_backward_varlen_tiles_cover_the_band_once(lens, mode, bn):
    """The VARLEN decomposition (varlen_work_tiles, the kernel's work_tile mirror) and the
    kernel's per-step mask (need_mask; keep = key − n0 < s_k − n0 and, windowed, nrel + (key −
    n0) − row within [−left, right], nrel = n0 − diag) give every (sequence, head, row, key)
    pair of each sequence's band exactly once, none outside it (rows past s_q: lse = +inf).
    ``bn``: the key tile of head dims 64 / 128 (128) and of head dim 256 (64, whose mask lives in
    hopper/bwd_split_consumer.cuh)."""
    import numpy as np

    from cupyflash.gpu import plan_bwd_sm90
    lens_q, lens_k = lens
    cq = np.concatenate([[0], np.cumsum(lens_q)])
    ck = np.concatenate([[0], np.cumsum(lens_k)])
    h, h_k = 4, 2
    unb = int(cq[-1] + ck[-1])
    wl, wr = {"plain": (-1, -1), "causal": (-1, 0), "causal_top_left": (-1, 0),
              "window": (20, 5), "left_window": (7, -1)}[mode]
    window = wl >= 0 or wr >= 0
    wl_p, wr_p = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    bottom_right = mode != "causal_top_left"
    seen = {}
    for w, z, kv_head, n0, m_first, m_count in plan_bwd_sm90.varlen_work_tiles(
            cq, ck, h, h_k, wl_p, wr_p, bottom_right, window, bn):
        s_q, s_k = lens_q[z], lens_k[z]
        diag = s_k - s_q if bottom_right else 0
        nk, nrel = s_k - n0, n0 - diag
        for st in range(m_count * (h // h_k)):
            head = kv_head * (h // h_k) + st // m_count
            m0 = (m_first + st % m_count) * plan_bwd_sm90.BM
            need_mask = nk < bn
            if window:
                need_mask |= nrel + bn - 1 > m0 + wr_p or nrel < m0 + plan_bwd_sm90.BM - 1 - wl_p
            kt = np.arange(bn)[:, None]
            col = np.arange(plan_bwd_sm90.BM)[None, :]
            keep = np.ones((bn, plan_bwd_sm90.BM), bool)
            rel = nrel + kt - m0 - col
            band = (kt < nk) & (rel <= wr_p) & (rel >= -wl_p)
            if need_mask:
                keep = band
            live = m0 + col < s_q                     # rows of the next sequence: P = 0
            assert need_mask or band[:, live[0]].all(), "an unmasked step needs masking"
            for j, i in zip(*np.nonzero(keep & live)):
                key = (z, head, int(m0 + i), int(n0 + j))
                seen[key] = seen.get(key, 0) + 1
    assert all(c == 1 for c in seen.values()), "a pair is visited twice"
    # the model above is the kernel's own mask and tile expressions (kept in step with them)
    src = _kernel_source("hopper/bwd.cu")
    split = ("const int nk = wt.s_k - n0, nrel = n0 - wt.diag;", "bool need_mask = nk < BN;",
             "need_mask |= nrel + BN - 1 > m0 + p.window_right || nrel < m0 + BM - 1 - p.window_left;",
             "const int rel = nrel + kt - m0 - col;", "bool keep = kt < nk;",
             "if (WINDOW) keep = keep & (rel <= p.window_right) & (rel >= -p.window_left);",
             "static constexpr int BN = SPLIT_D ? 64 : sm90b::BN;")
    for expr in split if bn == plan_bwd_sm90.BN_SPLIT else (
                 "bool need_mask = VARLEN ? nk < BN : n0 + BN > p.s_k;",
                 "need_mask |= VARLEN ? nrel + BN - 1 > m0 + p.window_right || nrel < m0 + BM - 1 - p.window_left",
                 "const int kt = key - n0, rel = nrel + kt - m0 - col;",
                 "keep = kt < nk;",
                 "if (WINDOW) keep = keep & (rel <= p.window_right) & (rel >= -p.window_left);",
                 "seq_smem[0] = wt.s_k - n0;", "seq_smem[1] = n0 - wt.diag;",
                 "} while (VARLEN && w < num_work && !wt.keys);"):
        assert expr in src, expr
    want = set()
    for z in range(len(lens_q)):
        s_q, s_k = lens_q[z], lens_k[z]
        diag = s_k - s_q if bottom_right else 0
        for i in range(s_q):
            for j in range(s_k):
                if (wl < 0 or j >= i + diag - wl) and (wr < 0 or j <= i + diag + wr):
                    want.update((z, hd, i, j) for hd in range(h))
    assert set(seen) == want


# ---------------------------------------------------------------------------------------------
# float32 Hopper forward (kernels_cu/hopper/fwd_f32.cu)
# ---------------------------------------------------------------------------------------------
def test_f32_variants_fit_and_are_distinct():
    vs = plan_fwd_sm90.f32_variants()
    assert len(vs) == 2 * len(plan_fwd_sm90.SM90_F32_HEAD_DIMS) * 2      # f32x3 / tf32 x head dims x window
    assert len({v.name for v in vs}) == len(vs) == len({v.name_expression for v in vs})
    for v in vs:
        assert v.smem_bytes <= H200_SMEM, v
        assert v.bn % 32 == 0 and v.d % 32 == 0 and v.nc in (1, 2) and v.stages >= 1
        assert v.file == "hopper/fwd_f32.cu" and "-arch=sm_90a" in v.arch_options
        assert v.name.startswith("fwd90_") and not v.softcap and not v.varlen and not v.bias
    # the 16-bit list (the compile harness's hopper/fwd.cu chunks) does not take them in
    assert not set(vs) & set(plan_fwd_sm90.variants())


def test_f32_smem_mirrors_the_kernel_layout():
    """sm90_f32_smem_bytes against sm90f32::Layout, recomputed here from the kernel's own text:
    Q big / small, per stage K big / small, Vt big / small and raw V, 3 + 7·STAGES mbarriers."""
    src = _kernel_source("hopper/fwd_f32.cu")
    assert "BARS + 8 * (3 + 7 * STAGES)" in src and "VRAW + STAGES * KVT" in src
    assert "KB = QS + (QREG ? 0 : QT)" in src
    for d, bn, st, nc in ((64, 64, 2, 2), (128, 32, 2, 1), (128, 64, 1, 1), (128, 32, 2, 2)):
        for qreg in (False, True):
            qt, kvt = 64 * nc * d * 4, bn * d * 4
            bars = (1 if qreg else 2) * qt + 5 * st * kvt
            assert plan_fwd_sm90.sm90_f32_smem_bytes(d, bn, st, nc, qreg) == bars + 8 * (3 + 7 * st) + 8 + 1024


def test_f32_plan():
    plan = plan_fwd_sm90.plan_forward_sm90("float32", 2, 1000, 1000, 16, 4, 128, 128, scale=0.1,
                                   window_right=0, num_sms=132)
    v = plan.variant
    assert isinstance(v, plan_fwd_sm90.Sm90F32Variant) and v.elem == "f32x3_t" and v.window
    assert plan.block == (v.threads, 1, 1) and plan.smem == v.smem_bytes
    assert plan.grid == (min(132, -(-1000 // v.bm) * 16 * 2), 1, 1)
    assert int(plan.params["num_m_blocks"]) == -(-1000 // v.bm)
    tf = plan_fwd_sm90.plan_forward_sm90("float32", 1, 64, 64, 2, 2, 64, 64, scale=0.1, allow_tf32=True)
    assert tf.variant.elem == "tf32_t" and not tf.variant.window
    assert tf.variant in plan_fwd_sm90.f32_variants()
    with pytest.raises(ValueError):
        plan_fwd_sm90.plan_forward_sm90("float32", 1, 64, 64, 2, 2, 64, 64, scale=0.1, softcap=5.0)


@pytest.mark.parametrize("auto", [True, False])
def test_f32_auto_flag_is_reported(monkeypatch, auto):
    """SM90_FLOAT32_AUTO (True since the H200 run) decides float32's kernel under kernel="auto";
    `python -m cupyflash info` says which, for either value."""
    from cupyflash.__main__ import _forward_kernels
    assert isinstance(TUNING.sm90_float32_auto, bool)
    monkeypatch.setattr(TUNING, "sm90_float32_auto", auto)
    text = _forward_kernels(90)
    assert ("hopper/fwd_f32.cu (3xTF32" in text) == auto
    assert ("float32: the portable kernel" in text) == (not auto)


def test_tma_tensor_float32_box():
    dims, strides, box = gpu_tma.tma_tensor((2, 100, 4, 128), (51200, 512, 128, 1), 4, 64)
    assert dims == (128, 100, 4, 2) and strides == (2048, 512, 204800) and box == (32, 64, 1, 1)
    assert _unsupported("float32", tensors=[((2, 100, 4, 128), (51200, 512, 128, 1))]) is None
    # a row pitch of 130 floats (520 bytes) is not a 16-byte multiple; 132 floats is
    assert "strides" in _unsupported("float32", tensors=[((1, 10, 1, 128), (1300, 130, 130, 1))])
    assert _unsupported("float32", tensors=[((1, 10, 2, 128), (2640, 264, 132, 1))]) is None


def _longest_first_tail(m, pairs, grid, w):
    """Mirror of hopper/sm90.cuh: longest_first_tail (the w-th work tile drawn -> its index; groups =
    the forwards' (head, batch) pairs)."""
    tail_pairs = min(pairs, (2 * grid + m - 1) // m)
    tail0 = (pairs - tail_pairs) * m
    if w < tail0:
        return w
    i = w - tail0
    return tail0 + (i % tail_pairs) * m + i // tail_pairs


@pytest.mark.parametrize("m,pairs,grid", [(4, 1024, 132), (8, 256, 132), (16, 64, 132),
                                          (64, 32, 132), (1, 5, 132), (16, 3, 132), (7, 100, 1)],
                         ids=["s512_hd64", "s1k", "s2k", "s8k", "one_tile", "few_pairs", "grid1"])
def test_longest_first_tail_order(m, pairs, grid):
    """The causal / window forwards' draw order is a permutation of the work tiles: pair by pair
    up to the last two waves, then every pair's longest remaining query tile first (the
    kernel's index w % m = j is the pair's j-th longest tile)."""
    src = _kernel_source("hopper/sched.cuh")
    for line in ("const int tail_groups = min(groups, (2 * grid + m - 1) / m);",
                 "const int tail0 = (groups - tail_groups) * m;",
                 "return tail0 + (i % tail_groups) * m + i / tail_groups;"):
        assert line in src, line
    order = [_longest_first_tail(m, pairs, grid, w) for w in range(m * pairs)]
    assert sorted(order) == list(range(m * pairs))
    tail_pairs = min(pairs, -(-2 * grid // m))
    head, tail = order[:(pairs - tail_pairs) * m], order[(pairs - tail_pairs) * m:]
    assert head == list(range(len(head)))
    assert len(tail) >= min(2 * grid, m * pairs)
    assert [w % m for w in tail] == sorted(w % m for w in tail)


# ---------------------------------------------------------------------------------------------
# The split tail (sm90_split, SPLIT variants)
# ---------------------------------------------------------------------------------------------
def _check_table(table, work, grid, n):
    """Invariants of a split table: the last (work − split_first) tiles, each covered by its
    pieces once, in order, contiguously; column 3 = 64 · first piece + pieces of the tile."""
    tail = int(table[-1, 0]) + 1
    assert 1 <= tail <= min(work, grid)
    assert list(np.unique(table[:, 0])) == list(range(tail))
    assert (np.diff(table[:, 0]) >= 0).all()
    for r in range(tail):
        rows = np.flatnonzero(table[:, 0] == r)
        pieces = table[rows]
        starts, counts = pieces[:, 1], pieces[:, 2]
        assert starts[0] == 0 and (counts >= 1).all()
        assert list(starts[1:]) == list(np.cumsum(counts)[:-1]) and counts.sum() == n
        assert (pieces[:, 3] == 64 * rows[0] + len(rows)).all()
        assert len(rows) <= plan_fwd_sm90.SM90_SPLIT_MAX_PARTS + 1 < 64
    return tail


@settings(max_examples=300, deadline=None)
@given(work=st.integers(1, 5000), grid=st.integers(1, 300), n=st.integers(1, 600),
       force=st.booleans())
def test_split_table_covers_every_tail_tile_once(work, grid, n, force):
    table = plan_fwd_sm90.sm90_split(work, grid, n, force=force)
    full, tail = divmod(work, grid)
    if table is None:                      # only the model declines (a forced split never)
        assert not force
        return
    got = _check_table(table, work, grid, n)
    assert got == (tail if tail else grid)                     # forced: the last full wave
    assert force or tail > 0


@pytest.mark.parametrize("work,grid,n,parts", [
    (2048, 132, 16, 0),         # FA shapes, hd 128, 2k: 15 waves + 68 tiles, 68 > 132 / 2
    (1056, 132, 32, 0),         # a whole number of waves
    (1, 132, 1, 0),             # one tile of one key tile: nothing to split
    (128, 132, 128, 0),         # 128 tiles: one piece each
    (8, 132, 8, 2),             # few tiles of eight key tiles: two pieces of four each
    (64, 132, 4, 0),            # b 1, h 16, s 512: pieces of two key tiles ran slower
    (64, 132, 16, 2),           # b 1, h 4, s 2k (hd 128): two pieces of 8 key tiles each
    (176, 132, 32, 3),          # one wave and 44 tiles: three pieces each
    (2000, 132, 4, 0),          # 20 tiles past 15 waves, but of four key tiles: under 5 %
    (133, 132, 64, 16),         # one tile past a wave: 16 pieces (SM90_SPLIT_MAX_PARTS)
    (133, 132, 20, 5),          # ... of 20 key tiles: five pieces of four
])
def test_split_model(work, grid, n, parts):
    table = plan_fwd_sm90.sm90_split(work, grid, n)
    assert (0 if table is None else int(table[0, 3]) % 64) == parts
    if table is not None:           # one round: at most one piece per block
        assert len(table) == (work % grid) * parts <= grid


def test_split_tail_model_choices():
    """Where the planner splits on the H200 (132 SMs): never on FlashAttention's benchmark shapes
    (hd 128: 2048 work tiles, a tail of 68 tiles: one piece per tile fits), nor on a whole number
    of waves; where few tiles leave most SMs idle, yes."""
    def split(b, s, h=16, d=128):
        return plan_fwd_sm90.plan_forward_sm90("bfloat16", b, s, s, h, h, d, d, scale=0.1).variant.split
    assert not any(split(16384 // s, s) for s in (512, 1024, 2048, 4096, 8192, 16384))
    assert not any(split(16384 // s, s, 2048 // d, d) for s in (512, 4096, 16384)
                   for d in (64, 256))
    assert not split(1, 4096, 33)             # 32 tiles x 33 heads = 1056 = 8 waves
    assert split(1, 2048, 4) and split(1, 4096, 1) and split(1, 4096, 8, 64)


@pytest.mark.parametrize("kw", [dict(window_right=0), dict(softcap=10.0), dict()],
                         ids=["causal", "softcap", "plain"])
def test_split_plan_params(kw):
    """The planner's SPLIT plan: split_first = the whole tiles, split_pieces = the table's rows,
    a grid over whole tiles + pieces; never with a band or softcap; a forced plain variant never
    splits, a forced SPLIT one always (and refuses a band)."""
    args = ("bfloat16", 2, 1000, 3000, 4, 2, 128, 128)
    plan = plan_fwd_sm90.plan_forward_sm90(*args, scale=0.1, **kw)
    work = 8 * 4 * 2
    if kw:
        assert plan.split is None and not plan.variant.split
        assert int(plan.params["split_first"]) == work
        if "window_right" in kw:
            with pytest.raises(ValueError, match="cannot compute"):
                plan_fwd_sm90.plan_forward_sm90(*args, scale=0.1, variant=plan_fwd_sm90.sm90_variant(
                    "bf16_t", 128, False, False, split=True), **kw)
        return
    # (3000 keys a row: the max-free softmax's split twin)
    assert plan.variant.split and plan.variant.name.endswith("_split_maxfree")
    first, pieces = int(plan.params["split_first"]), int(plan.params["split_pieces"])
    assert first == 0 and len(plan.split) == pieces         # 64 tiles < 132 SMs: all split
    _check_table(plan.split, work, 132, 24)
    assert plan.grid == (min(132, pieces), 1, 1)
    plain = plan_fwd_sm90.plan_forward_sm90(*args, scale=0.1, variant=plan_fwd_sm90.sm90_variant(
        "bf16_t", 128, False, False))
    assert plain.split is None and not plain.variant.split and plain.grid == (64, 1, 1)
    forced = plan_fwd_sm90.plan_forward_sm90("bfloat16", 1, 4096, 4096, 33, 33, 128, 128, scale=0.1,
                                     variant=plan_fwd_sm90.sm90_variant("bf16_t", 128, False, False,
                                                                split=True))
    first, pieces = int(forced.params["split_first"]), int(forced.params["split_pieces"])
    assert forced.variant.split and first == 1056 - 132 and len(forced.split) == first + pieces
    # the work items: whole tiles (w, 0, n, 1), then the pieces of tiles first .. 1055
    assert (forced.split[:first] == np.c_[np.arange(first), np.zeros(first), np.full(first, 32),
                                          np.ones(first)]).all()
    tail = forced.split[first:].copy()
    tail[:, 0] -= first
    assert _check_table(tail, 1056, 132, 32) == 132
    assert forced.grid == (132, 1, 1)
    with pytest.raises(ValueError, match="split: dense calls"):
        plan_fwd_sm90.sm90_variant("bf16_t", 128, True, False, split=True)


def test_work_items_table():
    pieces = plan_fwd_sm90.sm90_split(140, 132, 10)
    items = plan_fwd_sm90.sm90_work_items(132, pieces, 10)
    assert len(pieces) == 8 * 2                 # 8 tiles past the wave, 2 pieces of 5 each
    assert items.dtype == np.int32 and items.shape == (132 + len(pieces), 4)
    assert list(items[131]) == [131, 0, 10, 1]
    assert list(items[132]) == [132 + pieces[0, 0], *pieces[0, 1:]]
    assert (items[132:, 3] == pieces[:, 3]).all()   # first piece counted from the first piece


def test_split_workspace_bytes():
    v = plan_fwd_sm90.sm90_variant("bf16_t", 128, False, False, split=True)
    assert plan_fwd_sm90.sm90_split_ws_bytes(v, 10) == 10 * 2 * 128 * (64 + 4) * 4
