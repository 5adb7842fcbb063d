"""The synchronization of the float32 Hopper backward's hd 128 path (design T in
kernels_cu/hopper/bwd_f32.cu) as a discrete model, run under many random interleavings on the
CPU, with tests/models/test_sm90_f32_bwd_protocol.py's machinery (mbarriers, tagged buffers, deadlock /
parity-alias / overwrite checks) plus the named barriers of the consumers' handoffs (PT_FULL,
DS_FULL, PT_EMPTY, DS_EMPTY: one side bar.arrive, the other bar.sync, 256 threads = both
warpgroups). A named barrier fails the model when one party arrives twice in one generation
(the hardware would then complete it without the other side) or when a generation is left open
at the end. Q, dO land twice per step (in the big halves of their parts, split in place; and as
raw copies for the transposed products' fragments); K and V raw (read by the consumers only).
A protocol with one wait removed must fail.

The model follows the kernel's text by hand: change both together.
"""
from __future__ import annotations

import pytest

from test_sm90_f32_bwd_protocol import Buf, Hazard, MBar, W, publish_tile, run, take_tile


class NBar:
    """A named barrier over two parties (c0's and c1's 128 threads)."""

    def __init__(self, name):
        self.name, self.cur, self.done = name, set(), 0

    def arrive(self, who):
        if who in self.cur:
            raise Hazard(f"{self.name}: {who} arrives twice in generation {self.done}")
        self.cur.add(who)
        gen = self.done
        if len(self.cur) == 2:
            self.cur, self.done = set(), self.done + 1
        return gen


