"""NVRTC compile harness for the split-KV decode kernels (kernels_cu/portable/decode.cu): every
attention variant plan_decode can select (plan_decode.variants: both element types, head dims 64
to 256, one- and two-slab tiles) with its combine / kvcache_prep / kvcache_check kernels, and the
kvcache_prep variants of the gather path, for each portable target (targets.PORTABLE, each with
its opt-in shared memory), compiled with the launcher's options (plan_decode.build_options).

Runs without a GPU (NVRTC only). Fails on any compile error and on register spills: none
allowed but SPILL_BUDGET_D64_M2 bytes in the two-slab head-dim-64 tiles (flash_decode<E, 64, 2,
4, STAGES>, GQA rows above 16): ptxas gives them 168 registers (with -maxrregcount=255 too) and
they spill 12 B on sm_80 / sm_86 / sm_89 and 8 B on sm_120 (0 on sm_90a; NVRTC 12.9), as on
sm_80 before the 99 KB targets were added. ``pytest -s`` prints the ptxas report.
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
pytestmark = pytest.mark.all_variants   # the sweep; test_compile_families.py compiles one of each

from cupyflash.gpu import compile as gpu_compile, plan_decode  # noqa: E402
from targets import PORTABLE, SMEM_OPTIN, print_report, require  # noqa: E402

SPILL_BUDGET_D64_M2 = 16   # bytes, see the module docstring


@pytest.fixture(scope="module", params=PORTABLE)
def arch(request):
    return request.param


def _variants(arch):
    return plan_decode.variants(SMEM_OPTIN[arch]), plan_decode.prep_variants()


@pytest.fixture(scope="module")
def reports(arch):
    """{name expression: (registers, spill bytes)} of every decode and prep kernel for ``arch``."""
    require(arch)
    vs, preps = _variants(arch)
    opts = plan_decode.build_options()
    jobs = [(arch, [v for v in vs if v.elem == e], "portable/decode.cu", opts)
            for e in plan_decode.DECODE_ELEMS] + [(arch, preps, "portable/decode.cu", opts)]
    res = gpu_compile.nvrtc_reports(jobs)[arch]
    print_report(f"{arch} ({SMEM_OPTIN[arch] // 1024} KB): registers / spill bytes / shared memory "
                 "per decode variant", vs, res, smem=True)
    for name, (regs, spill) in sorted(res.items()):
        if not name.startswith("flash_decode<"):
            print(f"  {name:40s} {regs:4d} regs {spill:6d} B spill")
    return res


def test_every_decode_variant_compiles(reports, arch):
    vs, preps = _variants(arch)
    want = {v.name_expression for v in vs + preps} | {n for v in vs + preps
                                                      for n in v.helper_expressions}
    assert set(reports) == want


def test_decode_variants_fit_and_do_not_spill(reports, arch):
    vs, _ = _variants(arch)
    assert all(v.smem_bytes <= SMEM_OPTIN[arch] for v in vs)
    budget = {v.name_expression: SPILL_BUDGET_D64_M2 for v in vs if (v.d, v.mt) == (64, 2)}
    bad = [f"{name}: {spill} B spilled ({regs} regs)"
           for name, (regs, spill) in sorted(reports.items()) if spill > budget.get(name, 0)]
    assert not bad, "\n".join(bad)
