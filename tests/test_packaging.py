"""The wheel ships the kernel sources, py.typed and the LICENSE, with an SPDX license
expression; the NumPy-only install needs no GPU package; the package finds its kernels at run
time."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _source_kernels():
    """Every .cu / .cuh under kernels_cu/ (common/, portable/, hopper/), as paths from kernels_cu/."""
    root = ROOT / "kernels_cu"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".cu", ".cuh"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel pip builds from this checkout (built once per module)."""
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SetuptoolsDeprecationWarning" not in done.stderr, done.stderr
    (path,) = out.glob("cupyflash-*.whl")
    return zipfile.ZipFile(path)


def _metadata(wheel):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return wheel.read(name).decode()


@pytest.mark.slow
def test_wheel_contains_every_kernel_source(wheel):
    kernels = _source_kernels()
    assert kernels, "kernels_cu/ holds no .cu / .cuh file"
    names = wheel.namelist()
    prefix = "cupyflash/kernels_cu/"
    shipped = sorted(n[len(prefix):] for n in names
                     if n.startswith(prefix) and n.endswith((".cu", ".cuh")))
    assert shipped == kernels
    assert "cupyflash/__init__.py" in names and "cupyflash/api.py" in names


@pytest.mark.slow
def test_wheel_ships_py_typed_and_the_license(wheel):
    names = wheel.namelist()
    assert "cupyflash/py.typed" in names
    (lic,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert "BSD 3-Clause License" in wheel.read(lic).decode()


@pytest.mark.slow
def test_wheel_metadata(wheel):
    meta = _metadata(wheel)
    assert "License-Expression: BSD-3-Clause" in meta
    assert "License-File: LICENSE" in meta
    assert "Classifier: Typing :: Typed" in meta
    assert "Requires-Dist: threadpoolctl" in meta
    # GPU-only tools are in their own extra, not in `test`
    for line in meta.splitlines():
        if line.startswith("Requires-Dist: nvidia-cuda-nvdisasm"):
            assert "extra == \"gpu-test\"" in line, line


def test_license_file_is_bsd_3_clause():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the cupyflash authors" in text


def test_pyproject_keeps_gpu_tools_out_of_the_test_extra():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    extras = project["optional-dependencies"]
    assert not any(dep.startswith(("nvidia", "cupy")) for dep in extras["test"])
    assert any(dep.startswith("nvidia-cuda-nvdisasm") for dep in extras["gpu-test"])


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
