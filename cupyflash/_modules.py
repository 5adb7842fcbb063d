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
    from ._plan import PARAMS_NBYTES  # the kernels check sizeof(Params) against it

    return ("-std=c++17", f"-I{kernels_dir()}", f"-DCUPYFLASH_SRC_HASH=0x{source_hash()}ULL",
            f"-DCUPYFLASH_PARAMS_NBYTES={PARAMS_NBYTES}")


def program(variants, file: str = None, extra_options=()):
    """(source text, options, name expressions) compiling ``variants`` (of one kind: a list of
    _plan.Variant, or of _plan.Sm90Variant, whose ``file`` and ``arch_options`` say which source
    and target they need: -arch=sm_90a goes before the -arch CuPy appends, as in the device
    spike that ran wgmma through CuPy's RawModule, see ../shared/hopper-notes.md)."""
    first = variants[0]
    file = file or getattr(first, "file", "fwd.cu")
    opts = base_options() + tuple(getattr(first, "arch_options", ())) + tuple(extra_options)
    return _source(file), opts, [v.name_expression for v in variants]


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


def _compile_one(job):
    program_fn, variant = job
    import cupy
    src, opts, names = program_fn([variant])
    cupy.RawModule(code=src, options=opts, name_expressions=names).compile()
    return variant


def precompile(variants, workers: int = 8, program_fn=None):
    """Fill CuPy's disk cache for ``variants`` using ``workers`` processes (spawned).

    ``program_fn(variants) -> (source, options, names)`` builds each variant's program: the
    forward's ``program`` by default, ``_gpu_bwd.program`` for the backward.
    """
    import concurrent.futures as cf
    import multiprocessing as mp
    jobs = [(program_fn or program, v) for v in variants]
    if workers <= 1:
        return [_compile_one(j) for j in jobs]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_compile_one, jobs))


def nvrtc_compile(parts, arch: str, filename: str, extra_options=()):
    """Compile ``parts`` = (source, options, name expressions) for ``arch`` with NVRTC alone (no
    GPU needed); returns (NVRTC's log, {lowered name: name expression}, the cubin).

    Raises RuntimeError with NVRTC's log on a compile error. Used by the compile harness and the
    SASS test (tests/test_sass_sm90.py)."""
    from cupy_backends.cuda.libs import nvrtc

    src, opts, names = parts
    opts = [o for o in opts if not o.startswith("-arch")]   # the harness names the target
    prog = nvrtc.createProgram(src, filename, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, list(opts) + [f"-arch={arch}", *extra_options])
        except Exception as e:  # noqa: BLE001
            log = nvrtc.getProgramLog(prog).replace("\0", "")
            raise RuntimeError(f"NVRTC failed for {arch}: {e}\n{log}") from None
        log = nvrtc.getProgramLog(prog).replace("\0", "")
        lowered = {nvrtc.getLoweredName(prog, n): n for n in names}
        # CuPy 14's getCUBIN returns one byte short (the ELF's last byte, a zero: nvdisasm then
        # rejects the file); a trailing zero byte more is harmless
        cubin = nvrtc.getCUBIN(prog) + b"\0"
    finally:
        nvrtc.destroyProgram(prog)
    return log, lowered, cubin


def nvrtc_report(parts, arch: str, filename: str) -> dict:
    """Compile ``parts`` (nvrtc_compile) and return {name expression: (registers, spill store
    bytes)} from ptxas. Raises RuntimeError when NVRTC fails or a kernel has no ptxas report."""
    import re

    log, lowered, _ = nvrtc_compile(parts, arch, filename, ("--ptxas-options=-v",))
    out = {}
    for m in re.finditer(r"Compiling entry function '(\S+)'.*?(\d+) bytes spill stores.*?"
                         r"Used (\d+) registers", log, re.S):
        out[lowered.get(m.group(1), m.group(1))] = (int(m.group(3)), int(m.group(2)))
    missing = set(parts[2]) - set(out)
    if missing:
        raise RuntimeError(f"no ptxas report for {sorted(missing)}")
    return out


def _report_job(job):
    arch, program_fn, variants, filename = job
    return arch, nvrtc_report(program_fn(variants), arch, filename)


def nvrtc_reports(jobs, workers=None) -> dict:
    """Run ``nvrtc_report`` for ``jobs`` = [(arch, program_fn, variants, filename), ...] in spawned
    processes; returns {arch: {name expression: (registers, spill bytes)}} (the compile harness)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    res = {}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for arch, rep in ex.map(_report_job, jobs):
            res.setdefault(arch, {}).update(rep)
    return res
