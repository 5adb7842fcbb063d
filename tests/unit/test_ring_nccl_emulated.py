"""The per-rank NCCL code path (NcclTransport, Transport.run, the order of the K/V and dK/dV
exchanges, seqlens) end to end on the CPU: one thread per rank, NumPy arrays, and a stand-in for
CuPy's stream/event calls and NCCL's grouped send/recv that copies the bytes between the ranks'
buffers by address. What it cannot show: real streams, overlap, or NCCL itself."""
from __future__ import annotations

import ctypes
import queue
import threading
import types

import numpy as np
import pytest

import cupyflash as cf
from cupyflash.distributed import (ring_attention, ring_attention_backward, shard,
                                   shard_lengths, unshard)
from cupyflash.distributed import ring as ring_mod
from cupyflash.distributed import transport as tr_mod


class _Arr(np.ndarray):
    """A NumPy array with CuPy's ``.data.ptr`` (its address)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


class _Stream:
    ptr = 0

    def __init__(self, non_blocking=False):
        pass

    def record(self):
        return object()

    def wait_event(self, event):
        pass


_SIZES = {1: 1, 2: 4, 3: 2}  # NCCL_UINT8, NCCL_FLOAT32, NCCL_BFLOAT16 (stand-in enums)


class _Fabric:
    """Point-to-point byte queues between ranks, and the grouped calls of each thread."""

    def __init__(self):
        self.queues = {}
        self.lock = threading.Lock()
        self.local = threading.local()
        self.log = []

    def q(self, src, dst):
        with self.lock:
            return self.queues.setdefault((src, dst), queue.Queue())

    def nccl(self):
        fabric = self

        def group_start():
            fabric.local.ops = []

        def group_end():
            ops, fabric.local.ops = fabric.local.ops, None
            for op in ops:  # sends first, then the receives (as NCCL's group does)
                if op[0] == "send":
                    _, comm, ptr, nbytes, peer = op
                    fabric.q(comm.rank, peer).put(ctypes.string_at(ptr, nbytes))
            for op in ops:
                if op[0] == "recv":
                    _, comm, ptr, nbytes, peer = op
                    data = fabric.q(peer, comm.rank).get(timeout=60)
                    assert len(data) == nbytes, (comm.rank, peer, len(data), nbytes)
                    ctypes.memmove(ptr, data, nbytes)

        return types.SimpleNamespace(groupStart=group_start, groupEnd=group_end,
                                     NCCL_UINT8=1, NCCL_FLOAT32=2, NCCL_BFLOAT16=3)


class _Comm:
    def __init__(self, fabric, rank, world):
        self.fabric, self.rank, self.world = fabric, rank, world

    def rank_id(self):
        return self.rank

    def device_id(self):
        return self.rank

    def size(self):
        return self.world

    def _op(self, kind, ptr, count, dtype, peer, stream):
        assert self.fabric.local.ops is not None, "send/recv outside a group"
        assert 0 <= peer < self.world and peer != self.rank
        self.fabric.local.ops.append((kind, self, ptr, count * _SIZES[dtype], peer))
        self.fabric.log.append((self.rank, kind, peer))

    def send(self, ptr, count, dtype, peer, stream):
        self._op("send", ptr, count, dtype, peer, stream)

    def recv(self, ptr, count, dtype, peer, stream):
        self._op("recv", ptr, count, dtype, peer, stream)


class _Device:
    current = None

    def __init__(self, i):
        self.i = i

    def __enter__(self):
        self.prev, _Device.current = _Device.current, self.i
        return self

    def __exit__(self, *exc):
        _Device.current = self.prev
        return False


@pytest.fixture
def fabric(monkeypatch):
    fab = _Fabric()
    fake = types.SimpleNamespace(
        ascontiguousarray=lambda a: np.ascontiguousarray(a).view(_Arr),
        empty=lambda shape, dtype: np.empty(shape, dtype).view(_Arr),
        cuda=types.SimpleNamespace(Stream=_Stream, get_current_stream=lambda: _Stream(),
                                   nccl=fab.nccl(), Device=_Device))
    monkeypatch.setattr(tr_mod, "_cupy", lambda: fake)
    monkeypatch.setattr(ring_mod, "_NCCL_TRANSPORTS", {})
    monkeypatch.setattr(tr_mod, "_device_ctx", _Device)
    return fab


def _spmd(world, fn):
    """fn(rank) in one thread per rank; their results, rank order (re-raises a rank's error)."""
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank is stuck (exchanges out of order)"
    return results


@pytest.mark.parametrize("world,scheme,causal,length", [
    (2, "zigzag", True, 16), (3, "zigzag", True, 18), (3, "contiguous", False, 17),
    (4, "contiguous", True, 19), (1, "contiguous", True, 9)],
    ids=["w2-zigzag-causal", "w3-zigzag-causal", "w3-uneven-full", "w4-uneven-causal", "w1"])
def test_per_rank_path_matches_single_call(rng, fabric, world, scheme, causal, length):
    q, k, v, do = (rng.standard_normal((2, length, 2, 8)) for _ in range(4))
    lens = shard_lengths(length, world, scheme)
    comms = [_Comm(fabric, r, world) for r in range(world)]
    kw = dict(causal=causal, scheme=scheme, seqlens_q=lens, seqlens_k=lens)

    def rank_fn(r):
        mine = [shard(x, r, world, scheme=scheme) for x in (q, k, v, do)]
        out, lse = ring_attention(*mine[:3], comms[r], return_lse=True, **kw)
        grads = ring_attention_backward(mine[3], *mine[:3], out, lse, comms[r], **kw)
        return out, lse, grads

    res = _spmd(world, rank_fn)
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    want = (out, lse) + tuple(cf.attention_backward(do, q, k, v, out, lse, causal=causal))
    got = [unshard([x[0] for x in res], scheme=scheme), unshard([x[1] for x in res], axis=2, scheme=scheme)]
    got += [unshard([x[2][i] for x in res], scheme=scheme) for i in range(3)]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.abs(g - w).max() <= 1e-10, name
    sends = sum(1 for _, kind, _ in fabric.log if kind == "send")
    # forward: world-1 shifts of (k, v); backward: world-1 of (k, v) and world of (dk, dv)
    assert sends == (0 if world == 1 else world * (2 * (world - 1) + 2 * (world - 1) + 2 * world))
    assert all(peer == (r + 1) % world for r, kind, peer in fabric.log if kind == "send")


def test_bfloat16_travels_as_bfloat16(fabric):
    import ml_dtypes

    comms = [_Comm(fabric, r, 2) for r in range(2)]
    x = [np.full((3,), r, ml_dtypes.bfloat16) for r in range(2)]
    got = _spmd(2, lambda r: ring_mod._transport(comms[r]).shift([x[r]]))
    assert [float(g[0][0]) for g in got] == [1.0, 0.0]
    assert got[0][0].dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("world", [2, 3])
def test_one_process_driving_every_rank(rng, fabric, world):
    """A list of communicators (one process, several GPUs): lock-step ranks, every exchange one
    NCCL group over all ranks, each rank's generator advanced under its device."""
    scheme, causal, length = "zigzag", True, 4 * world
    q, k, v, do = (rng.standard_normal((1, length, 2, 8)) for _ in range(4))
    comms = [_Comm(fabric, r, world) for r in range(world)][::-1]  # any order
    parts = [[shard(x, r, world, scheme=scheme) for r in range(world)] for x in (q, k, v, do)]
    outs, lses = ring_attention(*parts[:3], comms, causal=causal, scheme=scheme, return_lse=True)
    grads = ring_attention_backward(parts[3], *parts[:3], outs, lses, comms, causal=causal,
                                    scheme=scheme)
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    want = (out,) + tuple(cf.attention_backward(do, q, k, v, out, lse, causal=causal))
    got = [unshard(outs, scheme=scheme)] + [unshard([g[i] for g in grads], scheme=scheme)
                                           for i in range(3)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.abs(g - w).max() <= 1e-10, name
    assert all(peer == (r + 1) % world for r, kind, peer in fabric.log if kind == "send")
