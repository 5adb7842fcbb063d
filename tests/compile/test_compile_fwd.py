"""NVRTC compile harness: every forward variant the planner can select, for sm_80 and sm_90a.

Runs without a GPU (NVRTC only, through cupy_backends). Fails on any compile error, and on
register spills above SPILL_BUDGET bytes in the main variants (float16 / bfloat16, head dims 64
and 128, plain and causal/window; not the softcap/ALiBi ones). The budget is not zero: the
fastest tiles (4 warps x two 16-row slabs, 255 registers) spill 12-36 bytes, and were measured
faster than the spill-free ones (hd128 289 vs 273 TFLOP/s, hd64 284 vs 263 on the H200;
docs/kernels.md). A larger spill means a real register-pressure regression. (72 B since the
bias/varlen merge: f16 hd128 causal/window on sm_90a went 60 -> 68 B with NVRTC 12.9 when the
GENERAL score rework met the Hopper fields of Params; the bias branch alone had 36 B. Not yet
measured on the GPU; on cc 9.0 the Hopper kernel takes these calls.)
Variants are compiled in a few multi-instantiation programs (name expressions), spread over the
CPU cores. The ptxas report (registers, spills per variant) is printed with `pytest -s`.
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
pytestmark = pytest.mark.all_variants   # the sweep; test_compile_families.py compiles one of each

from cupyflash.gpu import compile as gpu_compile, plan_fwd, variants as gpu_variants  # noqa: E402

ARCHS = ("sm_80", "sm_90a")
SPILL_BUDGET = 72   # bytes per main variant, see the module docstring
SMEM = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}


@pytest.fixture(scope="module")
def reports():
    jobs = []
    for arch in ARCHS:
        vs = plan_fwd.variants(SMEM[arch])
        # one program per (element type, flags): instantiations share the parse, chunks spread
        for elem in gpu_variants.ELEMS:
            for flags in ((False, False), (False, True), (True, False), (True, True)):
                chunk = [v for v in vs if v.elem == elem and (v.window, v.score_mod) == flags]
                jobs.append((arch, chunk, "portable/fwd.cu"))
    res = gpu_compile.nvrtc_reports(jobs)
    for arch in ARCHS:
        print(f"\n{arch}: registers / spill bytes per variant")
        for v in plan_fwd.variants(SMEM[arch]):
            regs, spill = res[arch][v.name_expression]
            print(f"  {v.name:40s} {regs:4d} regs {spill:6d} B spill")
    return res


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles(reports, arch):
    vs = plan_fwd.variants(SMEM[arch])
    assert set(reports[arch]) == {v.name_expression for v in vs}


@pytest.mark.parametrize("arch", ARCHS)
def test_main_variants_do_not_spill(reports, arch):
    bad = []
    for v in plan_fwd.variants(SMEM[arch]):
        if v.elem in ("f16_t", "bf16_t") and v.d in (64, 128) and not v.score_mod:
            regs, spill = reports[arch][v.name_expression]
            if spill > SPILL_BUDGET:
                bad.append(f"{v.name}: {spill} B spilled ({regs} regs)")
    assert not bad, "\n".join(bad)
