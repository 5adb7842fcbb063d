"""Kernel sources -> compiled CuPy functions, cached per device architecture and variant.

Sources live in ``kernels_cu/``: inside the package (``cupyflash/kernels_cu``, where a wheel puts
them) or, for a source tree / editable install, next to the package. Compilation is lazy and per
variant (``cupy.RawModule(name_expressions=[...])``); CuPy's disk cache keys on source text and
options but not on ``-I`` headers, so a hash of every file in kernels_cu/ goes into the options as
``-DCUPYFLASH_SRC_HASH=...``: an edited header never runs stale code.

``program(variants)`` gives (source, options, name expressions) and is shared with the NVRTC
compile harness (tests/test_compile.py), which compiles every planner variant without a GPU.
"""
from __future__ import annotations

import hashlib
import threading
from functools import lru_cache
from pathlib import Path

_here = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def kernels_dir() -> Path:
    """kernels_cu/: the packaged copy first, then the source tree's."""
    for cand in (_here / "kernels_cu", _here.parent / "kernels_cu"):
        if (cand / "fwd.cu").is_file():
            return cand
    raise FileNotFoundError(
        f"cupyflash kernel sources not found (looked in {_here / 'kernels_cu'} and "
        f"{_here.parent / 'kernels_cu'})")


@lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 over every file in kernels_cu/ (name and contents), 16 hex digits."""
    h = hashlib.sha256()
    for f in sorted(kernels_dir().iterdir()):
        if f.is_file() and f.suffix in (".cu", ".cuh"):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def _source(name: str) -> str:
    return (kernels_dir() / name).read_text()


def base_options() -> tuple:
    """NVRTC options shared by CuPy's RawModule and the compile harness (no -arch)."""
    return ("-std=c++17", f"-I{kernels_dir()}", f"-DCUPYFLASH_SRC_HASH=0x{source_hash()}ULL")


def program(variants, file: str = "fwd.cu", extra_options=()):
    """(source text, options, name expressions) compiling ``variants`` (list of _plan.Variant)."""
    return (_source(file), base_options() + tuple(extra_options),
            [v.name_expression for v in variants])


_lock = threading.Lock()
_functions = {}   # (device id, variant) -> cupy RawKernel with its smem attribute set


def get_function(variant, device_id: int, extra_options=()):
    """The compiled flash_fwd instantiation for ``variant`` on device ``device_id`` (lazy).

    ``extra_options`` (e.g. "-DQK_UNROLL=1") are for tuning experiments only.
    """
    extra_options = tuple(extra_options)
    key = (device_id, variant, extra_options)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            import cupy
            src, opts, names = program([variant], extra_options=extra_options)
            mod = cupy.RawModule(code=src, options=opts, name_expressions=names)
            fn = mod.get_function(names[0])
            if variant.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = variant.smem_bytes
            _functions[key] = fn
    return fn


def clear_memory_cache():
    """Forget compiled functions held in this process (the disk cache stays)."""
    with _lock:
        _functions.clear()


def _compile_one(variant):
    import cupy
    src, opts, names = program([variant])
    cupy.RawModule(code=src, options=opts, name_expressions=names).compile()
    return variant


def precompile(variants, workers: int = 8):
    """Fill CuPy's disk cache for ``variants`` using ``workers`` processes (spawned)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    variants = list(variants)
    if workers <= 1:
        return [_compile_one(v) for v in variants]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_compile_one, variants))
