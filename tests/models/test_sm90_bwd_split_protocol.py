"""The synchronization of the 16-bit Hopper backward at head dim 256 (flash_bwd_sm90 with
Layout::SPLIT_D: kernels_cu/hopper/bwd_split_consumer.cuh, the producer roles of
hopper/bwd_producer.cuh) as a discrete model, run under many random interleavings on the CPU with
tests/models/test_sm90_f32_bwd_protocol.py's machinery (mbarriers, tagged buffers, deadlock /
parity-alias / overwrite checks) and the phase-checked mbarriers and named barriers of
test_sm90_f32_bwd_t128_protocol.py.

Roles: the TMA thread (work tiles; K, V in one buffer; Q, dO in a two-slot ring, the tile's K / V
loaded after its first two steps' Q / dO), ROWS_WARP (lse, D rows per slot), and each consumer
warp (c0w0 .. c1w3). A wgmma product is warpgroup-collective: its reads (attributed to the
consumer, "c0" / "c1") start when the first warp issues it and end when the last warp has
reached the wait (``Product``), so a warp past the wait knows the whole product is done. The
handoffs: Pᵀ rows of c0's warp w, read back by c1's warp w with its own loads (pt_full /
pt_empty, one arrival per warp here, per thread in the kernel); dSᵀ rows of c1's warp w, read
only by wgmma (named barriers SPLIT_DS_FULL, both consumers sync; SPLIT_DS_EMPTY, c0 arrives,
c1 syncs). A protocol with one wait removed must fail.

The model follows the kernel's text by hand: change both together.
"""
from __future__ import annotations

import pytest

from test_sm90_f32_bwd_protocol import Buf, W
from test_sm90_f32_bwd_t128_protocol import TILES, NBar, PMBar, expect_hazard, run_clean

WARPS = 4
NBUF = 2


class Product:
    """One wgmma product (group) of a consumer's four warps: ``issue`` by each warp (the first
    to name a buffer starts its read), ``wait`` by each warp until all four have reached it, and
    ``done`` by each warp past the wait (the first ends every read: other roles may run between
    the last arrival and then, as the product runs on after the last issue)."""

    def __init__(self, owner):
        self.owner, self.reads = owner, set()
        self.bar = PMBar(f"{owner}:product", WARPS)

    def issue(self, bufs):
        for buf, tag in bufs:
            if (buf, tag) not in self.reads:
                buf.start(self.owner, tag)
                self.reads.add((buf, tag))

    def wait(self):
        self.bar.arrive(1, 0)
        return W(self.bar, 0)

    def done(self):
        """A warp past the wait: the product (every warp's part) has completed."""
        for buf, _ in self.reads:
            buf.end(self.owner)
        self.reads = set()


