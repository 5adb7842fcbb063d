"""A discrete model of the float32 Hopper backward's synchronization (kernels_cu/hopper/bwd_f32.cu),
run under many random interleavings on the CPU: the roles (TMA thread, converter warps, the two
consumers) as Python generators that wait on and arrive at mbarriers exactly where the kernel does,
and read / write tagged shared-memory buffers. It fails on a deadlock, on a wait whose parity
would alias (the barrier two phases ahead), on a read of the wrong contents, and on a write while
a read of the old contents is in flight or before a reader that must see them has. A protocol
with one wait removed must fail (test_the_model_catches_a_missing_wait), so the model can fail.

The model follows the kernel's text by hand: change both together.
"""
from __future__ import annotations

import random

import pytest


class Hazard(AssertionError):
    pass


class MBar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.done = name, count, 0, 0

    def arrive(self, n=1):
        self.pending += n
        if self.pending > self.count:
            raise Hazard(f"{self.name}: {self.pending} arrivals for a count of {self.count}")
        if self.pending == self.count:
            self.pending = 0
            self.done += 1


class Buf:
    """Contents tag, the readers that must read them before an overwrite, the reads in flight."""

    def __init__(self, name):
        self.name, self.content, self.must, self.open = name, None, set(), set()

    def write(self, content, readers=()):
        if self.open:
            raise Hazard(f"{self.name}: {content} written while {sorted(self.open)} read {self.content}")
        if self.must:
            raise Hazard(f"{self.name}: {content} overwrites {self.content} before "
                         f"{sorted(self.must)} read it")
        self.content, self.must = content, set(readers)

    def start(self, who, content):
        if self.content != content:
            raise Hazard(f"{self.name}: {who} reads {content}, it holds {self.content}")
        self.open.add(who)

    def end(self, who):
        self.open.discard(who)
        self.must.discard(who)


def W(bar, phase):
    """Yielded by a role: wait for phase ``phase`` (0-based) of ``bar`` (the kernel's parity wait
    on phase & 1)."""
    return ("wait", bar, phase)


def run(roles, seed, max_events=200_000, skew=False):
    """Run the roles to completion, one event at a time, the next role drawn at random among
    those that can run. ``skew``: one role, drawn first, is drawn 50 times less often than the
    others, so it stays parked at a satisfied wait while they go on (orders that uniform draws
    seldom reach)."""
    rng = random.Random(seed)
    slow = rng.choice(sorted(roles)) if skew else None
    speed = {name: 0.02 if name == slow else 1.0 for name in roles}
    live = {name: [gen, None] for name, gen in roles.items()}
    for _ in range(max_events):
        if not live:
            return
        runnable = []
        for name, (gen, w) in live.items():
            if w is None:
                runnable.append(name)
                continue
            bar, phase = w
            if bar.done >= phase + 2:
                raise Hazard(f"{name} waits for phase {phase} of {bar.name} ({bar.done} completed): "
                             "the parity wait would alias")
            if bar.done > phase:
                runnable.append(name)
        if not runnable:
            raise Hazard("deadlock: " + ", ".join(
                f"{n} on {w[0].name} phase {w[1]} ({w[0].done} done)" for n, (g, w) in live.items()))
        name = rng.choices(runnable, [speed[n] for n in runnable])[0] if skew else rng.choice(runnable)
        try:
            ev = next(live[name][0])
        except StopIteration:
            del live[name]
            continue
        live[name][1] = None if ev is None else (ev[1], ev[2])
    raise Hazard("did not finish")


CONSUMERS = ("c0", "c1")


