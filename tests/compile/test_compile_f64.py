"""The float64 (f64_t, DMMA) instantiations compiled with NVRTC (no GPU): the forward and
backward variants the planner picks for head dims 64, 128 and 256 (plain, and the GENERAL
bias / mask / varlen form), with their helper kernels, for each portable target (targets.PORTABLE,
each with its opt-in shared memory). On the 99 KB targets the backward's largest head dim is
160 (SMALL_BWD_DIMS: no float64 backward tile above D = 160 fits 99 KB, docs/kernels.md). No
spills in the plain variants but sm_90's wide backward tiles (SPILL_BUDGET_WIDE) and sm_120's
hd 160 backward (SPILL_BUDGET_SM120); the GENERAL ones may spill a little (the bias / dbias
reads beside the double accumulators: at most SPILL_BUDGET_GENERAL bytes). ``pytest -s`` prints
the ptxas report.
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash.gpu import compile as gpu_compile, plan_bwd, plan_fwd  # noqa: E402
from cupyflash.gpu.variants import smem_class  # noqa: E402
from targets import PORTABLE, SMEM_OPTIN, require  # noqa: E402

SPILL_BUDGET_GENERAL = 256
#: the sm_90 backward tiles with WD halved (plan_bwd._TILES_F64_WIDE) spill a little and are
#: still 1.5x faster than the tiles without spills
SPILL_BUDGET_WIDE = {"bwd_f64_d64_16x128w8s1b1": 192, "bwd_f64_d128_16x64w8s2b1": 192}
#: sm_120: NVRTC compiles sm_100+ with its newer NVVM front end, whose PTX of the 99 KB hd 160
#: backward spills 184 B at 255 registers in ptxas; the PTX every other target gets, assembled for
#: sm_120 (ptxas 13.0), spills 0 B, as on sm_80 / sm_86 (248 registers) and sm_90a (255)
SPILL_BUDGET_SM120 = {"bwd_f64_d160_16x16w4s4b1": 184}
DIMS = (64, 128, 256)
SMALL_BWD_DIMS = (64, 128, 160)


def _variants(arch):
    smem = SMEM_OPTIN[arch]
    bwd_dims = SMALL_BWD_DIMS if smem_class(smem) == "small" else DIMS
    fwd, bwd = [], []
    for kw in ({}, dict(has_bias=True)):
        for d in DIMS:
            fwd.append(plan_fwd.plan_forward("float64", 1, 300, 300, 2, 2, d, d, scale=0.1,
                                             smem_optin=smem, **kw).variant)
        for d in bwd_dims:
            bwd.append(plan_bwd.plan_backward("float64", 1, 300, 300, 2, 2, d, d, scale=0.1,
                                              smem_optin=smem, **kw).variant)
    return fwd, bwd


#: targets of the default run; the 99 KB ones compile under --all-variants (the sweep's time)
DEFAULT_RUN = ("sm_80", "sm_90a")


@pytest.fixture(scope="module", params=[a if a in DEFAULT_RUN else
                                        pytest.param(a, marks=pytest.mark.all_variants)
                                        for a in PORTABLE])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def reports(arch):
    require(arch)
    fwd, bwd = _variants(arch)
    res = gpu_compile.nvrtc_reports([(arch, fwd, "fwd.cu"), (arch, bwd, "bwd.cu")])[arch]
    print(f"\nfloat64 variants, {arch} ({SMEM_OPTIN[arch] // 1024} KB): registers / spill bytes")
    for name, (regs, spill) in sorted(res.items()):
        print(f"  {name:70s} {regs:4d} regs {spill:6d} B spill")
    return res


def test_f64_variants_compile_without_spills(reports, arch):
    fwd, bwd = _variants(arch)
    names = {v.name_expression for v in fwd + bwd} | {n for v in bwd for n in v.helper_expressions}
    assert names <= set(reports), sorted(names - set(reports))
    for v in fwd + bwd:
        regs, spill = reports[v.name_expression]
        budget = SPILL_BUDGET_GENERAL if v.general else SPILL_BUDGET_WIDE.get(v.name, 0)
        if arch == "sm_120":
            budget = SPILL_BUDGET_SM120.get(v.name, budget)
        assert spill <= budget, f"{v.name}: {spill} B spill ({regs} registers) on {arch}"
