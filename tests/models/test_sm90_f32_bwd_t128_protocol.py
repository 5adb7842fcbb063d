"""The synchronization of the float32 Hopper backward's hd 128 path (design T in
kernels_cu/hopper/bwd_f32.cu) as a discrete model, run under many random interleavings on the
CPU, with tests/models/test_sm90_f32_bwd_protocol.py's machinery (mbarriers, tagged buffers, deadlock /
parity-alias / overwrite checks). Each consumer warp is its own role (c0w0 .. c1w3), so the model
also sees the order between the warps of one consumer: the named barrier of a consumer's 128
threads (WG_BAR, bar.sync of its four warps) and the mbarriers of the handoffs between the
consumers: Pᵀ through the mbarriers pt_full / pt_empty, on which every thread arrives after its
own accesses (one arrival per warp here; the kernel's counts are 32 times these), dSᵀ / dS
through the named barriers DS_FULL / DS_EMPTY (bar.arrive on one side, bar.sync on the other). Every arrival
names the phase it is meant for and fails the model if it lands in another (the phases follow
the step count across work tiles). Pᵀ, dSᵀ and dS are four buffers each, one per writing warp's
rows; wgmma reads all four (B of the transposed products), c1's read-back of Pᵀ only its own
lane's places (the rows of c0's warp of the same index). Q, dO land twice per step (in the big
halves of their parts, split in place; and as raw copies for the transposed products'
fragments); K and V raw (read by the consumers only). A protocol with one wait removed must
fail.

The model follows the kernel's text by hand: change both together.
"""
from __future__ import annotations

import pytest

from test_sm90_f32_bwd_protocol import Buf, Hazard, MBar, W, run

WARPS = 4


class PMBar(MBar):
    """An mbarrier whose arrivals name their phase: an arrival that would complete or count
    towards another phase than the one it is meant for fails the model."""

    def arrive(self, n=1, phase=None):
        if phase is not None and phase != self.done:
            raise Hazard(f"{self.name}: an arrival for phase {phase} lands in phase {self.done}")
        super().arrive(n)


class NBar:
    """A named barrier of ``parties`` warps: each role (acting for ``n`` warps) arrives
    (bar.arrive) or arrives and waits (bar.sync) once per generation; a second arrival of a role
    in one generation fails the model (the hardware would count it into the wrong one)."""

    def __init__(self, name, parties):
        self.name, self.parties, self.cur, self.count, self.done = name, parties, set(), 0, 0

    def arrive(self, who, n=1):
        if who in self.cur:
            raise Hazard(f"{self.name}: {who} arrives twice in generation {self.done}")
        self.cur.add(who)
        self.count += n
        gen = self.done
        if self.count == self.parties:
            self.cur, self.count, self.done = set(), 0, self.done + 1
        return gen


