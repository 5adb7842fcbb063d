"""SASS order of the Hopper forward's key-tile loop (kernels_cu/hopper/fwd.cu, sm_90a).

In its turn a consumer issues S = Q Kᵀ of key tile j + 1 and O += P V of tile j, waits for S
(``wgmma.wait_group 1``), runs the softmax of j + 1 and only then waits for P V
(``wgmma.wait_group 0``). The source says so, but ptxas may hoist a wait within a basic block:
an earlier version put the P V wait (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) before the softmax's first
exp2 in every variant, so the softmax never ran beside the consumer's own product. At hd 128
(SOFTMAX_BESIDE_PV) a wait on the next V stage between them ends the basic block; this test reads
the SASS (NVRTC cubin, disassembled by nvdisasm from the ``nvidia-cuda-nvdisasm`` wheel of the
test extra) and checks, for every hd 128 variant the planner can choose, that all the softmax's
exp2s (``MUFU.EX2``) of the loop sit between the two waits. It needs no GPU.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash.gpu import compile as gpu_compile, plan_fwd_sm90  # noqa: E402
from targets import HOPPER  # noqa: E402


def _nvdisasm():
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for cand in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(cand)
    return None


NVDISASM = _nvdisasm()
pytestmark = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")


def _cubin(variants) -> bytes:
    return gpu_compile.nvrtc_compile(gpu_compile.program(variants), HOPPER, "hopper/fwd.cu")[2]


def loop_waits(sass: str):
    """For each "wait for S" (``WARPGROUP.DEPBAR.LE gsb0, 0x1``: only in the key-tile loop) of one
    function's SASS: (exp2s between it and the next full wait, exp2s after that full wait before
    the next product or wait)."""
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)
    out = []
    for i, s in enumerate(ins):
        if "DEPBAR.LE gsb0, 0x1" not in s:
            continue
        j = next(k for k in range(i + 1, len(ins)) if "DEPBAR.LE gsb0, 0x0" in ins[k])
        k = next((k for k in range(j + 1, len(ins)) if "HGMMA" in ins[k] or "DEPBAR" in ins[k]), len(ins))
        out.append((sum("MUFU.EX2" in s for s in ins[i:j]), sum("MUFU.EX2" in s for s in ins[j:k])))
    return out


@pytest.fixture(scope="module")
def sass_by_variant(tmp_path_factory):
    vs = [v for v in plan_fwd_sm90.variants() if v.d == 128 and v.elem == "bf16_t"]
    assert vs, "the planner has hd 128 variants"
    d = tmp_path_factory.mktemp("sass")
    out = {}
    for n, v in enumerate(vs):
        f = d / f"v{n}.cubin"
        f.write_bytes(_cubin([v]))
        out[v] = subprocess.run([NVDISASM, str(f)], capture_output=True, text=True, check=True).stdout
    return out


@pytest.mark.all_variants
def test_hd128_softmax_runs_beside_its_own_pv(sass_by_variant):
    bad = []
    for v, sass in sass_by_variant.items():
        waits = loop_waits(sass)
        # the loop's softmax: BN / 2 exp2s per lane (+ 2 for the rescale factors alpha)
        if not waits or any(before < v.bn // 2 or after for before, after in waits):
            bad.append(f"{v.name}: exp2s between the S wait and the P V wait / after it: {waits}")
    assert not bad, "\n".join(bad)


def test_loop_waits_reads_a_hoisted_wait():
    """The parser itself, on SASS shaped like the hoisted order ptxas produced before."""
    sass = "\n".join(f"/*{a:04x}*/ {s} ;" for a, s in enumerate([
        "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], R88, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "FMNMX R9, R88, R89, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R88, R88",
        "MUFU.EX2 R89, R89", "BAR.SYNC.DEFER_BLOCKING R3, 0x100", "HGMMA.64x128x16.F32.BF16 R88"]))
    assert loop_waits(sass) == [(0, 2)]
