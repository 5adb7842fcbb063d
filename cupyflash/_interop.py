"""NumPy / CuPy / CUDA-array-interface / DLPack in and out.

``resolve`` looks at the arrays of one call and the ``device`` choice and returns a ``Backend``:
where the call runs ("cpu" or "gpu"), the arrays in that backend's array module, and how results go
back (NumPy in -> NumPy out; CuPy, CAI or DLPack in -> CuPy out). CuPy is imported lazily: the
package imports and runs its CPU path without it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ._checks import fail

_ARRAY_KINDS = ("a NumPy or CuPy array, or an object with __cuda_array_interface__ or __dlpack__ "
                "(lists and other array-likes are not taken: wrap them with numpy.asarray)")


@functools.lru_cache(maxsize=None)
def cupy_module():
    """The cupy module, or None when it is not importable."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _kind(name: str, x) -> str:
    """"numpy" | "cupy" | "cai" | "dlpack-cpu" | "dlpack-gpu" for one argument, else TypeError."""
    if isinstance(x, np.ndarray):
        if isinstance(x, np.ma.MaskedArray):
            fail(TypeError, name, "a numpy.ma.MaskedArray (its mask would be ignored)",
                 "a plain NumPy array: x.filled(value) for q, k, v or bias; "
                 "the attention mask as mask= (True = attend)")
        return "numpy"
    cp = cupy_module()
    if cp is not None and isinstance(x, cp.ndarray):
        return "cupy"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        return "dlpack-cpu" if device_type in (1, 3) else "dlpack-gpu"  # kDLCPU, kDLCUDAHost
    fail(TypeError, name, f"{type(x).__module__}.{type(x).__qualname__}", _ARRAY_KINDS)


def _to_cupy(x):
    cp = cupy_module()
    if isinstance(x, cp.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)  # zero-copy view
    return cp.from_dlpack(x)  # zero-copy


@dataclass
class Backend:
    """Where one call runs and how its results go back to the caller.

    ``where`` is "cpu" (cpu.py on NumPy arrays) or "gpu" (CuPy arrays on ``device_id``);
    ``xp`` is numpy or cupy accordingly; ``give_back`` turns one result array into what the caller
    passed in (NumPy for NumPy inputs, CuPy otherwise).
    """

    where: str
    xp: Any
    device_id: Optional[int]
    give_back: Callable
    on_host: bool  # the caller passed NumPy (or CPU DLPack) arrays

    def as_cpu(self) -> "Backend":
        """This call computed by cpu.py instead, results still going back as the caller's kind."""
        if self.where == "cpu":
            return self
        if self.on_host:
            give_back = lambda r: r
        else:
            give_back = lambda r: None if r is None else _device_copy(r, self.device_id)
        return Backend("cpu", np, self.device_id, give_back, self.on_host)

    def take(self, x):
        """An input array in this backend's array module (a copy only when it must cross over)."""
        if x is None:
            return None
        if self.where == "cpu":
            cp = cupy_module()
            if cp is not None and isinstance(x, cp.ndarray):
                return cp.asnumpy(x)
            return np.asarray(x)
        return _to_cupy(x) if not isinstance(x, np.ndarray) else cupy_module().asarray(x)


def resolve(device: str, arrays: dict, *, gpu_covers: bool = True) -> Backend:
    """Choose the backend for the call's main arrays ``arrays`` (name -> array-like).

    All of them must be host arrays (NumPy, CPU DLPack) or all device arrays (CuPy, CAI, CUDA
    DLPack), on one device. ``device``: "cpu" runs cpu.py (device arrays are copied to the host and
    the results copied back); "gpu" runs the kernels (host arrays are copied to the GPU); "auto"
    runs device arrays on their GPU and host arrays on the GPU when one is usable and
    ``gpu_covers`` (the kernels cover this call), else on the CPU.
    """
    kinds = {name: _kind(name, x) for name, x in arrays.items() if x is not None}
    on_host = {name: k in ("numpy", "dlpack-cpu") for name, k in kinds.items()}
    first = next(iter(on_host))
    for name, host in on_host.items():
        if host != on_host[first]:
            where = lambda n: "a host (NumPy) array" if on_host[n] else "a GPU (CuPy / CUDA) array"
            fail(TypeError, name, f"{where(name)} while {first} is {where(first)}",
                 "all of them on the host or all on the GPU (move one with cupy.asarray / cupy.asnumpy)")
    host = on_host[first]
    cp = cupy_module()

    device_id = None
    if not host:
        if cp is None:
            fail(TypeError, first, "a GPU array but CuPy is not importable",
                 "GPU arrays with CuPy installed (pip install cupyflash[cu12] or [cu13])")
        ids = {}
        for name, x in arrays.items():
            if x is not None:
                ids[name] = int(_to_cupy(x).device.id)
        device_id = ids[first]
        for name, i in ids.items():
            if i != device_id:
                fail(ValueError, name, f"an array on GPU {i} while {first} is on GPU {device_id}",
                     "all arrays on one GPU")

    if device == "cpu":
        where = "cpu"
    elif device == "gpu":
        if not gpu_available():
            fail(RuntimeError, "device", '"gpu" but no usable CUDA GPU (CuPy missing or no device)',
                 '"cpu" or "auto" on this machine')
        where = "gpu"
    else:
        where = "gpu" if (not host or (gpu_available() and gpu_covers)) else "cpu"

    if host:
        give_back = (lambda r: r) if where == "cpu" else (lambda r: None if r is None else cp.asnumpy(r))
    else:
        give_back = (lambda r: r) if where == "gpu" else (lambda r: None if r is None else _device_copy(r, device_id))
    xp = np if where == "cpu" else cp
    if where == "gpu" and device_id is None:
        device_id = int(cp.cuda.Device().id)
    return Backend(where, xp, device_id, give_back, host)


def _device_copy(r, device_id):
    cp = cupy_module()
    with cp.cuda.Device(device_id):
        return cp.asarray(r)
