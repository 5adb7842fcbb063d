"""Every notebook runs top to bottom, so none rots.

The notebooks are executed cell by cell in one namespace (plain Python: no Jupyter kernel needed).
Notebooks whose metadata says ``"cupyflash": {"needs_gpu": true}`` run only where a GPU is.
Outputs must be stripped in git.
"""
import json
import os
from pathlib import Path

import pytest

from cupyflash._interop import gpu_available

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _load(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nb = _load(path)
    if nb["metadata"].get("cupyflash", {}).get("needs_gpu") and not gpu_available():
        pytest.skip("notebook needs a GPU")
    monkeypatch.chdir(path.parent)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_outputs_are_stripped(path):
    for cell in _load(path)["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs", []) == [] and cell.get("execution_count") is None
