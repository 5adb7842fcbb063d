"""Device state the launchers share (CuPy): compute capability, shared-memory opt-in and SM count
per device, the current device and stream, the Hopper kernels' per-stream work-tile counter and
the split tail's per-stream workspace.
"""
from __future__ import annotations

from contextlib import contextmanager

import cupy


_device_info = {}   # device id -> (compute capability int, smem opt-in bytes, SM count)
_smem_cap = [None]  # limit_shared_memory's cap on every device's opt-in (None: none)
_on_limit_change = []   # callables that drop what was planned under another limit


def info(dev_id):
    """(compute capability as an int, e.g. 90; opt-in shared memory per block in bytes, capped
    by limit_shared_memory; SM count) of device ``dev_id``."""
    info = _device_info.get(dev_id)
    if info is None:
        dev = cupy.cuda.Device(dev_id)
        cc = int(dev.compute_capability)
        smem = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
        info = _device_info[dev_id] = (cc, smem, int(dev.attributes["MultiProcessorCount"]))
    cap = _smem_cap[0]
    return info if cap is None or cap >= info[1] else (info[0], cap, info[2])


def when_limit_changes(clear):
    """Register ``clear()``, called whenever limit_shared_memory changes the limit: the launch
    caches keyed by shapes alone register their ``clear`` here."""
    if clear not in _on_limit_change:
        _on_limit_change.append(clear)


@contextmanager
def limit_shared_memory(nbytes: int):
    """Plan every launch inside as if each GPU allowed at most ``nbytes`` of shared memory per
    block, e.g. ``99 * 1024`` for sm_86 / sm_89 / sm_120 (the kernels then chosen are those
    GPUs' kernels: the Hopper ones need more). For tests and for reproducing a smaller GPU's
    plan on a larger one; launches planned under another limit are dropped on entry and exit."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"nbytes: got {nbytes!r}; accepted: a positive int (bytes per block)")
    old = _smem_cap[0]
    _smem_cap[0] = nbytes
    for clear in _on_limit_change:
        clear()
    try:
        yield
    finally:
        _smem_cap[0] = old
        for clear in _on_limit_change:
            clear()


get_device = cupy.cuda.runtime.getDevice
current_stream = cupy.cuda.get_current_stream
_sched = {}   # (device id, stream handle) -> the Hopper kernel's work-tile counter


def sched_counter(dev_id, stream) -> int:
    """Address of the zeroed uint32[2] work-tile counter of the Hopper kernel for launches on this
    stream (one per stream: kernels running at once on two streams must not share one; each
    launch leaves it zeroed for the next)."""
    key = (dev_id, stream)
    buf = _sched.get(key)
    if buf is None:
        buf = _sched[key] = cupy.zeros(2, cupy.uint32)
        cupy.cuda.get_current_stream().synchronize()   # zeroed before any kernel reads it
    return buf.data.ptr


_split_bufs = {}   # (device id, stream handle) -> (workspace, counters) of the split tail


def to_device(a):
    """A host array's copy on the current device (kept by its launch entry, which may launch on
    any stream: the copy is complete when this returns)."""
    d = cupy.asarray(a)
    cupy.cuda.get_current_stream().synchronize()
    return d


def split_buffers(dev_id, stream, ws_bytes, counters):
    """(workspace, counters) addresses for a Hopper forward whose last partial wave is split
    (SPLIT variants): at least ``ws_bytes`` of workspace for the pieces' partial O, m, l and
    ``counters`` zeroed uint32 (pieces finished per tile and consumer; each launch leaves them
    zeroed). One pair per stream, grown on demand: a replaced buffer goes back to CuPy's pool,
    which hands it out again only in that stream's order, after the kernels that used it."""
    key = (dev_id, stream)
    ws, count = _split_bufs.get(key, (None, None))
    if ws is None or ws.nbytes < ws_bytes:
        ws = cupy.empty(ws_bytes, cupy.uint8)
    if count is None or count.size < counters:
        count = cupy.zeros(counters, cupy.uint32)
        cupy.cuda.get_current_stream().synchronize()   # zeroed before any kernel reads it
    _split_bufs[key] = (ws, count)
    return ws.data.ptr, count.data.ptr
