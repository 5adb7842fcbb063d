"""The compile tests' target architectures and each one's opt-in shared memory per block: the
one table every file of tests/compile/ plans and compiles with.

The planners pick tiles from the opt-in shared memory alone (plan_fwd / plan_bwd's "big" and
"small" classes, plan_decode's ring depth), so each target is compiled with the variants its
GPUs get: sm_80 (A100, A30) 163 KB; sm_86 (RTX 30xx, A10, A40), sm_89 (RTX 40xx, L4, L40) and
sm_120 (RTX 50xx, RTX PRO Blackwell) 99 KB; sm_90a (H100, H200) 227 KB. The portable kernels
(mma.sync: portable/fwd.cu, bwd.cu, decode.cu) compile for every target; the Hopper kernels
(wgmma / TMA, hopper/) for sm_90a only.

A target the installed NVRTC does not accept (NVRTC before 12.8 has no sm_120) is skipped with
the reason, never dropped silently: ``require(arch)`` in each file's compile fixture.
"""
from __future__ import annotations

import pytest

KB = 1024
#: opt-in shared memory per block (bytes) of each target's GPUs
SMEM_OPTIN = {"sm_80": 163 * KB, "sm_86": 99 * KB, "sm_89": 99 * KB, "sm_90a": 227 * KB,
              "sm_120": 99 * KB}
#: targets of the portable kernels (every sweep of portable/*.cu)
PORTABLE = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120")
#: the Hopper kernels' target
HOPPER = "sm_90a"


def nvrtc_accepts(arch: str) -> bool:
    """The installed NVRTC lists ``arch`` (sm_XY or sm_XYa) among its targets."""
    from cupy_backends.cuda.libs import nvrtc

    return int(arch[3:].rstrip("a")) in nvrtc.getSupportedArchs()


def require(arch: str) -> None:
    """Skip the calling test when the installed NVRTC cannot compile for ``arch``."""
    if not nvrtc_accepts(arch):
        from cupy_backends.cuda.libs import nvrtc

        pytest.skip(f"NVRTC {nvrtc.getVersion()} does not accept {arch}")


def print_report(title: str, vs, res: dict, smem: bool = False) -> None:
    """Print ``title`` and each variant's registers / spill bytes from ``res`` ({name expression:
    (registers, spill)}: gpu.compile.nvrtc_reports for one arch), with its shared memory where
    ``smem`` (shown with ``pytest -s``)."""
    print(f"\n{title}")
    for v in vs:
        regs, spill = res[v.name_expression]
        print(f"  {v.name:48s} {regs:4d} regs {spill:6d} B spill"
              + (f" {v.smem_bytes:7d} B smem" if smem else ""))
