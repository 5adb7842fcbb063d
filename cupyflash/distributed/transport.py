"""How the shards travel: one operation, ``shift``, round a ring.

A shift sends some arrays to the next rank (``rank + 1``) and receives as many from the previous
one (``rank - 1``), every rank at once. That is all ring attention needs: no allreduce, no
all-to-all.

The ring algorithms in ring.py are written once, per rank, as generators that ``yield`` a
:class:`Shift` at each exchange and get back a handle whose ``wait()`` returns the received
arrays. A transport runs them:

- :class:`NcclTransport`: one rank per process (or per communicator), the exchange a grouped
  ``ncclSend`` / ``ncclRecv`` pair on a dedicated stream, started at once and waited for later,
  so the transfer of the next shard runs while the current block's attention does.
- :class:`InProcessTransport`: ``world`` simulated ranks in one process, run in lock-step (every
  rank up to its next exchange, then the exchange, then on), on NumPy arrays (the CPU
  implementation) or CuPy arrays (one GPU, or one per rank).
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


class Shift:
    """A request: send ``arrays`` to the next rank, receive arrays shaped ``recv_like``
    ((shape, dtype) pairs) from the previous rank."""

    __slots__ = ("arrays", "recv_like")

    def __init__(self, arrays: Sequence, recv_like: Sequence[tuple]):
        self.arrays = tuple(arrays)
        self.recv_like = tuple((tuple(int(n) for n in s), np.dtype(d)) for s, d in recv_like)


class _Done:
    """A completed exchange (in-process): ``wait()`` returns the received arrays."""

    __slots__ = ("arrays",)

    def __init__(self, arrays):
        self.arrays = tuple(arrays)

    def wait(self):
        return self.arrays


class Transport:
    """A rank's end of a ring: ``rank``, ``world`` and ``start_shift``; ``run`` drives one rank's
    generator."""

    rank: int
    world: int

    def start_shift(self, arrays, recv_like):  # pragma: no cover - interface
        raise NotImplementedError

    def shift(self, arrays, recv_like=None):
        """Send ``arrays`` to the next rank; return the arrays received from the previous one
        (shaped like ``arrays`` unless ``recv_like`` says otherwise)."""
        if recv_like is None:
            recv_like = [(a.shape, a.dtype) for a in arrays]
        return self.start_shift(arrays, recv_like).wait()

    def run(self, gen):
        """Drive one rank's ring generator to its return value."""
        try:
            req = next(gen)
            while True:
                req = gen.send(self.start_shift(req.arrays, req.recv_like))
        except StopIteration as stop:
            return stop.value


def _cupy():
    import cupy

    return cupy


def _device_of(x):
    """The CUDA device id of a CuPy array, None for anything else."""
    if type(x).__module__.split(".")[0] == "cupy":
        return x.data.device_id
    return None


def _to_device(x, device):
    """``x`` on ``device`` (a copy through cudaMemcpy with unified addressing when it is on
    another device; the source device is synchronized first)."""
    src = _device_of(x)
    if device is None or src is None or src == device:
        return x
    cp = _cupy()
    with cp.cuda.Device(src):
        x = cp.ascontiguousarray(x)
        cp.cuda.Device(src).synchronize()
    with cp.cuda.Device(device):
        y = cp.empty(x.shape, x.dtype)
        cp.cuda.Device(device).synchronize()  # y's memory may still be read by queued work
        if x.nbytes:
            y.data.copy_from_device(x.data, x.nbytes)
    return y


