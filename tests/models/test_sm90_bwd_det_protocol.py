"""A model of the deterministic Hopper backward's dQ ordering across blocks (kernels_cu/hopper/bwd.cu,
DET = true), run under many random interleavings on the CPU: persistent blocks draw work tiles
from the counter, numbered as the kernel numbers them (plan_bwd_sm90.det_work_tile: (kv head,
batch) pairs in groups, key-tile-major, key tiles ascending or descending), at most two ahead
(the tile ring), and run each tile's steps in the DET order (plan_bwd_sm90.steps); each step's
dQ addition waits until its tile's semaphore equals the key tile's rank (plan_bwd_sm90.dq_rank),
then adds and releases rank + 1. Only ``resident`` blocks run at once, the others start as those
exit (another kernel holds the rest of the GPU), in a random order.

Checks: no deadlock with the counter's draws whatever the residency, order and group size; every
dQ tile receives its additions in key-tile order (the bits do not depend on the schedule); the
static draw (block i's k-th tile i + k · grid, what the kernel does without a counter and
therefore refuses in DET) can deadlock when a block is not resident; ranks without the band's
first key tile (n instead of n − n_lo) deadlock a window.
"""
from __future__ import annotations

import random

import pytest

from cupyflash.gpu import plan_bwd, plan_bwd_sm90 as P


class Deadlock(Exception):
    pass


