"""NVRTC compile harness for the backward: every variant the planner (cupyflash.gpu.plan_bwd) can
select, with its two helper kernels, and the dbias kernels, for each portable target (targets.PORTABLE:
sm_80, sm_86, sm_89, sm_90a, sm_120, each with its opt-in shared memory).

Runs without a GPU (NVRTC only). Fails on any compile error, and on register spills in the main
variants (float16 / bfloat16 at head dims 64 and 128). The ptxas report (registers, spill bytes,
shared memory per variant) is printed with `pytest -s`.
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash.gpu import compile as gpu_compile, plan_bwd, variants as gpu_variants  # noqa: E402
from targets import PORTABLE, SMEM_OPTIN, print_report, require  # noqa: E402


@pytest.fixture(scope="module", params=PORTABLE)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def reports(arch):
    """{name expression: (registers, spill bytes)} of every backward and dbias variant (and the
    helper kernels) for ``arch``."""
    require(arch)
    smem = SMEM_OPTIN[arch]
    vs = plan_bwd.variants(smem)
    ds = plan_bwd.dbias_variants(smem)
    jobs = [(arch, [v for v in vs + ds if v.elem == elem], "portable/bwd.cu")
            for elem in gpu_variants.ELEMS]   # one program per element type, flash_bwd_dbias too
    res = gpu_compile.nvrtc_reports(jobs)[arch]
    print_report(f"{arch} ({smem // 1024} KB): registers / spill bytes / shared memory per backward "
                 "variant", vs + ds, res, smem=True)
    return res


@pytest.mark.all_variants
def test_every_backward_variant_compiles(reports, arch):
    vs = plan_bwd.variants(SMEM_OPTIN[arch])
    want = {v.name_expression for v in vs} | {v.pre_expression for v in vs} \
        | {v.dq_expression for v in vs} \
        | {v.name_expression for v in plan_bwd.dbias_variants(SMEM_OPTIN[arch])}
    assert set(reports) == want


@pytest.mark.all_variants
def test_dbias_variants_do_not_spill(reports, arch):
    bad = [f"{v.name}: {reports[v.name_expression][1]} B spilled"
           for v in plan_bwd.dbias_variants(SMEM_OPTIN[arch])
           if reports[v.name_expression][1]]
    assert not bad, "\n".join(bad)


@pytest.mark.all_variants
def test_main_backward_variants_do_not_spill(reports, arch):
    bad = []
    for v in plan_bwd.variants(SMEM_OPTIN[arch]):
        if v.elem in ("f16_t", "bf16_t") and v.d in (64, 128):
            regs, spill = reports[v.name_expression]
            if spill:
                bad.append(f"{v.name}: {spill} B spilled ({regs} regs)")
    assert not bad, "\n".join(bad)


def test_backward_variants_fit_shared_memory(arch):
    for v in plan_bwd.variants(SMEM_OPTIN[arch]) + plan_bwd.dbias_variants(SMEM_OPTIN[arch]):
        assert v.smem_bytes <= SMEM_OPTIN[arch], v.name
