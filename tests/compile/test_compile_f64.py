"""The float64 (f64_t, DMMA) instantiations compiled with NVRTC (no GPU): the forward and
backward variants the planner picks for head dims 64, 128 and 256 (plain, and the GENERAL
bias / mask / varlen form), with their helper kernels, for sm_80 and sm_90a. No spills in the
plain variants but sm_90's wide backward tiles (SPILL_BUDGET_WIDE); the GENERAL ones may spill a
little (the bias / dbias reads beside the double accumulators: at most SPILL_BUDGET_GENERAL
bytes). ``pytest -s`` prints the ptxas report.
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash.gpu import compile as gpu_compile, plan_bwd, plan_fwd  # noqa: E402

SMEM = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}
SPILL_BUDGET_GENERAL = 256
#: the sm_90 backward tiles with WD halved (plan_bwd._TILES_F64_WIDE) spill a little and are
#: still 1.5x faster than the tiles without spills
SPILL_BUDGET_WIDE = {"bwd_f64_d64_16x128w8s1b1": 192, "bwd_f64_d128_16x64w8s2b1": 192}


def _variants(arch):
    fwd, bwd = [], []
    for d in (64, 128, 256):
        for kw in ({}, dict(has_bias=True)):
            fwd.append(plan_fwd.plan_forward("float64", 1, 300, 300, 2, 2, d, d, scale=0.1,
                                             smem_optin=SMEM[arch], **kw).variant)
            bwd.append(plan_bwd.plan_backward("float64", 1, 300, 300, 2, 2, d, d, scale=0.1,
                                              smem_optin=SMEM[arch], **kw).variant)
    return fwd, bwd


@pytest.fixture(scope="module")
def reports():
    jobs = []
    for arch in SMEM:
        fwd, bwd = _variants(arch)
        jobs += [(arch, fwd, "fwd.cu"), (arch, bwd, "bwd.cu")]
    res = gpu_compile.nvrtc_reports(jobs)
    print("\nfloat64 variants: registers / spill bytes")
    for arch, rep in res.items():
        for name, (regs, spill) in sorted(rep.items()):
            print(f"  {arch:7s} {name:70s} {regs:4d} regs {spill:6d} B spill")
    return res


@pytest.mark.parametrize("arch", list(SMEM))
def test_f64_variants_compile_without_spills(reports, arch):
    fwd, bwd = _variants(arch)
    names = {v.name_expression for v in fwd + bwd} | {n for v in bwd for n in v.helper_expressions}
    assert names <= set(reports[arch]), sorted(names - set(reports[arch]))
    for v in fwd + bwd:
        regs, spill = reports[arch][v.name_expression]
        budget = SPILL_BUDGET_GENERAL if v.general else SPILL_BUDGET_WIDE.get(v.name, 0)
        assert spill <= budget, f"{v.name}: {spill} B spill ({regs} registers) on {arch}"
