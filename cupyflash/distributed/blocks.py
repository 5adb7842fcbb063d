"""Which attention calls one (query shard, key/value shard) pair needs, with exact masks.

Pure Python, no arrays. The global mask is a band: with ``d = j - i`` (key position minus query
position, query positions already shifted for bottom-right alignment), key j is kept for query i
when ``lo <= d <= hi``; ``lo = -left`` and ``hi = right`` of the window (causal: ``hi = 0``),
``±inf`` for an unbounded side.

A shard is a list of runs (global position, local index, length). For each pair of runs
(query run, key run) the kept entries are trimmed to their bounding box: rows outside it see no key
of the run, keys outside it are seen by no row. In that box the bottom-right corner is always
kept, which is exactly what makes the band expressible as ``attention``'s bottom-right aligned
``window`` with sides >= 0 (the box's diagonal ends at its bottom-right corner; left side =
corner offset - lo, right side = hi - corner offset). Boxes are then merged, while the band on the
merged box gives each part its own mask and masks everything in the box that is in no part, so a
rank runs few and large calls (zigzag causal: one or two calls per step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

INF = math.inf


@dataclass(frozen=True)
class Block:
    """Rows q0:q1 of the local queries against rows k0:k1 of the key/value shard, keeping
    ``lo <= j - i <= hi`` in local indices (±inf: unbounded)."""

    q0: int
    q1: int
    k0: int
    k1: int
    lo: float
    hi: float

    @property
    def dmin(self):
        return self.k0 - (self.q1 - 1)

    @property
    def dmax(self):
        return (self.k1 - 1) - self.q0

    def normalized(self) -> "Block":
        """A side that cuts nothing inside the box becomes unbounded."""
        lo = -INF if self.lo <= self.dmin else self.lo
        hi = INF if self.hi >= self.dmax else self.hi
        return Block(self.q0, self.q1, self.k0, self.k1, lo, hi)

    def expressible(self) -> bool:
        corner = self.k1 - self.q1          # d of the bottom-right entry
        return self.lo <= corner <= self.hi

    def attention_options(self) -> dict:
        """``causal`` and ``window`` for ``attention`` on this box (bottom-right aligned)."""
        lq, lk = self.q1 - self.q0, self.k1 - self.k0
        base = lk - lq                        # d' of the box's diagonal, in box coordinates
        shift = self.q0 - self.k0             # local d -> box d'
        left = -1 if self.lo == -INF else int(base - (self.lo + shift))
        right = -1 if self.hi == INF else int((self.hi + shift) - base)
        if (self.lo != -INF and left < 0) or (self.hi != INF and right < 0):
            raise AssertionError(f"block {self} is not expressible as a bottom-right window")
        if left == -1 and right == -1:
            return {"causal": False, "window": None}
        if left == -1 and right == 0:
            return {"causal": True, "window": None}
        return {"causal": False, "window": (left, right)}


def band(causal: bool, window) -> Tuple[float, float]:
    """(lo, hi) of the global band from ``causal`` and ``window`` (None / -1: unbounded)."""
    left = right = INF
    if window is not None:
        l, r = window
        left = INF if l is None or l < 0 else int(l)
        right = INF if r is None or r < 0 else int(r)
    if causal:
        right = 0
    return -left, right


def pair_block(qrun, krun, lo, hi) -> Optional[Block]:
    """The trimmed box of one (query run, key run) pair, or None where all of it is masked."""
    qpos, qloc, qlen = qrun
    kpos, kloc, klen = krun
    if qlen == 0 or klen == 0:
        return None
    i0 = max(qpos, kpos - hi)
    i1 = min(qpos + qlen - 1, kpos + klen - 1 - lo)
    j0 = max(kpos, qpos + lo)
    j1 = min(kpos + klen - 1, qpos + qlen - 1 + hi)
    if i0 > i1 or j0 > j1:
        return None
    off = (qpos - qloc) - (kpos - kloc)
    blk = Block(int(i0 - qpos + qloc), int(i1 - qpos + qloc + 1),
                int(j0 - kpos + kloc), int(j1 - kpos + kloc + 1), lo + off, hi + off)
    blk = blk.normalized()
    assert blk.expressible(), blk
    return blk


def _masked(q0, q1, k0, k1, lo, hi) -> bool:
    """Every entry of the box [q0, q1) x [k0, k1) lies outside lo <= d <= hi."""
    return (k1 - 1) - q0 < lo or k0 - (q1 - 1) > hi


def merge(a: Block, b: Block) -> Optional[Block]:
    """One box for both, or None where no single band reproduces both masks on their bounding
    box (or the parts overlap, or the result is not expressible)."""
    def side(va, vb, unbounded):
        finite = {x for x in (va, vb) if x != unbounded}
        if len(finite) > 1:
            return None
        return finite.pop() if finite else unbounded

    lo = side(a.lo, b.lo, -INF)
    hi = side(a.hi, b.hi, INF)
    if lo is None or hi is None:
        return None
    for x in (a, b):
        if x.lo == -INF and lo > x.dmin:
            return None
        if x.hi == INF and hi < x.dmax:
            return None
    q0, q1 = min(a.q0, b.q0), max(a.q1, b.q1)
    k0, k1 = min(a.k0, b.k0), max(a.k1, b.k1)
    qs = sorted({q0, q1, a.q0, a.q1, b.q0, b.q1})
    ks = sorted({k0, k1, a.k0, a.k1, b.k0, b.k1})
    for c0, c1 in zip(qs, qs[1:]):
        for e0, e1 in zip(ks, ks[1:]):
            in_a = a.q0 <= c0 and c1 <= a.q1 and a.k0 <= e0 and e1 <= a.k1
            in_b = b.q0 <= c0 and c1 <= b.q1 and b.k0 <= e0 and e1 <= b.k1
            if in_a and in_b:
                return None
            if not in_a and not in_b and not _masked(c0, c1, e0, e1, lo, hi):
                return None
    m = Block(q0, q1, k0, k1, lo, hi).normalized()
    return m if m.expressible() else None


def plan_pair(qruns: Sequence[tuple], kruns: Sequence[tuple], lo, hi) -> List[Block]:
    """The calls for one query shard against one key/value shard, merged, in a fixed order."""
    blocks = [b for qr in qruns for kr in kruns if (b := pair_block(qr, kr, lo, hi)) is not None]
    changed = True
    while changed:
        changed = False
        for i in range(len(blocks)):
            for j in range(i + 1, len(blocks)):
                m = merge(blocks[i], blocks[j])
                if m is not None:
                    blocks = [x for n, x in enumerate(blocks) if n not in (i, j)] + [m]
                    changed = True
                    break
            if changed:
                break
    return sorted(blocks, key=lambda b: (b.q0, b.k0))


def plan_rank(rank: int, qsegs, ksegs, lo, hi) -> List[List[Block]]:
    """Per ring step t (the key/value shard of rank ``(rank - t) % world``), the calls of
    ``rank``."""
    world = len(qsegs)
    return [plan_pair(qsegs[rank], ksegs[(rank - t) % world], lo, hi) for t in range(world)]
