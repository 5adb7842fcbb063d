"""Shared test fixtures and options.

Folders: unit/ (API, CPU path, validation, reference), planner/ (pure-Python planners),
compile/ (NVRTC compiles, no GPU), models/ (CPU models of the Hopper kernels' protocols and
layouts), gpu/ (tests that launch kernels: marked ``gpu``, skipped without a device).

CPU tests run everywhere; GPU tests carry the ``gpu`` marker. Tests marked ``all_variants``
(the compile of every kernel variant the planners can select, with the register / spill / ptxas
checks) run only with ``--all-variants`` or CUPYFLASH_TEST_ALL_VARIANTS=1 (.ci/run sets it); by
default tests/compile/test_compile_families.py compiles one variant of every kernel family.
"""
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


def pytest_addoption(parser):
    parser.addoption("--all-variants", action="store_true", default=False,
                     help="also compile every kernel variant (tests marked all_variants; "
                          "or set CUPYFLASH_TEST_ALL_VARIANTS=1)")


def all_variants_enabled(config) -> bool:
    """--all-variants given, or CUPYFLASH_TEST_ALL_VARIANTS set to 1."""
    return bool(config.getoption("--all-variants")) or \
        os.environ.get("CUPYFLASH_TEST_ALL_VARIANTS", "") == "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip (with a reason) where CuPy sees no CUDA device; tests marked
    ``all_variants`` skip unless the exhaustive sweep is asked for."""
    if not all_variants_enabled(config):
        sweep = pytest.mark.skip(reason="the every-variant compile sweep: --all-variants or "
                                        "CUPYFLASH_TEST_ALL_VARIANTS=1")
        for item in items:
            if "all_variants" in item.keywords:
                item.add_marker(sweep)
    if _gpu_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
