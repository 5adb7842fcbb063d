"""Kernel sources -> compiled CuPy functions: the one compile path and the one (locked) cache of
compiled kernels, for every variant class (variants.KernelVariant).

Sources live in ``kernels_cu/``: inside the package (``cupyflash/kernels_cu``, where a wheel puts
them) or, for a source tree / editable install, next to the package. Its layout: ``common/``
(headers every kernel shares), ``portable/`` (the mma.sync entries), ``hopper/`` (the sm_90a
entries and their headers); an entry includes headers by their path from kernels_cu/ (one ``-I``).
Compilation is lazy and per variant (``cupy.RawModule(name_expressions=[...])``); CuPy's disk
cache keys on source text and options but not on ``-I`` headers, so a hash of every .cu / .cuh
under kernels_cu/ goes into the options as ``-DCUPYFLASH_SRC_HASH=...``: an edited header never
runs stale code.

``program(variants)`` gives (source, options, name expressions) and is shared with the NVRTC
compile harness (tests/compile/), which compiles the planners' variants without a GPU.
"""
from __future__ import annotations

import hashlib
import threading
from functools import lru_cache
from pathlib import Path

from .params import PARAMS_NBYTES


_here = Path(__file__).resolve().parents[1]   # the cupyflash package


@lru_cache(maxsize=None)
def kernels_dir() -> Path:
    """kernels_cu/: the packaged copy first, then the source tree's."""
    for cand in (_here / "kernels_cu", _here.parent / "kernels_cu"):
        if (cand / "portable" / "fwd.cu").is_file():
            return cand
    raise FileNotFoundError(
        f"cupyflash kernel sources not found (looked in {_here / 'kernels_cu'} and "
        f"{_here.parent / 'kernels_cu'})")


@lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 over every .cu / .cuh under kernels_cu/, recursively (path from kernels_cu/ and
    contents), 16 hex digits."""
    h = hashlib.sha256()
    root = kernels_dir()
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in (".cu", ".cuh"):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def _source(name: str) -> str:
    """The text of kernels_cu/<name> (name: a path from kernels_cu/, e.g. "portable/fwd.cu")."""
    return (kernels_dir() / name).read_text()


def base_options() -> tuple:
    """NVRTC options shared by CuPy's RawModule and the compile harness (no -arch). Sources include
    headers by their path from kernels_cu/ ("common/params.cuh"): one -I."""
    return ("-std=c++17", f"-I{kernels_dir()}", f"-DCUPYFLASH_SRC_HASH=0x{source_hash()}ULL",
            f"-DCUPYFLASH_PARAMS_NBYTES={PARAMS_NBYTES}")  # checked against sizeof(Params)


def program(variants, extra_options=()):
    """(source text, options, name expressions) compiling ``variants`` (of one class: their
    ``file`` and ``arch_options`` say which source and target they need; -arch=sm_90a goes before
    the -arch CuPy appends) and, after them, their helper kernels (``helper_expressions``, each
    once). ``extra_options`` (e.g. "-DQK_UNROLL=1") are for tuning experiments only."""
    first = variants[0]
    opts = base_options() + tuple(first.arch_options) + tuple(extra_options)
    helpers = []
    for v in variants:
        for n in v.helper_expressions:
            if n not in helpers:
                helpers.append(n)
    return _source(first.file), opts, [v.name_expression for v in variants] + helpers


_lock = threading.Lock()
_functions = {}   # (device id, variant, extra options) -> (main, *helpers) RawKernels


def get_functions(variant, device_id: int, extra_options=()):
    """(main, *helpers in ``helper_expressions`` order) compiled kernels of ``variant`` on device
    ``device_id`` (lazy: compiled on first use, then kept; the main kernel's dynamic shared
    memory limit raised to ``variant.smem_bytes`` where that exceeds 48 KB)."""
    extra_options = tuple(extra_options)
    key = (device_id, variant, extra_options)
    fns = _functions.get(key)
    if fns is not None:
        return fns
    with _lock:
        fns = _functions.get(key)
        if fns is None:
            import cupy
            src, opts, names = program([variant], extra_options)
            mod = cupy.RawModule(code=src, options=opts, name_expressions=names)
            main = mod.get_function(variant.name_expression)
            if variant.smem_bytes > 48 * 1024:
                main.max_dynamic_shared_size_bytes = variant.smem_bytes
            fns = _functions[key] = (main,) + tuple(mod.get_function(n)
                                                    for n in variant.helper_expressions)
    return fns


def get_function(variant, device_id: int, extra_options=()):
    """The main kernel of ``variant`` on device ``device_id`` (get_functions(...)[0])."""
    return get_functions(variant, device_id, extra_options)[0]


def clear_memory_cache():
    """Forget compiled functions held in this process (the disk cache stays)."""
    with _lock:
        _functions.clear()


def _compile_one(variant, extra_options=()):
    import cupy
    src, opts, names = program([variant], extra_options)
    cupy.RawModule(code=src, options=opts, name_expressions=names).compile()
    return variant


def precompile(variants, workers: int = 8, extra_options=()):
    """Fill CuPy's disk cache for ``variants`` (any classes; the programs get_functions builds,
    with ``extra_options`` as get_functions gets them) using ``workers`` processes (spawned)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    variants = list(variants)
    extra = [tuple(extra_options)] * len(variants)
    if workers <= 1:
        return [_compile_one(v, e) for v, e in zip(variants, extra)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_compile_one, variants, extra))


def nvrtc_compile(parts, arch: str, filename: str, extra_options=()):
    """Compile ``parts`` = (source, options, name expressions) for ``arch`` with NVRTC alone (no
    GPU needed); returns (NVRTC's log, {lowered name: name expression}, the cubin).

    Raises RuntimeError with NVRTC's log on a compile error. Used by the compile harness and the
    SASS test (tests/compile/test_sass_sm90.py)."""
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
    arch, variants, filename, *extra = job
    return arch, nvrtc_report(program(variants, *extra), arch, filename)


def nvrtc_reports(jobs, workers=None) -> dict:
    """Run ``nvrtc_report`` for ``jobs`` = [(arch, variants of one class, filename), ...] in spawned
    processes (a job's optional fourth item: extra options, as get_functions takes them); returns
    {arch: {name expression: (registers, spill bytes)}} (the compile harness)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    res = {}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for arch, rep in ex.map(_report_job, jobs):
            res.setdefault(arch, {}).update(rep)
    return res