def protocol(tiles, drop=None):
    """Role generators for work tiles with ``tiles`` steps each (0 allowed); ``drop`` names a
    wait to leave out."""
    B = PMBar
    C0 = tuple(f"c0w{w}" for w in range(WARPS))
    C1 = tuple(f"c1w{w}" for w in range(WARPS))
    tile_full = [B("tile_full0", 1), B("tile_full1", 1)]
    tile_empty = [B("tile_empty0", 2 * WARPS + 1), B("tile_empty1", 2 * WARPS + 1)]
    kv_full, kv_empty = B("kv_full", 1), B("kv_empty", 2)     # kv_empty: each consumer's thread 0
    qdo_full = [B(f"qdo_full{s}", 2) for s in range(NBUF)]     # TMA thread + ROWS_WARP
    qdo_empty = [B(f"qdo_empty{s}", 2 * WARPS) for s in range(NBUF)]   # every consumer warp
    pt_full, pt_empty = B("pt_full", WARPS), B("pt_empty", WARPS)
    nbar = {"DS_FULL": NBar("SPLIT_DS_FULL", 2 * WARPS), "DS_EMPTY": NBar("SPLIT_DS_EMPTY", 2 * WARPS)}
    ring = [Buf("tile_smem0"), Buf("tile_smem1")]
    K, V = Buf("k_smem"), Buf("v_smem")
    Q = [Buf(f"q_smem{s}") for s in range(NBUF)]
    DO = [Buf(f"do_smem{s}") for s in range(NBUF)]
    rows = [Buf(f"rows{s}") for s in range(NBUF)]
    PT = [Buf(f"pT_rows{w}") for w in range(WARPS)]      # written by c0's warp w
    DST = [Buf(f"dsT_rows{w}") for w in range(WARPS)]    # written by c1's warp w
    seq = list(tiles) + [None]
    # each consumer's products, one object per (consumer, step, product), shared by its warps
    products = {}

    def product(c, q_it, name):
        key = (c, q_it, name)
        if key not in products:
            products[key] = Product(c)
        return products[key]

    def wait(name, bar, phase):
        return None if drop == name else W(bar, phase)

    def nsync(name, me):
        """bar.sync on a named barrier ("c1:DS_EMPTY" and the like)."""
        if drop == name:
            return None
        bar = nbar[name[3:]]
        return W(bar, bar.arrive(me))

    def take_tile(who, i):
        ts = i % 2
        yield wait(f"{who[:2]}:tile_full", tile_full[ts], i // 2)
        ring[ts].start(who, i)
        ring[ts].end(who)
        tile_empty[ts].arrive(1, i // 2)

    def tma():
        kv_it = q_it = 0

        def load_kv():
            nonlocal kv_it
            if kv_it > 0:
                yield wait("tma:kv_empty", kv_empty, kv_it - 1)
            K.write(kv_it, ("c0", "c1"))
            V.write(kv_it, ("c1",))
            kv_full.arrive(1, kv_it)
            kv_it += 1

        for i, steps in enumerate(seq):
            ts = i % 2
            if i >= 2:
                yield wait("tma:tile_empty", tile_empty[ts], i // 2 - 1)
            ring[ts].write(i, C0 + C1 + ("rows",))
            tile_full[ts].arrive(1, i // 2)
            if steps is None:
                return
            kv_at = min(NBUF, steps)   # KVBUF = 1: the tile's first NBUF steps' Q / dO go first
            for st in range(steps):
                if st == kv_at:
                    yield from load_kv()
                s = q_it % NBUF
                if q_it >= NBUF:
                    yield wait("tma:qdo_empty", qdo_empty[s], q_it // NBUF - 1)
                Q[s].write(q_it, ("c0", "c1"))
                DO[s].write(q_it, ("c0", "c1"))
                qdo_full[s].arrive(1, q_it // NBUF)
                q_it += 1
                yield None
            if steps > 0 and kv_at == steps:
                yield from load_kv()

    def rows_warp():
        q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile("rows", i)
            if steps is None:
                return
            for st in range(steps):
                s = q_it % NBUF
                if q_it >= NBUF:
                    yield wait("rows:qdo_empty", qdo_empty[s], q_it // NBUF - 1)
                rows[s].write(q_it, C0 + C1)
                qdo_full[s].arrive(1, q_it // NBUF)
                q_it += 1

    def consumer(c, w):
        me = f"{c}w{w}"
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile(me, i)
            if steps is None:
                break
            if steps > 0:
                yield wait(f"{c}:kv_full", kv_full, kv_it)
            for st in range(steps):
                s = q_it % NBUF
                yield wait(f"{c}:qdo_full", qdo_full[s], q_it // NBUF)
                # c0: Sᵀ = K Qᵀ; c1: dPᵀ = V dOᵀ
                first = product(c, q_it, "first")
                first.issue([(K, kv_it), (Q[s], q_it)] if c == "c0" else [(V, kv_it), (DO[s], q_it)])
                yield first.wait()
                first.done()
                if c == "c0":
                    rows[s].start(me, q_it)            # lse for Pᵀ
                    yield None
                    rows[s].end(me)
                    if q_it > 0:
                        yield wait("c0:pt_empty", pt_empty, q_it - 1)
                    PT[w].write(q_it, (f"c1w{w}",))
                    pt_full.arrive(1, q_it)
                else:
                    yield wait("c1:pt_full", pt_full, q_it)
                    PT[w].start(me, q_it)              # this thread's own pairs, back into registers
                    yield None
                    PT[w].end(me)
                    pt_empty.arrive(1, q_it)
                    rows[s].start(me, q_it)            # D for dSᵀ
                    yield None
                    rows[s].end(me)
                    if q_it > 0:
                        yield nsync("c1:DS_EMPTY", me)
                    DST[w].write(q_it, ("c0", "c1"))
                # dV_c += Pᵀ dO[:, half c] (Pᵀ from registers)
                dvdk = product(c, q_it, "dvdk")
                dvdk.issue([(DO[s], q_it)])
                yield nsync(f"{c}:DS_FULL", me)
                # dK_c += dSᵀ Q[:, half c] (dSᵀ from shared memory, every warp's rows)
                dvdk.issue([(Q[s], q_it)] + [(b, q_it) for b in DST])
                yield dvdk.wait()
                dvdk.done()
                qdo_empty[s].arrive(1, q_it // NBUF)
                yield None
                # dQ[BM, half c] = dS K[:, half c]
                dq = product(c, q_it, "dq")
                dq.issue([(K, kv_it)] + [(b, q_it) for b in DST])
                yield dq.wait()
                dq.done()
                if c == "c0":
                    nbar["DS_EMPTY"].arrive(me)
                if st == steps - 1 and w == 0:
                    kv_empty.arrive(1, kv_it)          # thread 0: the whole tile's products done
                q_it += 1
            if steps > 0:
                kv_it += 1
        if c == "c1" and q_it > 0:                     # c0's last SPLIT_DS_EMPTY arrivals
            yield nsync("c1:DS_EMPTY", me)

    roles = {"tma": tma(), "rows": rows_warp()}
    for c in ("c0", "c1"):
        for w in range(WARPS):
            roles[f"{c}w{w}"] = consumer(c, w)
    return roles, nbar


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "tiles" + "-".join(map(str, t)))
def test_protocol_has_no_hazard(tiles):
    run_clean(protocol, tiles)


WAITS = ["tma:qdo_empty", "tma:kv_empty", "tma:tile_empty", "rows:qdo_empty",
         "c0:qdo_full", "c1:qdo_full", "c0:kv_full", "c1:kv_full",
         "c1:pt_full", "c1:DS_EMPTY", "c0:DS_FULL", "c1:DS_FULL"]


def test_pt_empty_is_implied_by_ds_full():
    """c0's pt_empty wait is redundant here: each c1 warp reads its Pᵀ pairs before it syncs
    SPLIT_DS_FULL, which c0 passes before its next Pᵀ stores. The kernel keeps it (an
    already-completed mbarrier wait per step) so that racecheck, which follows an mbarrier
    release by the reading thread (docs/reliability.md), sees the order of those accesses."""
    for tiles in TILES:
        run_clean(protocol, tiles, seeds=30, drop="c0:pt_empty")


@pytest.mark.parametrize("drop", WAITS)
def test_the_model_catches_a_missing_wait(drop):
    """Each of these waits is needed: without it some interleaving breaks a rule."""
    expect_hazard(protocol, drop)


def test_the_model_reads_the_kernel():
    """The barriers and counts the model assumes are the kernel's."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "kernels_cu" / "hopper"
    cons = (root / "bwd_split_consumer.cuh").read_text()
    entry = (root / "bwd.cu").read_text()
    for expr in ("mbar_init(tile_empty + 8 * TILE_RING, 128);", "mbar_init(tile_empty + 8 * TILE_RING + 8, 128);",
                 "mbar_init(qdo_empty + 8 * s, 256);", "mbar_init(kv_empty + 8 * b, 2);"):
        assert expr in entry, expr
    order = [m.group(0) for m in re.finditer(
        r"mbar_wait\(pt_empty|mbar_arrive\(pt_full\)|mbar_wait\(pt_full|mbar_arrive\(pt_empty\)|"
        r"named_bar_sync\(SPLIT_DS_EMPTY|named_bar_sync\(SPLIT_DS_FULL|named_bar_arrive\(SPLIT_DS_EMPTY|"
        r"mbar_arrive\(sm\.qdo_empty|mbar_arrive\(sm\.kv_empty", cons)]
    assert order == ["mbar_wait(pt_empty", "mbar_arrive(pt_full)", "mbar_wait(pt_full",
                     "mbar_arrive(pt_empty)", "named_bar_sync(SPLIT_DS_EMPTY", "named_bar_sync(SPLIT_DS_FULL",
                     "mbar_arrive(sm.qdo_empty", "named_bar_arrive(SPLIT_DS_EMPTY", "mbar_arrive(sm.kv_empty",
                     "named_bar_sync(SPLIT_DS_EMPTY"], order
