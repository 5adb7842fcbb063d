"""NVRTC compile harness for the backward: every variant the planner (cupyflash.gpu.plan_bwd) can
select, with its two helper kernels, for sm_80 and sm_90a.

Runs without a GPU (NVRTC only). Fails on any compile error, and on register spills in the main
variants (float16 / bfloat16 at head dims 64 and 128). The ptxas report (registers, spill bytes,
shared memory per variant) is printed with `pytest -s`.
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash.gpu import compile as gpu_compile, plan_bwd, variants as gpu_variants  # noqa: E402

ARCHS = ("sm_80", "sm_90a")
SMEM = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}


@pytest.fixture(scope="module")
def reports():
    jobs = []
    for arch in ARCHS:
        vs = plan_bwd.variants(SMEM[arch])
        ds = plan_bwd.dbias_variants(SMEM[arch])
        for elem in gpu_variants.ELEMS:   # one program per (arch, element type), flash_bwd_dbias too
            jobs.append((arch,
                         [v for v in vs + ds if v.elem == elem], "portable/bwd.cu"))
    res = gpu_compile.nvrtc_reports(jobs)
    for arch in ARCHS:
        print(f"\n{arch}: registers / spill bytes / shared memory per backward variant")
        for v in plan_bwd.variants(SMEM[arch]):
            regs, spill = res[arch][v.name_expression]
            print(f"  {v.name:48s} {regs:4d} regs {spill:6d} B spill {v.smem_bytes:7d} B smem")
        for v in plan_bwd.dbias_variants(SMEM[arch]):
            regs, spill = res[arch][v.name_expression]
            print(f"  {v.name:48s} {regs:4d} regs {spill:6d} B spill {v.smem_bytes:7d} B smem")
    return res


@pytest.mark.all_variants
@pytest.mark.parametrize("arch", ARCHS)
def test_every_backward_variant_compiles(reports, arch):
    vs = plan_bwd.variants(SMEM[arch])
    want = {v.name_expression for v in vs} | {v.pre_expression for v in vs} \
        | {v.dq_expression for v in vs} \
        | {v.name_expression for v in plan_bwd.dbias_variants(SMEM[arch])}
    assert set(reports[arch]) == want


@pytest.mark.all_variants
@pytest.mark.parametrize("arch", ARCHS)
def test_dbias_variants_do_not_spill(reports, arch):
    bad = [f"{v.name}: {reports[arch][v.name_expression][1]} B spilled"
           for v in plan_bwd.dbias_variants(SMEM[arch])
           if reports[arch][v.name_expression][1]]
    assert not bad, "\n".join(bad)


@pytest.mark.all_variants
@pytest.mark.parametrize("arch", ARCHS)
def test_main_backward_variants_do_not_spill(reports, arch):
    bad = []
    for v in plan_bwd.variants(SMEM[arch]):
        if v.elem in ("f16_t", "bf16_t") and v.d in (64, 128):
            regs, spill = reports[arch][v.name_expression]
            if spill:
                bad.append(f"{v.name}: {spill} B spilled ({regs} regs)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_variants_fit_shared_memory(arch):
    for v in plan_bwd.variants(SMEM[arch]) + plan_bwd.dbias_variants(SMEM[arch]):
        assert v.smem_bytes <= SMEM[arch], v.name