class InProcessTransport:
    """``world`` ranks in this process, run in lock-step: the ring functions take lists (one
    array per rank) and return lists.

    Without ``comms`` the ranks are simulated and an exchange hands each rank the previous
    rank's arrays (copied between devices when the ranks' arrays live on different GPUs).
    ``copy=True`` hands each rank copies of what it receives (a check that no rank writes into a
    buffer after sending it; the algorithms never do).

    With ``comms`` (all ranks' ``cupy.cuda.nccl.NcclCommunicator``, rank order, e.g. from
    ``NcclCommunicator.initAll(devices)``: one process driving several GPUs) the exchange is
    NCCL's: every rank's send / recv inside one group, each on its rank's own stream, as
    :class:`NcclTransport` does for one rank. Passing such a list as ``comm`` to the ring
    functions makes this transport."""

    is_simulated = True

    def __init__(self, world: int = None, copy: bool = False, comms=None):
        self.nccl = None
        if comms is not None:
            comms = list(comms)
            by_rank = sorted(comms, key=lambda c: int(c.rank_id()))
            if [int(c.rank_id()) for c in by_rank] != list(range(int(comms[0].size()))):
                raise ValueError("comms: got ranks "
                                 f"{[int(c.rank_id()) for c in comms]} of a world of "
                                 f"{int(comms[0].size())}; accepted: one communicator per rank "
                                 "of the world (all ranks in this process)")
            self.nccl = [NcclTransport(c) for c in by_rank]
            world = len(by_rank) if world is None else world
            if world != len(by_rank):
                raise ValueError(f"world: got {world}; the communicators say {len(by_rank)}")
        if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
            raise ValueError(f"world: got {world!r}; accepted: an int >= 1")
        self.world = int(world)
        self.copy = bool(copy)

    def __repr__(self):
        return f"InProcessTransport(world={self.world}{', nccl' if self.nccl else ''})"

    def _nccl_exchange(self, reqs):
        """Every rank's shift as one NCCL group; handles per rank."""
        cp = _cupy()
        nccl = cp.cuda.nccl
        posted = []
        nccl.groupStart()
        try:
            for t, req in zip(self.nccl, reqs):
                with cp.cuda.Device(t.device):
                    posted.append(t.post(req.arrays, req.recv_like, nccl))
        finally:
            nccl.groupEnd()
        handles = []
        for t, (send, recv) in zip(self.nccl, posted):
            with cp.cuda.Device(t.device):
                handles.append(_NcclHandle(recv, t.stream.record(), send))
        return handles

    def shift(self, per_rank: Sequence[Sequence], devices=None) -> List[tuple]:
        """One exchange of all ranks: ``per_rank[r]`` (a tuple of arrays) goes to rank r + 1;
        returns what each rank receives (rank r gets rank r - 1's arrays)."""
        w = self.world
        if len(per_rank) != w:
            raise ValueError(f"per_rank: got {len(per_rank)} entries; accepted: {w} (one per rank)")
        out = []
        for r in range(w):
            sent = per_rank[(r - 1) % w]
            dev = None if devices is None else devices[r]
            got = tuple(_to_device(a, dev) for a in sent)
            if self.copy:
                got = tuple(a.copy() for a in got)
            out.append(got)
        return out

    def run(self, gens: Sequence, devices=None) -> list:
        """Drive one generator per rank in lock-step; returns their return values, rank order.
        ``devices[r]``: the CUDA device rank r computes on (None: NumPy or the current one)."""
        w = self.world
        if len(gens) != w:
            raise ValueError(f"got {len(gens)} ranks; this transport has world {w}")
        if self.nccl is not None:
            devices = [t.device for t in self.nccl]
        devices = list(devices) if devices is not None else [None] * w
        results = [None] * w
        done = [False] * w
        reqs = [None] * w
        sends = [None] * w

        def advance(r):
            ctx = _device_ctx(devices[r])
            with ctx:
                try:
                    reqs[r] = gens[r].send(sends[r])
                except StopIteration as stop:
                    done[r] = True
                    results[r] = stop.value

        for r in range(w):
            advance(r)
        while not all(done):
            if any(done):
                raise RuntimeError("ranks disagree on the number of exchanges "
                                   f"(finished: {[r for r in range(w) if done[r]]})")
            for r in range(w):
                want = reqs[r].recv_like
                have = [(tuple(a.shape), np.dtype(a.dtype)) for a in reqs[(r - 1) % w].arrays]
                if list(want) != have:
                    raise ValueError(
                        f"rank {r} expected to receive {[(s, str(d)) for s, d in want]} from rank "
                        f"{(r - 1) % w} but got {[(s, str(d)) for s, d in have]}: the ranks' shard "
                        "lengths (seqlens_q / seqlens_k) or shapes disagree")
            if self.nccl is not None:
                sends = self._nccl_exchange(reqs)
            else:
                got = self.shift([reqs[r].arrays for r in range(w)], devices)
                sends = [_Done(g) for g in got]
            for r in range(w):
                advance(r)
        return results


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _device_ctx(device):
    if device is None:
        return _NullCtx()
    return _cupy().cuda.Device(device)