def protocol(tiles, drop=None):
    """Role generators for work tiles with ``tiles`` steps each (0 allowed). Per step, Q and dO
    land twice: raw in the big halves of their parts (raw_full), split there in place by the
    converters (nat_full) and read by the first products (Sᵀ: Q parts, c0; dPᵀ: dO parts, c1;
    nat_empty frees them for the next step's landing), and raw in the copies (r_full) that the
    dVᵀ_h / dKᵀ_h fragment loads read (r_empty). Rows (lse, D) in two buffers by step parity.
    Pᵀ through mbarriers, dSᵀ / dS through named barriers (DS_FULL, DS_EMPTY)."""
    groups = {"c0": [(w,) for w in range(WARPS)], "c1": [(w,) for w in range(WARPS)]}
    role = {(c, w): f"{c}w{ws[0]}" if len(ws) == 1 else c for c in groups for ws in groups[c] for w in ws}
    C0 = tuple(dict.fromkeys(role["c0", w] for w in range(WARPS)))
    C1 = tuple(dict.fromkeys(role["c1", w] for w in range(WARPS)))
    ALL = C0 + C1
    B = PMBar
    tile_full = [B("tile_full0", 1), B("tile_full1", 1)]
    tile_empty = [B("tile_empty0", 8 + 3), B("tile_empty1", 8 + 3)]
    kv_raw, kv_empty = B("kv_raw", 1), B("kv_empty", 8)
    raw_full, r_full, r_empty = B("raw_full", 1), B("r_full", 1), B("r_empty", 8)
    nat_full, nat_empty = B("nat_full", 1), B("nat_empty", 8)
    # Pᵀ's handoff: pt_full counts c0's warps (the writers), pt_empty c1's (the other readers;
    # c0's own warps' reads are ordered by their DS_FULL bar.sync after dVᵀ_0)
    pt_full, pt_empty = B("pt_full", WARPS), B("pt_empty", WARPS)
    wg_bar = {"c0": NBar("WG_BAR", WARPS), "c1": NBar("WG_BAR+1", WARPS)}
    # dSᵀ / dS's handoff: bar.arrive on one side, bar.sync on the other, both consumers' warps
    nbar = {n: NBar(n, 2 * WARPS) for n in ("DS_FULL", "DS_EMPTY")}
    ring = [Buf("tile_smem0"), Buf("tile_smem1")]
    QP, DOP = Buf("q_parts"), Buf("do_parts")       # big halves: TMA raw, then split in place
    RQ, RDO = Buf("q_raw_copy"), Buf("do_raw_copy")
    K, V = Buf("k_raw"), Buf("v_raw")
    rows = [Buf("rows0"), Buf("rows1")]
    PT = [Buf(f"pT_rows{w}") for w in range(WARPS)]      # written by c0's warp w
    DST = [Buf(f"dsT_rows{w}") for w in range(WARPS)]    # written by c1's warp w
    DSN = [Buf(f"ds_part{w}") for w in range(WARPS)]     # written by c1's warp w
    seq = list(tiles) + [None]

    def wait(name, bar, phase):
        return None if drop == name else W(bar, phase)

    def wg_sync(c, me):
        """bar.sync of consumer c's four warps: arrive, then wait for the generation."""
        if drop == f"{c}:WG_BAR":
            return None
        return W(wg_bar[c], wg_bar[c].arrive(me, WARPS if me == c else 1))

    def nsync(name, me, n):
        """bar.sync on a handoff named barrier (name "c0:PT_EMPTY" and the like)."""
        if drop == name:
            return None
        bar = nbar[name[3:]]
        return W(bar, bar.arrive(me, n))

    def tma():
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            ts = i % 2                                  # the two-slot work-tile ring
            if i >= 2:
                yield wait("tma:tile_empty", tile_empty[ts], i // 2 - 1)
            ring[ts].write(i, ALL + ("conv",))
            tile_full[ts].arrive(1, i // 2)
            if steps is None:
                return
            for st in range(steps):
                if q_it >= 1:
                    yield wait("tma:nat_empty", nat_empty, q_it - 1)
                QP.write(("raw", q_it), ("conv",))
                DOP.write(("raw", q_it), ("conv",))
                raw_full.arrive(1, q_it)
                if q_it >= 1:
                    yield wait("tma:r_empty", r_empty, q_it - 1)
                RQ.write(q_it, ALL)
                RDO.write(q_it, ALL)
                r_full.arrive(1, q_it)
                if st == 0:
                    if kv_it > 0:
                        yield wait("tma:kv_empty", kv_empty, kv_it - 1)
                    K.write(kv_it, ALL)
                    V.write(kv_it, C1)
                    kv_raw.arrive(1, kv_it)
                    kv_it += 1
                q_it += 1
                yield None

    def take_tile(who, i, warps):
        ts = i % 2
        yield wait(f"{'conv' if who == 'conv' else who[:2]}:tile_full", tile_full[ts], i // 2)
        ring[ts].start(who, i)
        ring[ts].end(who)
        tile_empty[ts].arrive(warps, i // 2)

    def converters():
        q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile("conv", i, 3)
            if steps is None:
                return
            for st in range(steps):
                yield wait("conv:raw_full", raw_full, q_it)
                for buf in (QP, DOP):
                    buf.start("conv", ("raw", q_it))
                yield None
                for buf in (QP, DOP):
                    buf.end("conv")
                QP.write(("split", q_it), C0)            # Sᵀ's B
                DOP.write(("split", q_it), C1)           # dPᵀ's B
                rows[q_it % 2].write(q_it, ALL)
                nat_full.arrive(1, q_it)
                q_it += 1

    def consumer(c, ws):
        me, n = role[c, ws[0]], len(ws)                # the role and the warps it acts for
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile(me, i, n)
            if steps is None:
                break
            if steps > 0:
                yield wait(f"{c}:kv_raw", kv_raw, kv_it)
            for st in range(steps):
                row = rows[q_it % 2]
                yield wait(f"{c}:nat_full", nat_full, q_it)
                # first product: c0 Sᵀ = K Qᵀ, c1 dPᵀ = V dOᵀ
                first = ((K, kv_it), (QP, ("split", q_it))) if c == "c0" else \
                    ((V, kv_it), (DOP, ("split", q_it)))
                for buf, tag in first:
                    buf.start(me, tag)
                yield None
                for buf, _ in first:
                    if buf is not K:
                        buf.end(me)
                nat_empty.arrive(n, q_it)
                if c == "c0":
                    row.start(me, q_it)                # lse for Pᵀ
                    yield None
                    row.end(me)
                    if q_it > 0:
                        yield wait("c0:pt_empty", pt_empty, q_it - 1)
                    for w in ws:
                        PT[w].write(q_it, ALL)
                    pt_full.arrive(n, q_it)
                    yield wg_sync(c, me)               # every c0 warp's Pᵀ rows, for dVᵀ_0
                else:
                    yield wait("c1:pt_full", pt_full, q_it)
                    for w in ws:                       # read back for dSᵀ (open until dVᵀ_1)
                        PT[w].start(me, q_it)
                    row.start(me, q_it)                # D for dSᵀ
                    yield None
                    row.end(me)
                    if q_it > 0:
                        yield nsync("c1:DS_EMPTY", me, n)
                    for w in ws:
                        DST[w].write(q_it, ALL)
                        DSN[w].write(q_it, ALL)
                    nbar["DS_FULL"].arrive(me, n)
                    yield wg_sync(c, me)               # every c1 warp's rows, for dKᵀ_1, dQᵀ_1
                yield wait(f"{c}:r_full", r_full, q_it)
                for buf in PT:
                    buf.start(me, q_it)                # dVᵀ_h's B: the whole Pᵀ
                RDO.start(me, q_it)                    # dVᵀ_h fragments
                yield None
                RDO.end(me)
                yield None                             # dVᵀ_h: Pᵀ
                for buf in PT:
                    buf.end(me)
                if c == "c1":
                    pt_empty.arrive(n, q_it)
                if c == "c0":
                    yield nsync("c0:DS_FULL", me, n)
                RQ.start(me, q_it)                     # dKᵀ_h fragments
                yield None
                RQ.end(me)
                r_empty.arrive(n, q_it)
                for buf in DST:
                    buf.start(me, q_it)
                yield None                             # dKᵀ_h: dSᵀ
                for buf in DST:
                    buf.end(me)
                if c == "c1":
                    V.end(me)
                K.start(me, kv_it)
                for buf in DSN:
                    buf.start(me, q_it)
                yield None                             # dQᵀ_h: Kᵀ_h loads, dS
                K.end(me)
                if st == steps - 1:
                    kv_empty.arrive(n, kv_it)
                yield None
                for buf in DSN:
                    buf.end(me)
                if c == "c0":
                    nbar["DS_EMPTY"].arrive(me, n)
                q_it += 1
            if steps > 0:
                kv_it += 1
        # pt_full / pt_empty's last phases complete with nobody waiting; DS_EMPTY's last
        # arrivals (c0's) are taken, so the named barrier ends with no generation open
        if q_it > 0 and c == "c1":
            yield nsync("c1:DS_EMPTY", me, n)

    roles = {"tma": tma(), "conv": converters()}
    for c in ("c0", "c1"):
        for ws in groups[c]:
            roles[role[c, ws[0]]] = consumer(c, ws)
    return roles, {**wg_bar, **nbar}


TILES = [[3], [1], [0, 2], [5, 0, 0, 1, 4], [2, 3, 1], [1, 1, 1, 1, 1, 1], [0], [7, 2]]


def run_clean(protocol, tiles, seeds=60, drop=None):
    """Run ``protocol(tiles, drop=drop)`` under ``seeds`` interleavings (odd seeds skewed); Hazard
    on any broken rule or on a named barrier whose last generation stayed open."""
    for seed in range(seeds):
        roles, nb = protocol(tiles, drop=drop)
        run(roles, seed, skew=seed % 2 == 1)
        for bar in nb.values():
            if bar.cur:
                raise Hazard(f"{bar.name} left open by {sorted(bar.cur)}")


def expect_hazard(protocol, drop, seeds=300, tile_sets=([4, 3, 5, 2], [4, 0, 0, 3, 0, 0, 5])):
    """``protocol`` without the wait ``drop`` breaks a rule under some interleaving."""
    with pytest.raises(Hazard):
        for seed in range(seeds):
            for tiles in tile_sets:
                roles, nb = protocol(tiles, drop=drop)
                run(roles, seed, skew=seed % 2 == 1)   # c1:r_full: with a slow TMA thread
                for bar in nb.values():
                    if bar.cur:
                        raise Hazard(f"{bar.name} left open")


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "tiles" + "-".join(map(str, t)))
def test_protocol_has_no_hazard(tiles):
    run_clean(protocol, tiles)


WAITS = ["tma:nat_empty", "tma:r_empty", "tma:kv_empty", "tma:tile_empty", "conv:raw_full",
         "c0:nat_full", "c1:nat_full", "c0:kv_raw", "c1:kv_raw", "c0:r_full", "c1:r_full",
         "c0:pt_empty", "c1:pt_full", "c1:DS_EMPTY", "c0:DS_FULL", "c0:WG_BAR", "c1:WG_BAR"]


@pytest.mark.parametrize("drop", WAITS)
def test_the_model_catches_a_missing_wait(drop):
    """Each of these waits is needed: without it some interleaving breaks a rule."""
    expect_hazard(protocol, drop)
