"""Every kernel family on inputs and outputs that end exactly where mapped device memory ends
(kernel_families.py --alloc guard: the next page is reserved and unmapped), so a load or store
past an array's real extent faults instead of reading a neighbour; each result is compared with
the same call on pool-allocated arrays. Runs in a subprocess: a fault poisons the CUDA context."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

cp = pytest.importorskip("cupy")

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "kernel_families.py")
ROOT = os.path.dirname(os.path.dirname(HERE))


def _gpu_ok():
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU")]


def test_exact_size_buffers():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, DRIVER, "--alloc", "guard", "--check"],
                       capture_output=True, text=True, timeout=1500, env=env)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-10000:] + p.stderr[-10000:]
    assert p.stdout.count(" ok (") == p.stdout.count("\n"), p.stdout
