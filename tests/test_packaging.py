"""The wheel ships the kernel sources, and the package finds them at run time."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _source_kernels():
    return sorted(p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))


@pytest.mark.slow
def test_wheel_contains_every_kernel_source(tmp_path):
    kernels = _source_kernels()
    assert kernels, "kernels_cu/ holds no .cu / .cuh file"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
           "-w", str(tmp_path), str(ROOT)]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = tmp_path.glob("cupyflash-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("cupyflash/kernels_cu/"))
    assert shipped == kernels
    assert "cupyflash/__init__.py" in names and "cupyflash/api.py" in names


def test_package_imports_without_cupy_or_torch():
    code = ("import sys; sys.modules['cupy'] = None; import cupyflash, numpy as np; "
            "q = np.random.default_rng().standard_normal((1, 3, 2, 4)).astype(np.float32); "
            "out = cupyflash.attention(q, q, q); "
            "assert isinstance(out, np.ndarray) and 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert done.returncode == 0, done.stderr


def test_nothing_under_the_package_imports_torch():
    for path in (ROOT / "cupyflash").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path
