"""Shared test fixtures (CPU tests run everywhere; GPU tests carry the `gpu` marker)."""
from __future__ import annotations

import os

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh np.random.Generator per test, seeded from os.urandom (or CUPYFLASH_SEED to replay).

    A failing test's report shows the seed in a "rng seed" section.
    """
    env = os.environ.get("CUPYFLASH_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(8), "little")
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Add the rng seed to the report of a failed test."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        for name, value in item.user_properties:
            if name == "rng_seed":
                rep.sections.append(("rng seed", f"CUPYFLASH_SEED={value}"))


def _gpu_usable() -> bool:
    from cupyflash._interop import gpu_available

    return gpu_available()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip (with a reason) where CuPy sees no CUDA device."""
    if _gpu_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