def produce(kind, it, bufs, full, empty, wait, readers):
    """The TMA thread's side of a ring of len(bufs) slots (wait name "tma:<kind>_empty"): wait
    until item it - len(bufs)'s readers freed slot it % len(bufs), write item it for
    ``readers``, mark the slot full."""
    s = it % len(bufs)
    if it >= len(bufs):
        yield wait(f"tma:{kind}_empty", empty[s], it // len(bufs) - 1)
    bufs[s].write(it, readers)
    full[s].arrive()


def publish_tile(i, ring, tile_full, tile_empty, wait):
    """The two-slot work-tile ring: tile i for both consumers and the converters."""
    yield from produce("tile", i, ring, tile_full, tile_empty, wait, ("c0", "c1", "conv"))


def take_tile(who, i, warps, ring, tile_full, tile_empty, wait):
    """A reader's side (a consumer or the converters): wait for tile i, read it, free the slot
    (one arrival per warp of the reader)."""
    ts = i % 2
    yield wait(f"{who}:tile_full", tile_full[ts], i // 2)
    ring[ts].start(who, i)
    ring[ts].end(who)
    tile_empty[ts].arrive(warps)


def protocol(tiles, drop=None):
    """Role generators for work tiles with ``tiles`` steps each (0 allowed): two landing stages
    for Q, dO (raw_full / raw_empty each; the stage is freed after the transposes, which read it),
    one buffer of their split parts (released in two halves: nat_full / nat_empty, t_full /
    t_empty). ``drop``: the name of one wait to leave out (the model must then fail)."""
    B = lambda n, c: MBar(n, c)   # noqa: E731
    tile_full = [B("tile_full0", 1), B("tile_full1", 1)]
    tile_empty = [B("tile_empty0", 8 + 3), B("tile_empty1", 8 + 3)]
    kv_raw, kv_full, kv_empty = B("kv_raw", 1), B("kv_full", 1), B("kv_empty", 2)
    raw_full = [B("raw_full0", 1), B("raw_full1", 1)]
    raw_empty = [B("raw_empty0", 1), B("raw_empty1", 1)]
    nat_full = B("nat_full", 1)
    nat_empty = B("nat_empty", 8)
    t_full, t_empty = B("t_full", 1), B("t_empty", 2)
    ring = [Buf("tile_smem0"), Buf("tile_smem1")]
    QB, QS, DOB, DOS = Buf("q_big"), Buf("q_small"), Buf("do_big"), Buf("do_small")
    RQ, RDO = [Buf("raw_q0"), Buf("raw_q1")], [Buf("raw_do0"), Buf("raw_do1")]
    T = Buf("qT_doT")
    KB, KS = Buf("k_big"), Buf("k_small")
    VB = {c: Buf(f"v_big_{c}") for c in CONSUMERS}
    rows = Buf("rows")
    DS = {c: Buf(f"ds_{c}") for c in CONSUMERS}
    seq = list(tiles) + [None]

    def wait(name, bar, phase):
        return None if drop == name else W(bar, phase)

    def tma():
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            yield from publish_tile(i, ring, tile_full, tile_empty, wait)
            if steps is None:
                return
            for st in range(steps):
                rs = q_it % 2
                if q_it >= 2:
                    yield wait("tma:raw_empty", raw_empty[rs], q_it // 2 - 1)
                RQ[rs].write(("raw", q_it), ("conv_n", "conv_t"))   # natural split, transposes
                RDO[rs].write(("raw", q_it), ("conv_n", "conv_t"))
                raw_full[rs].arrive()
                if st == 0:
                    if kv_it > 0:
                        yield wait("tma:kv_empty", kv_empty, kv_it - 1)
                    KB.write(("raw", kv_it), ("conv",))
                    for c in CONSUMERS:
                        VB[c].write(("raw", kv_it), (c,))
                    kv_raw.arrive()
                    kv_it += 1
                q_it += 1
                yield None

    def converters():
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile("conv", i, 3, ring, tile_full, tile_empty, wait)
            if steps is None:
                return
            for st in range(steps):
                rs = q_it % 2
                yield wait("conv:raw_full", raw_full[rs], q_it // 2)
                if q_it > 0:
                    yield wait("conv:nat_empty", nat_empty, q_it - 1)
                for raw, big, small in ((RQ[rs], QB, QS), (RDO[rs], DOB, DOS)):
                    raw.start("conv_n", ("raw", q_it))
                    yield None
                    raw.end("conv_n")
                    big.write(("big", q_it), CONSUMERS)
                    small.write(("small", q_it), CONSUMERS)
                rows.write(q_it, CONSUMERS)
                nat_full.arrive()
                if st == 0:
                    yield wait("conv:kv_raw", kv_raw, kv_it)
                    KB.start("conv", ("raw", kv_it))
                    KB.end("conv")
                    KB.write(("big", kv_it))
                    KS.write(("small", kv_it))
                    kv_full.arrive()
                    kv_it += 1
                if q_it > 0:
                    yield wait("conv:t_empty", t_empty, q_it - 1)
                for raw in (RQ[rs], RDO[rs]):        # the transposes split the raw tiles again
                    raw.start("conv_t", ("raw", q_it))
                yield None
                for raw in (RQ[rs], RDO[rs]):
                    raw.end("conv_t")
                T.write(q_it, CONSUMERS)
                t_full.arrive()
                raw_empty[rs].arrive()
                q_it += 1

    def consumer(c):
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile(c, i, 4, ring, tile_full, tile_empty, wait)
            if steps is None:
                return
            if steps > 0:
                yield wait(f"{c}:kv_raw", kv_raw, kv_it)
                VB[c].start(c, ("raw", kv_it))
                VB[c].end(c)
                VB[c].write(("big", kv_it))
                yield wait(f"{c}:kv_full", kv_full, kv_it)
            for st in range(steps):
                yield wait(f"{c}:nat_full", nat_full, q_it)
                ops = ((QB, ("big", q_it)), (QS, ("small", q_it)), (DOB, ("big", q_it)),
                       (DOS, ("small", q_it)), (KB, ("big", kv_it)), (KS, ("small", kv_it)),
                       (VB[c], ("big", kv_it)), (rows, q_it))
                for buf, tag in ops:           # Sᵀ, dPᵀ in the tensor cores; the rows
                    buf.start(c, tag)
                yield None
                for buf, _ in ops:
                    buf.end(c)
                nat_empty.arrive(4)            # its four warps
                DS[c].write(q_it, (c,))        # dS stores
                yield wait(f"{c}:t_full", t_full, q_it)
                T.start(c, q_it)               # dV, dK
                yield None
                T.end(c)
                t_empty.arrive()
                for buf, tag in ((KB, ("big", kv_it)), (KS, ("small", kv_it)), (DS[c], q_it)):
                    buf.start(c, tag)          # Kᵀ fragments, dQᵀ
                yield None
                for buf in (KB, KS, DS[c]):
                    buf.end(c)
                if st == steps - 1:
                    kv_empty.arrive()          # in the last step, before the dQ adds
                q_it += 1
            if steps > 0:
                kv_it += 1

    return {"tma": tma(), "conv": converters(), "c0": consumer("c0"), "c1": consumer("c1")}


TILES = [[3], [1], [0, 2], [5, 0, 0, 1, 4], [2, 3, 1], [1, 1, 1, 1, 1, 1], [0], [7, 2]]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "tiles" + "-".join(map(str, t)))
def test_protocol_has_no_hazard(tiles):
    for seed in range(60):
        run(protocol(tiles), seed)


WAITS = ["tma:raw_empty", "tma:kv_empty", "tma:tile_empty", "conv:raw_full", "conv:nat_empty",
         "conv:t_empty", "conv:kv_raw", "c0:nat_full", "c1:t_full", "c0:kv_full"]


@pytest.mark.parametrize("drop", WAITS)
def test_the_model_catches_a_missing_wait(drop):
    """Each of these waits is needed: without it some interleaving breaks a rule."""
    with pytest.raises(Hazard):
        for seed in range(300):
            for tiles in ([4, 3, 5, 2], [4, 0, 0, 3, 0, 0, 5]):   # zero-step tiles: the ring's turn
                run(protocol(tiles, drop=drop), seed)