class _NcclHandle:
    """An exchange in flight on the transport's stream: ``wait()`` makes the current stream wait
    for it and returns the received arrays. The send buffers are held until then, so their
    memory is not reused while NCCL still reads it."""

    __slots__ = ("recv", "event", "send")

    def __init__(self, recv, event, send):
        self.recv, self.event, self.send = recv, event, send

    def wait(self):
        if self.event is not None:
            _cupy().cuda.get_current_stream().wait_event(self.event)
            self.event = None
            self.send = None
        return self.recv


class NcclTransport(Transport):
    """A rank's end of the ring over a ``cupy.cuda.nccl.NcclCommunicator``.

    ``start_shift`` records an event on the current stream (the data to send is ready), makes the
    transport's own non-blocking stream wait for it, posts ``send`` to rank + 1 and ``recv`` from
    rank - 1 for every array inside one ``groupStart`` / ``groupEnd``, and records a completion
    event; ``wait()`` makes the current stream wait for that event. bfloat16 travels as
    ``NCCL_BFLOAT16`` where the NCCL binding has it, otherwise as raw bytes (send / receive need
    no arithmetic, so the bytes are the values). ``recv_alloc(shape, dtype)`` allocates the
    receive buffers (default ``cupy.empty``; the benchmark counts them with it)."""

    def __init__(self, comm, stream=None, recv_alloc=None):
        cp = _cupy()
        self.comm = comm
        self.recv_alloc = recv_alloc  # (shape, dtype) -> array; None: cupy.empty
        self.rank = int(comm.rank_id())
        self.world = int(comm.size())
        self.device = int(comm.device_id()) if hasattr(comm, "device_id") else None
        if stream is None:
            with _device_ctx(self.device):
                stream = cp.cuda.Stream(non_blocking=True)
        self.stream = stream

    def __repr__(self):
        return f"NcclTransport(rank={self.rank}, world={self.world})"

    def post(self, arrays, recv_like, nccl):
        """Inside an NCCL group, on the current device: order the transport's stream after the
        current one, post the sends to rank + 1 and the receives from rank - 1. Returns (send
        buffers, receive buffers)."""
        from .nccl import nccl_type

        cp = _cupy()
        send = [cp.ascontiguousarray(a) for a in arrays]
        alloc = self.recv_alloc or cp.empty
        recv = [alloc(shape, dtype) for shape, dtype in recv_like]
        ready = cp.cuda.get_current_stream().record()
        self.stream.wait_event(ready)
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        for s, r in zip(send, recv):
            dtype, count = nccl_type(s.dtype, s.nbytes, nccl)
            self.comm.send(s.data.ptr, count, dtype, nxt, self.stream.ptr)
            dtype, count = nccl_type(r.dtype, r.nbytes, nccl)
            self.comm.recv(r.data.ptr, count, dtype, prv, self.stream.ptr)
        return send, recv

    def start_shift(self, arrays, recv_like):
        cp = _cupy()
        if self.world == 1:  # the ring of one: what is sent comes back
            recv = [cp.empty(shape, dtype) for shape, dtype in recv_like]
            for a, r in zip(arrays, recv):
                r[...] = a
            return _NcclHandle(recv, None, None)
        nccl = cp.cuda.nccl
        nccl.groupStart()
        try:
            send, recv = self.post(arrays, recv_like, nccl)
        finally:
            nccl.groupEnd()
        return _NcclHandle(recv, self.stream.record(), send)
