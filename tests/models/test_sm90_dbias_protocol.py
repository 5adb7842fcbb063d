"""A discrete model of the Hopper dbias kernel's synchronization (kernels_cu/hopper/dbias.cu), run
under many random interleavings on the CPU with the machinery of test_sm90_f32_bwd_protocol.py:
the TMA thread and the two consumers as generators that wait on and arrive at mbarriers where
the kernel does and read / write tagged shared-memory buffers (the half-stage ring, the bias
buffers, the tile-index ring). Fails on a deadlock, an aliasing parity wait, a read of the wrong
contents, or an overwrite before every reader has read. Dropping any one wait must fail.

The model follows the kernel's text by hand: change both together.
"""
from __future__ import annotations

import pytest

from cupyflash.gpu import plan_dbias_sm90
from test_sm90_f32_bwd_protocol import Buf, Hazard, MBar, W, produce, run, take_tile

CONSUMERS = ("c0", "c1")


def protocol(tiles, stages, biasbuf, drop=None):
    """Roles for work tiles of ``tiles`` pairs each (0: a tile outside the window band)."""
    tile_full = [MBar(f"tile_full{s}", 1) for s in range(2)]
    tile_empty = [MBar(f"tile_empty{s}", 8) for s in range(2)]          # 8 consumer warps
    ring_full = [MBar(f"ring_full{s}", 1) for s in range(stages)]
    ring_empty = [MBar(f"ring_empty{s}", 2) for s in range(stages)]     # one per consumer
    bias_full = [MBar(f"bias_full{b}", 1) for b in range(biasbuf)]
    bias_empty = [MBar(f"bias_empty{b}", 8) for b in range(biasbuf)]    # 8 consumer warps
    tile_smem = [Buf(f"tile_smem{s}") for s in range(2)]
    ring = [Buf(f"half{s}") for s in range(stages)]
    bias = [Buf(f"bias{b}") for b in range(biasbuf)]
    seq = list(tiles) + [None]

    def wait(name, bar, phase):
        return None if drop == name else W(bar, phase)

    def tma():
        half_it = bias_it = 0
        for i, pairs in enumerate(seq):
            yield from produce("tile", i, tile_smem, tile_full, tile_empty, wait, CONSUMERS)
            if pairs is None:
                return
            for it in range(pairs):
                for _ in range(2):                       # half A (Q, K), then half B (dO, V)
                    yield from produce("ring", half_it, ring, ring_full, ring_empty, wait, CONSUMERS)
                    half_it += 1
                if it == 0:                              # the tile's bias, after pair 0's halves
                    yield from produce("bias", bias_it, bias, bias_full, bias_empty, wait, CONSUMERS)
                    bias_it += 1
                yield None

    def consumer(c):
        half_it = bias_it = 0
        for i, pairs in enumerate(seq):
            yield from take_tile(c, i, 4, tile_smem, tile_full, tile_empty, wait)   # 4 warps
            if pairs is None:
                return
            bb = bias_it % biasbuf
            for it in range(pairs):
                sa, sb = half_it % stages, (half_it + 1) % stages
                yield wait(f"{c}:ring_full_a", ring_full[sa], half_it // stages)
                ring[sa].start(c, half_it)               # S = Q Kᵀ in flight
                yield wait(f"{c}:ring_full_b", ring_full[sb], (half_it + 1) // stages)
                ring[sb].start(c, half_it + 1)           # dP = dO Vᵀ in flight
                if it == 0:
                    yield wait(f"{c}:bias_full", bias_full[bb], bias_it // biasbuf)
                yield None
                ring[sa].end(c)                          # wgmma_wait<1>: S done
                ring_empty[sa].arrive()
                bias[bb].start(c, bias_it)               # P reads the bias tile
                yield None
                bias[bb].end(c)
                if it == pairs - 1:
                    bias_empty[bb].arrive(4)             # each warp, after its last read
                ring[sb].end(c)                          # wgmma_wait<0>: dP done
                ring_empty[sb].arrive()
                half_it += 2
            if pairs > 0:
                bias_it += 1

    return {"tma": tma(), "c0": consumer("c0"), "c1": consumer("c1")}


TILES = [[1], [3], [0, 2], [2, 0, 0, 1, 4], [1, 1, 1, 1, 1, 1], [16, 2, 16], [0]]


@pytest.mark.parametrize("stages, biasbuf", sorted(set(plan_dbias_sm90.BUFFERS.values())))
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "tiles" + "-".join(map(str, t)))
def test_protocol_has_no_hazard(tiles, stages, biasbuf):
    for seed in range(40):
        run(protocol(tiles, stages, biasbuf), seed)


WAITS = ["tma:tile_empty", "tma:ring_empty", "tma:bias_empty", "c0:tile_full", "c1:ring_full_a",
         "c0:ring_full_b", "c1:bias_full"]


@pytest.mark.parametrize("drop", WAITS)
def test_the_model_catches_a_missing_wait(drop):
    """Each of these waits is needed: without it some interleaving breaks a rule."""
    with pytest.raises(Hazard):
        for seed in range(300):
            for stages, biasbuf in sorted(set(plan_dbias_sm90.BUFFERS.values())):
                for tiles in ([3, 2, 4, 1], [2, 0, 0, 3, 0, 1, 2]):
                    run(protocol(tiles, stages, biasbuf, drop=drop), seed)
