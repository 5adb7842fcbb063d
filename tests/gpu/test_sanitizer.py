"""compute-sanitizer over a small call of every kernel family (kernel_families.py): memcheck,
racecheck, synccheck and initcheck each report 0 errors. Arrays are exact-size cudaMallocs (no
CuPy pool), so a read past an array's end is out of bounds for memcheck and uninitialized for
initcheck. Slow (minutes): run whenever kernels change, e.g.

    python -m pytest -q tests/gpu/test_sanitizer.py
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

cp = pytest.importorskip("cupy")

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "kernel_families.py")
ROOT = os.path.dirname(os.path.dirname(HERE))


def _sanitizer():
    exe = shutil.which("compute-sanitizer")
    for d in ("/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer", "/opt/nvidia/compute-sanitizer"):
        if exe is None and os.path.exists(os.path.join(d, "compute-sanitizer")):
            exe = os.path.join(d, "compute-sanitizer")
    return exe


def _gpu_ok():
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(_sanitizer() is None, reason="compute-sanitizer not found")]

#: Each tool's options: racecheck reports one analysis per racing pair of instructions.
TOOLS = {
    "memcheck": ["--tool", "memcheck", "--leak-check", "no"],
    "racecheck": ["--tool", "racecheck", "--racecheck-report", "analysis"],
    "synccheck": ["--tool", "synccheck"],
    "initcheck": ["--tool", "initcheck"],
}
SUMMARY = re.compile(r"========= (ERROR SUMMARY|RACECHECK SUMMARY): (\d+) (error|hazard)")
KERNEL = re.compile(r"at void ([a-z_0-9]+<[^>]*>)")

#: Reports known and documented (docs/reliability.md): tool -> {kernel name prefix: why}. Any
#: other report fails the test. None now: every tool reports 0 over every case.
KNOWN: dict = {}


def run_tool(tool: str, cases=(), timeout: float = 1500.0):
    """(return code, output, summary line) of one tool over the driver's cases."""
    cmd = [_sanitizer(), *TOOLS[tool], "--error-exitcode", "97", "--print-limit", "1000",
           sys.executable, DRIVER, "--alloc", "exact", *cases]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = p.stdout + p.stderr
    summary = [line for line in out.splitlines() if SUMMARY.search(line)]
    return p.returncode, out, summary


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every case's kernels once outside the sanitizer (CuPy's disk cache)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, DRIVER], check=True, env=env, timeout=1500)


def unknown_reports(tool, out):
    """Kernels named in the tool's error reports that KNOWN does not list."""
    names = {m.group(1) for line in out.splitlines() if line.startswith("========= Error")
             for m in [KERNEL.search(line)] if m}
    return sorted(n for n in names if not any(n.startswith(k) for k in KNOWN.get(tool, {})))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_no_reports(tool):
    rc, out, summary = run_tool(tool)
    print("\n".join(summary))
    assert summary, out[-20000:]
    clean = all(SUMMARY.search(s).group(2) == "0" for s in summary)
    assert clean or (tool in KNOWN and not unknown_reports(tool, out)), out[-20000:]
    assert clean or rc in (0, 97), out[-20000:]   # reports, and nothing else went wrong
    assert not clean or rc == 0, out[-20000:]
