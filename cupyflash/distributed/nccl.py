"""NCCL set-up: the unique id as hex text, the process group from environment variables, and
the NCCL data type of an array. CuPy (and libnccl) are imported only when a function needs them.

Environment read by :func:`init_process_group` (set by ``python -m cupyflash.distributed.run``):

- ``RANK``, ``WORLD_SIZE``: this process's rank and the number of ranks;
- ``LOCAL_RANK``: the GPU of this node the rank uses (default: ``RANK``);
- ``CUPYFLASH_NCCL_ID``: the NCCL unique id, hex; or ``CUPYFLASH_NCCL_ID_FILE``: a file holding
  it (multi-node: a file on a shared file system, written by node 0's launcher).
"""
from __future__ import annotations

import os
import time

import numpy as np

ID_ENV = "CUPYFLASH_NCCL_ID"
ID_FILE_ENV = "CUPYFLASH_NCCL_ID_FILE"


def _nccl():
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        raise RuntimeError("cupy.cuda.nccl: the NCCL library could not be loaded "
                           "(pip install nvidia-nccl-cu12)")
    return nccl


def nccl_type(dtype, nbytes: int, nccl=None):
    """(NCCL data type, element count) to send ``nbytes`` of ``dtype``: the matching NCCL type
    (bfloat16 included where the binding has NCCL_BFLOAT16), else raw bytes (NCCL_UINT8)."""
    nccl = nccl if nccl is not None else _nccl()
    dt = np.dtype(dtype)
    names = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
             "bfloat16": "NCCL_BFLOAT16", "int32": "NCCL_INT32", "int64": "NCCL_INT64",
             "uint8": "NCCL_UINT8", "int8": "NCCL_INT8"}
    name = names.get(dt.name)
    if name is not None and hasattr(nccl, name):
        return getattr(nccl, name), nbytes // dt.itemsize
    return nccl.NCCL_UINT8, nbytes


def unique_id_hex() -> str:
    """A new NCCL unique id as hex text (for ``CUPYFLASH_NCCL_ID``)."""
    uid = _nccl().get_unique_id()
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid).hex()
    return bytes(int(x) & 0xFF for x in uid).hex()  # CuPy < 14: a tuple of char values


def _communicator(nccl, world: int, uid_hex: str, rank: int):
    raw = bytes.fromhex(uid_hex)
    try:
        return nccl.NcclCommunicator(world, raw, rank)
    except TypeError:  # CuPy < 14 takes the id as a tuple of signed chars
        return nccl.NcclCommunicator(world, tuple(b - 256 if b > 127 else b for b in raw), rank)


def read_id_file(path: str, timeout: float = 300.0) -> str:
    """The hex id in ``path``, waiting up to ``timeout`` s for the file to appear."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return text
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ID_FILE_ENV}: no NCCL id appeared in {path} in {timeout:.0f} s")
        time.sleep(0.1)


def _env_int(name, default=None):
    text = os.environ.get(name)
    if text is None:
        if default is None:
            raise RuntimeError(f"{name} is not set: start the script with "
                               "python -m cupyflash.distributed.run --nproc N script.py")
        return default
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"{name}={text!r}: not an int") from None


def init_process_group():
    """(comm, rank, world) from the launcher's environment: selects GPU ``LOCAL_RANK`` and
    creates the ``cupy.cuda.nccl.NcclCommunicator`` of ``WORLD_SIZE`` ranks."""
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_RANK", rank)
    uid = os.environ.get(ID_ENV)
    if not uid:
        path = os.environ.get(ID_FILE_ENV)
        if not path:
            raise RuntimeError(f"neither {ID_ENV} nor {ID_FILE_ENV} is set: start the script with "
                               "python -m cupyflash.distributed.run")
        uid = read_id_file(path)
    import cupy

    cupy.cuda.Device(local).use()
    comm = _communicator(_nccl(), world, uid, rank)
    return comm, rank, world