def work_tiles(b, h_k, group, s_q, s_k, wl=-1, wr=-1, bottom_right=True, rank=None,
               descending=False, pairs_per_group=1, bn=P.BN):
    """Work tiles in index order: each a list of (dQ tile key, rank) per step, DET order; ``bn``
    keys per work tile (64: head dim 256, whose two consumers order their column halves of a dQ
    tile on separate semaphores, each as this model's one)."""
    window = wl >= 0 or wr >= 0
    unb = s_q + s_k
    wl_p, wr_p = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    diag = s_k - s_q if bottom_right else 0
    rank = rank or (lambda n, m: P.dq_rank(n, m, diag, wl_p, window, descending=descending,
                                           s_q=s_q, s_k=s_k, window_right=wr_p, bn=bn))
    num_n, pairs = -(-s_k // bn), h_k * b
    sched = 2 * pairs_per_group + descending
    tiles = []
    for w in range(num_n * pairs):
        n, q = P.det_work_tile(w, num_n, pairs, sched)
        kv, bb = q % h_k, q // h_k
        r = plan_bwd.query_tiles(n, bn, P.BM, s_q, s_k, wl_p, wr_p, diag, window)
        st = P.steps(r.start, len(r), kv, group, True, descending) if len(r) else []
        tiles.append([((bb, hd, m), rank(n, m)) for hd, m in st])
    return tiles


def addition_order(tiles, descending):
    """{dQ tile: work tile indices in the order the semaphores let them add}."""
    want = {}
    for w, steps in enumerate(tiles):
        for key, r in steps:
            want.setdefault(key, {})[r] = w
    return {key: [ws[r] for r in range(len(ws))] for key, ws in want.items()}


def simulate(tiles, grid, resident, rnd, dynamic=True, order=None, ring=2):
    """Runs the model; returns {dQ tile: [work tile indices in the order they added]}. Raises
    Deadlock when nothing can move while work is left."""
    order = list(order) if order is not None else rnd.sample(range(grid), grid)   # start order
    running, waiting = order[:resident], order[resident:]
    queue = {blk: [] for blk in range(grid)}      # drawn tiles: [w, next step]
    drawn = {blk: 0 for blk in range(grid)}       # static draws made
    done = {blk: False for blk in range(grid)}    # drew past the end
    counter = 0
    sem, log = {}, {}
    while running:
        moves = []
        for blk in running:
            if not done[blk] and len(queue[blk]) < ring:
                moves.append(("draw", blk))
            if queue[blk]:
                w, i = queue[blk][0]
                if i == len(tiles[w]):
                    moves.append(("finish", blk))
                else:
                    key, r = tiles[w][i]
                    if sem.get(key, 0) == r:
                        moves.append(("add", blk))
            elif done[blk]:
                moves.append(("exit", blk))
        if not moves:
            raise Deadlock(f"blocks {running} stuck; queues {[queue[x] for x in running]}")
        kind, blk = rnd.choice(moves)
        if kind == "draw":
            if dynamic:
                w, counter = counter, counter + 1
            else:
                w = blk + drawn[blk] * grid
                drawn[blk] += 1
            if w >= len(tiles):
                done[blk] = True
            else:
                queue[blk].append([w, 0])
        elif kind == "add":
            w, i = queue[blk][0]
            key, r = tiles[w][i]
            sem[key] = r + 1
            log.setdefault(key, []).append(w)
            queue[blk][0][1] += 1
        elif kind == "finish":
            queue[blk].pop(0)
        else:   # exit: a waiting block becomes resident
            running.remove(blk)
            if waiting:
                running.append(waiting.pop(0))
    assert all(not q for q in queue.values())
    return log


SHAPES = {
    "plain": dict(b=2, h_k=2, group=1, s_q=300, s_k=700),
    "causal": dict(b=1, h_k=2, group=2, s_q=700, s_k=700, wr=0),
    "causal_sq_gt_sk": dict(b=2, h_k=1, group=1, s_q=900, s_k=400, wr=0),
    "causal_top_left": dict(b=1, h_k=1, group=3, s_q=500, s_k=800, wr=0, bottom_right=False),
    "window": dict(b=1, h_k=2, group=1, s_q=900, s_k=900, wl=150, wr=40),
    "mqa": dict(b=1, h_k=1, group=4, s_q=257, s_k=1100),
}


@pytest.mark.parametrize("bn", [128, 64], ids=["bn128", "bn64_d256"])
@pytest.mark.parametrize("order", [(False, 1), (True, 1), (True, 3), (False, 4), (True, 64)],
                         ids=["asc_g1", "desc_g1", "desc_g3", "asc_g4", "desc_g64"])
@pytest.mark.parametrize("resident", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_counter_draws_never_deadlock_and_fix_the_order(shape, resident, order, bn):
    descending, g = order
    tiles = work_tiles(**SHAPES[shape], descending=descending, pairs_per_group=g, bn=bn)
    want = addition_order(tiles, descending)
    for key, ws in want.items():   # the addition order is the key-tile order, either way
        ns = [P.det_work_tile(w, -(-SHAPES[shape]["s_k"] // bn),
                              SHAPES[shape]["h_k"] * SHAPES[shape]["b"],
                              2 * g + descending)[0] for w in ws]
        assert ns == sorted(ns, reverse=descending), (key, ns)
    for seed in range(8):
        rnd = random.Random(seed * 31 + resident)
        grid = min(16, len(tiles))
        log = simulate(tiles, grid, min(resident, grid), rnd)
        assert log == want   # each dQ tile: its key tiles in the addition order


def test_static_draws_can_deadlock():
    """Without the counter, block 1 holds key tile 1 while block 0, holding tile 0, is not
    resident: tile 1 waits for tile 0 forever (the kernel traps instead: DET && !p.sched)."""
    tiles = work_tiles(b=1, h_k=1, group=1, s_q=64, s_k=256)
    assert len(tiles) == 2
    with pytest.raises(Deadlock):
        simulate(tiles, 2, 1, random.Random(0), dynamic=False, order=[1, 0])
    simulate(tiles, 2, 1, random.Random(0), dynamic=True, order=[1, 0])


def test_ranks_must_skip_the_tiles_before_the_band():
    """With a window, the first key tile that sees a query tile may be n_lo > 0: a rank of n
    (not n − n_lo) waits for additions that never come."""
    shape = dict(b=1, h_k=1, group=1, s_q=600, s_k=600, wl=64, wr=0)
    simulate(work_tiles(**shape), 4, 4, random.Random(1))
    with pytest.raises(Deadlock):
        simulate(work_tiles(**shape, rank=lambda n, m: n), 4, 4, random.Random(1))