def protocol(tiles, drop=None):
    """Role generators for work tiles with ``tiles`` steps each (0 allowed). Per step, Q and dO
    land twice: raw in the big halves of their parts (raw_full), split there in place by the
    converters (nat_full) and read by the first products (Sᵀ: Q parts, c0; dPᵀ: dO parts, c1;
    nat_empty frees them for the next step's landing), and raw in the copies (r_full) that the
    dVᵀ_h / dKᵀ_h fragment loads read (r_empty). Rows (lse, D) in two buffers by step parity."""
    B = MBar
    tile_full = [B("tile_full0", 1), B("tile_full1", 1)]
    tile_empty = [B("tile_empty0", 8 + 3), B("tile_empty1", 8 + 3)]
    kv_raw, kv_empty = B("kv_raw", 1), B("kv_empty", 8)
    raw_full, r_full, r_empty = B("raw_full", 1), B("r_full", 1), B("r_empty", 8)
    nat_full, nat_empty = B("nat_full", 1), B("nat_empty", 8)
    nb = {n: NBar(n) for n in ("PT_FULL", "DS_FULL", "PT_EMPTY", "DS_EMPTY")}
    ring = [Buf("tile_smem0"), Buf("tile_smem1")]
    QP, DOP = Buf("q_parts"), Buf("do_parts")       # big halves: TMA raw, then split in place
    RQ, RDO = Buf("q_raw_copy"), Buf("do_raw_copy")
    K, V = Buf("k_raw"), Buf("v_raw")
    rows = [Buf("rows0"), Buf("rows1")]
    PT, DST, DSN = Buf("pT"), Buf("dsT"), Buf("ds")
    seq = list(tiles) + [None]

    def wait(name, bar, phase):
        return None if drop == name else W(bar, phase)

    def nsync(name, who):
        """bar.sync: arrive, then wait for the generation to complete."""
        if drop == name:
            return None
        bar = nb[name[name.index(":") + 1:]]
        return W(bar, bar.arrive(who))

    def tma():
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            yield from publish_tile(i, ring, tile_full, tile_empty, wait)
            if steps is None:
                return
            for st in range(steps):
                if q_it >= 1:
                    yield wait("tma:nat_empty", nat_empty, q_it - 1)
                QP.write(("raw", q_it), ("conv",))
                DOP.write(("raw", q_it), ("conv",))
                raw_full.arrive()
                if q_it >= 1:
                    yield wait("tma:r_empty", r_empty, q_it - 1)
                RQ.write(q_it, ("c0", "c1"))
                RDO.write(q_it, ("c0", "c1"))
                r_full.arrive()
                if st == 0:
                    if kv_it > 0:
                        yield wait("tma:kv_empty", kv_empty, kv_it - 1)
                    K.write(kv_it, ("c0", "c1"))
                    V.write(kv_it, ("c1",))
                    kv_raw.arrive()
                    kv_it += 1
                q_it += 1
                yield None

    def converters():
        q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile("conv", i, 3, ring, tile_full, tile_empty, wait)
            if steps is None:
                return
            for st in range(steps):
                yield wait("conv:raw_full", raw_full, q_it)
                for buf in (QP, DOP):
                    buf.start("conv", ("raw", q_it))
                yield None
                for buf in (QP, DOP):
                    buf.end("conv")
                QP.write(("split", q_it), ("c0",))          # Sᵀ's B
                DOP.write(("split", q_it), ("c1",))         # dPᵀ's B
                rows[q_it % 2].write(q_it, ("c0", "c1"))
                nat_full.arrive()
                q_it += 1

    def consumer(c):
        kv_it = q_it = 0
        for i, steps in enumerate(seq):
            yield from take_tile(c, i, 4, ring, tile_full, tile_empty, wait)
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
                    buf.start(c, tag)
                yield None
                for buf, _ in first:
                    if buf is not K:
                        buf.end(c)
                nat_empty.arrive(4)                    # its four warps
                if c == "c0":
                    row.start(c, q_it)                 # lse for Pᵀ
                    yield None
                    row.end(c)
                    if q_it > 0:
                        yield nsync("c0:PT_EMPTY", c)
                    PT.write(q_it, ("c0", "c1"))
                    nb["PT_FULL"].arrive(c)
                else:
                    yield nsync("c1:PT_FULL", c)
                    PT.start(c, q_it)                  # read back for dSᵀ (open until dVᵀ_1)
                    row.start(c, q_it)                 # D for dSᵀ
                    yield None
                    row.end(c)
                    if q_it > 0:
                        yield nsync("c1:DS_EMPTY", c)
                    DST.write(q_it, ("c0", "c1"))
                    DSN.write(q_it, ("c0", "c1"))
                    nb["DS_FULL"].arrive(c)
                yield wait(f"{c}:r_full", r_full, q_it)
                if c == "c0":
                    PT.start(c, q_it)
                RDO.start(c, q_it)                     # dVᵀ_h fragments
                yield None
                RDO.end(c)
                yield None                             # dVᵀ_h: Pᵀ
                PT.end(c)
                if c == "c1":
                    nb["PT_EMPTY"].arrive(c)
                else:
                    yield nsync("c0:DS_FULL", c)
                RQ.start(c, q_it)                      # dKᵀ_h fragments
                yield None
                RQ.end(c)
                r_empty.arrive(4)
                DST.start(c, q_it)
                yield None                             # dKᵀ_h: dSᵀ
                DST.end(c)
                if c == "c1":
                    V.end(c)
                K.start(c, kv_it)
                DSN.start(c, q_it)
                yield None                             # dQᵀ_h: Kᵀ_h loads, dS
                K.end(c)
                if st == steps - 1:
                    kv_empty.arrive(4)
                yield None
                DSN.end(c)
                if c == "c0":
                    nb["DS_EMPTY"].arrive(c)
                q_it += 1
            if steps > 0:
                kv_it += 1
        if q_it > 0:
            yield nsync(f"{c}:{'PT_EMPTY' if c == 'c0' else 'DS_EMPTY'}", c)

    return {"tma": tma(), "conv": converters(), "c0": consumer("c0"), "c1": consumer("c1")}, nb


TILES = [[3], [1], [0, 2], [5, 0, 0, 1, 4], [2, 3, 1], [1, 1, 1, 1, 1, 1], [0], [7, 2]]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "tiles" + "-".join(map(str, t)))
def test_protocol_has_no_hazard(tiles):
    for seed in range(60):
        roles, nb = protocol(tiles)
        run(roles, seed)
        for bar in nb.values():   # every named barrier's last generation completed
            assert not bar.cur, (bar.name, bar.cur)


WAITS = ["tma:nat_empty", "tma:r_empty", "tma:kv_empty", "tma:tile_empty", "conv:raw_full",
         "c0:nat_full", "c1:nat_full", "c0:kv_raw", "c1:kv_raw", "c0:r_full", "c1:r_full",
         "c0:PT_EMPTY", "c1:PT_FULL", "c1:DS_EMPTY", "c0:DS_FULL"]


@pytest.mark.parametrize("drop", WAITS)
def test_the_model_catches_a_missing_wait(drop):
    """Each of these waits is needed: without it some interleaving breaks a rule."""
    with pytest.raises(Hazard):
        for seed in range(300):
            for tiles in ([4, 3, 5, 2], [4, 0, 0, 3, 0, 0, 5]):
                roles, nb = protocol(tiles, drop=drop)
                run(roles, seed)
                for bar in nb.values():
                    if bar.cur:
                        raise Hazard(f"{bar.name} left open")
