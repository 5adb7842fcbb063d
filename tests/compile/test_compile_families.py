"""One variant of every kernel family compiled with NVRTC (no GPU): the default compile check.

Each family's representative is the variant its planner picks for a bfloat16, head dim 128
(float32: the float32 kernels' own head dims), non-causal call, with the target's opt-in shared
memory (targets.SMEM_OPTIN). Portable kernels compile for sm_80 and sm_90a, and for the 99 KB
class the forward and backward for sm_86 and the forward for sm_120 (NVRTC's newer front end for
sm_100+ gives it other register figures: test_compile_fwd.py); the Hopper kernels compile for
sm_90a; each program holds the family's helper kernels
(flash_bwd_pre / flash_bwd_dq and their Hopper forms), so those compile too. The ptxas report must
name every entry. The sweep over every variant, with the register / spill / ptxas-warning checks,
is tests/compile/test_compile_{fwd,bwd,f64,decode,sm90}.py under --all-variants (every target
of targets.PORTABLE).
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash.gpu import (compile as gpu_compile, plan_bwd, plan_bwd_sm90,  # noqa: E402
                           plan_bwd_sm90_f32, plan_dbias_sm90, plan_decode, plan_fwd,
                           plan_fwd_sm90)
from targets import HOPPER, SMEM_OPTIN, nvrtc_accepts, require  # noqa: E402

#: targets of the portable representatives: both big classes, the 99 KB class (sm_86), and
#: sm_120's forward (skipped where the installed NVRTC does not accept sm_120)
FWD_ARCHS = ("sm_80", "sm_86", HOPPER, "sm_120")
BWD_ARCHS = ("sm_80", "sm_86", HOPPER)
DECODE_ARCHS = ("sm_80", HOPPER)


def _portable_fwd(arch):
    p = plan_fwd.plan_forward("bfloat16", 1, 256, 256, 2, 2, 128, 128, scale=0.1,
                              smem_optin=SMEM_OPTIN[arch])
    return [p.variant]


def _portable_bwd(arch):
    p = plan_bwd.plan_backward("bfloat16", 1, 256, 256, 2, 2, 128, 128, scale=0.1,
                               smem_optin=SMEM_OPTIN[arch])
    return [p.variant, plan_bwd.dbias_variant("bf16_t", 128, SMEM_OPTIN[arch])]   # both in portable/bwd.cu


#: (family, arch, variants of one source file): the jobs of one nvrtc_reports call
FAMILIES = {
    "fwd_portable": [(arch, _portable_fwd(arch)) for arch in FWD_ARCHS],
    "bwd_portable_and_dbias": [(arch, _portable_bwd(arch)) for arch in BWD_ARCHS],
    "fwd_sm90_bf16": [(HOPPER, [plan_fwd_sm90.sm90_variant("bf16_t", 128, False, False)])],
    "fwd_sm90_f32": [(HOPPER, [plan_fwd_sm90.sm90_f32_variant("f32x3_t", 64, False)])],
    "bwd_sm90_bf16": [(HOPPER, [plan_bwd_sm90.variant_for("bf16_t", 128, False)])],
    # head dim 256: the split-head-dim consumers (hopper/bwd_split_consumer.cuh)
    "bwd_sm90_bf16_d256": [(HOPPER, [plan_bwd_sm90.variant_for("bf16_t", 256, True)])],
    "bwd_sm90_f32": [(HOPPER, [plan_bwd_sm90_f32.Sm90F32BwdVariant(64, False)])],
    "dbias_sm90": [(HOPPER, [plan_dbias_sm90.variant_for("bf16_t", 128, False, False)])],
    "decode_and_kvcache_prep": [(arch, [plan_decode.variant_for("bf16_t", 128, 4, SMEM_OPTIN[arch])[0],
                                        plan_decode.PrepVariant("bf16_t")]) for arch in DECODE_ARCHS],
}
JOBS = [(fam, arch, vs) for fam, jobs in FAMILIES.items() for arch, vs in jobs]


@pytest.fixture(scope="module")
def reports():
    """{(arch, name expression): (registers, spill bytes)} of every job, compiled in parallel."""
    res = gpu_compile.nvrtc_reports([(arch, vs, vs[0].file) for _, arch, vs in JOBS
                                     if nvrtc_accepts(arch)])
    print("\nregisters / spill bytes per family representative (and its helper kernels)")
    for arch, rep in res.items():
        for name, (regs, spill) in sorted(rep.items()):
            print(f"  {arch:7s} {name:70s} {regs:4d} regs {spill:6d} B spill")
    return res


@pytest.mark.parametrize("fam, arch, vs", JOBS, ids=[f"{fam}-{arch}" for fam, arch, _ in JOBS])
def test_family_representative_compiles(reports, fam, arch, vs):
    require(arch)
    names = {v.name_expression for v in vs} | {n for v in vs for n in v.helper_expressions}
    assert names <= set(reports[arch]), sorted(names - set(reports[arch]))


def test_every_variant_class_has_a_representative():
    """A new kernel family (a new KernelVariant subclass) needs a representative here."""
    from cupyflash.gpu.variants import KernelVariant

    def subclasses(c):
        return set(c.__subclasses__()).union(*(subclasses(s) for s in c.__subclasses__()))

    covered = {type(v) for _, _, vs in JOBS for v in vs}
    assert subclasses(KernelVariant) == covered
