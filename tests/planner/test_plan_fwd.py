"""CPU tests of the forward planner (cupyflash/gpu/plan_fwd.py): no GPU, no CuPy needed."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cupyflash.gpu import params as gpu_params, plan_fwd, variants as gpu_variants

KERNELS = Path(__file__).resolve().parents[2] / "kernels_cu"


def _plan_simple(**kw):
    args = dict(dtype_name="bfloat16", b=2, s_q=1000, s_k=1000, h=16, h_k=16, d=128, d_v=128,
                scale=0.125)
    args.update(kw)
    return plan_fwd.plan_forward(args.pop("dtype_name"), args.pop("b"), args.pop("s_q"),
                              args.pop("s_k"), args.pop("h"), args.pop("h_k"), args.pop("d"),
                              args.pop("d_v"), **args)


def test_params_dtype_mirrors_c_struct():
    """Field names / order / C types of Params in common/params.cuh match PARAMS_FIELDS."""
    src = (KERNELS / "common" / "params.cuh").read_text()
    body = re.search(r"struct Params \{(.*?)\n\};", src, re.S).group(1)
    ctype = {"const void*": np.uint64, "void*": np.uint64, "float*": np.uint64,
             "const float*": np.uint64, "const int*": np.uint64, "const unsigned char*": np.uint64,
             "unsigned int*": np.uint64, "i64": np.int64, "int": np.int32, "float": np.float32,
             "double": np.float64}
    fields, tma = [], []
    for line in body.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line:
            continue
        if line.startswith("TmaDesc "):
            tma.append(line.split()[1])
            continue
        m = re.match(r"(const void\*|void\*|const float\*|float\*|const int\*|const unsigned char\*|unsigned int\*|i64|int|float|double)\s+(.*)", line)
        assert m, line
        for name in m.group(2).split(","):
            fields.append((name.strip(), ctype[m.group(1)]))
    assert [(n, np.dtype(t)) for n, t in fields] == \
        [(n, np.dtype(t)) for n, t in gpu_params.PARAMS_FIELDS]
    assert tuple(tma) == gpu_params.PARAMS_TMA_FIELDS
    assert gpu_params.PARAMS_DTYPE.itemsize == gpu_params.PARAMS_NBYTES
    # the TMA descriptors start on a 64-byte boundary and the size is a multiple of 64
    assert gpu_params.PARAMS_DTYPE.fields["tma_q"][1] % 64 == 0 and gpu_params.PARAMS_NBYTES % 64 == 0
    # and the kernels check sizeof(Params) against the mirror at compile time
    assert "static_assert(sizeof(Params) == CUPYFLASH_PARAMS_NBYTES" in src


def test_params_dtype_equals_cupy_make_aligned_dtype():
    cupy = pytest.importorskip("cupy")
    head = cupy.make_aligned_dtype(gpu_params.PARAMS_FIELDS)
    for name in head.names:
        assert head.fields[name] == gpu_params.PARAMS_DTYPE.fields[name]


@pytest.mark.parametrize("d,bucket", [(1, 32), (32, 32), (33, 64), (59, 64), (64, 64), (80, 96),
                                      (111, 128), (128, 128), (129, 160), (200, 224),
                                      (256, 256)])
def test_head_dim_bucket(d, bucket):
    assert gpu_variants.head_dim_bucket(d, 1) == bucket
    assert gpu_variants.head_dim_bucket(1, d) == bucket


def test_head_dim_too_large():
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        gpu_variants.head_dim_bucket(257, 64)


@pytest.mark.parametrize("dtype,tf32,elem", [("float16", False, "f16_t"),
                                             ("bfloat16", False, "bf16_t"),
                                             ("float32", False, "f32x3_t"),
                                             ("float32", True, "tf32_t"),
                                             ("bfloat16", True, "bf16_t"),
                                             ("float64", False, "f64_t")])
def test_elem(dtype, tf32, elem):
    assert gpu_variants.elem_tag(dtype, tf32) == elem


def test_unsupported_dtype():
    with pytest.raises(NotImplementedError, match="float16, bfloat16, float32 or float64"):
        gpu_variants.elem_tag("int8", False)


def test_flags():
    v = _plan_simple().variant
    assert not v.window and not v.score_mod
    assert _plan_simple(window_right=0).variant.window
    assert _plan_simple(window_left=10).variant.window
    assert _plan_simple(softcap=30.0).variant.score_mod
    assert _plan_simple(has_alibi=True).variant.score_mod
    assert _plan_simple(scale=-1.0).variant.score_mod       # max must be taken on scaled scores
    assert not _plan_simple(scale=0.3).variant.score_mod


def test_params_fields():
    p = _plan_simple(s_q=100, s_k=300, window_left=-1, window_right=0, h=8, h_k=2,
                     softcap=10.0, d=64, d_v=32)
    prm = p.params
    assert int(prm["diag_offset"]) == 200
    assert int(prm["window_right"]) == 0 and int(prm["window_left"]) == 400   # unbounded
    assert int(prm["h_per_hk"]) == 4
    assert int(prm["d"]) == 64 and int(prm["d_v"]) == 32
    assert np.isclose(float(prm["scale_log2"]), 0.125 * 1.4426950408889634)
    assert np.isclose(float(prm["softcap_pre"]), 0.0125)
    assert np.isclose(float(prm["softcap_post"]), 10 * 1.4426950408889634)
    top_left = _plan_simple(s_q=100, s_k=300, window_right=0, bottom_right=False)
    assert int(top_left.params["diag_offset"]) == 0


def test_grid_block_smem():
    p = _plan_simple(b=3, s_q=1000, h=5, h_k=5, d=64, d_v=64)
    v = p.variant
    assert p.grid == (-(-1000 // v.bm), 5, 3)
    assert p.block == (32 * v.nw, 1, 1)
    assert p.smem == v.smem_bytes == plan_fwd.smem_bytes(v.elem, v.d, v.bm, v.bn, v.stages)
    assert v.bm % (16 * v.nw) == 0 and v.bn % 16 == 0


@pytest.mark.parametrize("smem", [99 * 1024, 163 * 1024, 227 * 1024])
def test_all_variants_fit_and_cover(smem):
    vs = plan_fwd.variants(smem)
    assert len(set(vs)) == len(vs)
    for v in vs:
        assert v.smem_bytes <= smem, v
        assert v.bm % (16 * v.nw) == 0
        assert v.bn % (16 if v.elem in ("f16_t", "bf16_t") else 8) == 0
    # every plan the planner can make is in the enumerated set
    for dt in ("float16", "bfloat16", "float32"):
        for tf32 in (False, True):
            for d in (1, 40, 64, 100, 128, 150, 200, 256):
                for wr in (-1, 0):
                    for cap in (0.0, 5.0):
                        p = plan_fwd.plan_forward(dt, 1, 10, 10, 1, 1, d, d, scale=0.1,
                                               window_right=wr, softcap=cap,
                                               allow_tf32=tf32, smem_optin=smem)
                        assert p.variant in vs


def test_variant_names_unique_and_readable():
    vs = plan_fwd.variants()
    names = [v.name for v in vs]
    assert len(set(names)) == len(names)
    v = _plan_simple(window_right=0).variant
    assert v.name.startswith("fwd_bf16_d128_") and v.name.endswith("_window")
    assert v.name_expression.startswith("flash_fwd<bf16_t, 128, ")


def test_forced_variant_checked():
    v = _plan_simple().variant
    with pytest.raises(ValueError, match="cannot compute"):
        _plan_simple(window_right=0, variant=v)
    assert _plan_simple(variant=v).variant == v


def test_gqa_divisibility():
    with pytest.raises(ValueError):
        _plan_simple(h=6, h_k=4)


def test_vec_ok():
    assert gpu_params.vec_ok((0x1000, 0x2000), (64, 128, 8), 2)
    assert not gpu_params.vec_ok((0x1002,), (64,), 2)
    assert not gpu_params.vec_ok((0x1000,), (59,), 2)
    assert gpu_params.vec_ok((0x1000,), (4,), 4)


def test_flops():
    assert plan_fwd.flops(1, 1, 10, 20, 8, 8) == 4 * 10 * 20 * 8
    assert plan_fwd.flops(1, 1, 10, 20, 8, 8, causal=True) == 2 * 10 * 20 * 8


def test_no_cuda_headers_in_kernels():
    """Kernel sources include only our own headers, by their path from kernels_cu/ (the one -I),
    and no .cu includes a .cu (entries include headers; headers never include entries)."""
    for f in KERNELS.rglob("*"):
        if f.suffix in (".cu", ".cuh"):
            includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', f.read_text())
            assert all(i.endswith(".cuh") and (KERNELS / i).is_file() for i in includes), \
                (f, includes)


def test_modules_finds_sources_and_hashes():
    from cupyflash.gpu import compile as gpu_compile
    assert (gpu_compile.kernels_dir() / "portable" / "fwd.cu").exists()
    h = gpu_compile.source_hash()
    assert len(h) == 16
    src, opts, names = gpu_compile.program(plan_fwd.variants()[:3])
    assert any(o.startswith("-DCUPYFLASH_SRC_HASH=0x" + h) for o in opts)
    assert names == [v.name_expression for v in plan_fwd.variants()[:3]]
    assert "flash_fwd" in src


# ------------------------------------------------------------------------------------------
# GENERAL variants: bias / mask / varlen
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(has_bias=True), dict(has_mask=True),
                                dict(has_bias=True, has_mask=True, window_right=0)],
                         ids=["bias", "mask", "bias_mask_causal"])
def test_bias_or_mask_selects_the_general_variant(kw):
    pl = _plan_simple(**kw)
    v = pl.variant
    assert v.general == plan_fwd.GEN_ALL and v.window and v.score_mod
    assert v.name.endswith("_gen") and v.name_expression.endswith(", 3>")
    assert v.nw == 8 and v.bm // (16 * v.nw) == 1        # one 16-row slab per warp (registers)
    assert pl.grid == (-(-1000 // v.bm), 16, 2)


def test_plain_problem_keeps_the_plain_variant_and_its_expression():
    v = _plan_simple().variant
    assert v.general == 0 and not v.name_expression.endswith(", 0>")
    assert v.name_expression == "flash_fwd<bf16_t, 128, 128, 64, 4, 2, false, false>"


def test_varlen_plan_fields():
    pl = plan_fwd.plan_forward_varlen("float16", 5, 900, 1200, 300, 500, 8, 2, 64, 64, scale=0.1,
                                   window_right=0, bottom_right=False)
    v = pl.variant
    assert v.general == plan_fwd.GEN_VARLEN and v.name.endswith("_varlen")
    assert (v.bm, v.bn, v.nw) == plan_fwd.tiles("f16_t", 64, 227 * 1024)[:3]   # plain tiles
    assert pl.grid == (-(-300 // v.bm), 8, 5)
    prm = pl.params
    assert (prm["b"], prm["s_q"], prm["s_k"]) == (1, 900, 1200)
    assert prm["window_left"] == 2100 and prm["window_right"] == 0
    assert prm["varlen_bottom_right"] == 0 and prm["diag_offset"] == 0
    assert prm["num_m_blocks"] == pl.grid[0]


def test_forced_plain_variant_refuses_a_bias():
    v = _plan_simple().variant
    with pytest.raises(ValueError, match="cannot compute"):
        _plan_simple(has_bias=True, variant=v)


def test_all_variants_hold_one_varlen_and_one_general_per_bucket():
    vs = plan_fwd.variants()
    for elem in gpu_variants.ELEMS:
        for dbk in gpu_variants.HEAD_DIM_BUCKETS:
            gens = sorted(v.general for v in vs if v.elem == elem and v.d == dbk and v.general)
            assert gens == [plan_fwd.GEN_VARLEN, plan_fwd.GEN_ALL]
