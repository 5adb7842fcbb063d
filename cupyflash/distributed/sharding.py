"""Splitting a sequence across ranks, and which global positions each rank's shard holds.

Two schemes:

- ``"contiguous"``: rank r holds one run of positions. With a length that ``world`` does not
  divide, the first ``length % world`` ranks hold one position more (``numpy.array_split``).
- ``"zigzag"``: the sequence is cut into ``2 * world`` equal chunks and rank r holds chunks r and
  ``2 * world - 1 - r``, one after the other. Under a causal mask every rank then does the same
  work (an early chunk, which sees little, paired with a late one, which sees much). The length
  must be a multiple of ``2 * world``.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

SCHEMES = ("contiguous", "zigzag")


def check_scheme(scheme) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: got {scheme!r}; accepted: 'contiguous' or 'zigzag'")
    return scheme


def _check_world(world, rank=None):
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"world: got {world!r}; accepted: an int >= 1")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, np.integer))
                             or not 0 <= rank < world):
        raise ValueError(f"rank: got {rank!r}; accepted: an int in 0..{world - 1}")


def shard_lengths(length: int, world: int, scheme: str = "contiguous") -> List[int]:
    """Each rank's shard length for a sequence of ``length`` positions."""
    _check_world(world)
    check_scheme(scheme)
    if scheme == "zigzag":
        if length % (2 * world):
            raise ValueError(
                f"zigzag sharding: sequence length {length} is not a multiple of 2 * world = "
                f"{2 * world}; accepted: a multiple of 2 * world (pad the sequence, or use "
                f"scheme='contiguous', which allows uneven shards)")
        return [length // world] * world
    base, extra = divmod(length, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def _chunks(length: int, rank: int, world: int, scheme: str) -> List[Tuple[int, int]]:
    """The (start, stop) global ranges rank ``rank`` holds, in local order."""
    if scheme == "zigzag":
        c = shard_lengths(length, world, scheme)[0] // 2
        return [(rank * c, (rank + 1) * c), ((2 * world - 1 - rank) * c, (2 * world - rank) * c)]
    lens = shard_lengths(length, world, scheme)
    start = sum(lens[:rank])
    return [(start, start + lens[rank])]


def _xp(x):
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy
    return np


def shard(x, rank: int, world: int, axis: int = 1, scheme: str = "contiguous"):
    """Rank ``rank``'s shard of ``x`` along ``axis`` (the sequence axis: 1 for "bshd" q/k/v,
    2 for "bhsd" and for lse (batch, heads, seqlen)).

    contiguous: a view; zigzag: a new array holding chunk ``rank`` then chunk
    ``2 * world - 1 - rank``."""
    _check_world(world, rank)
    check_scheme(scheme)
    axis = axis % x.ndim
    ranges = _chunks(x.shape[axis], rank, world, scheme)
    idx = [slice(None)] * x.ndim
    parts = []
    for a, b in ranges:
        idx[axis] = slice(a, b)
        parts.append(x[tuple(idx)])
    if len(parts) == 1:
        return parts[0]
    return _xp(x).concatenate(parts, axis=axis)


def unshard(shards: Sequence, world: int = None, axis: int = 1, scheme: str = "contiguous"):
    """The whole array back from the per-rank shards (rank order), the inverse of ``shard``."""
    shards = list(shards)
    if world is None:
        world = len(shards)
    _check_world(world)
    check_scheme(scheme)
    if len(shards) != world:
        raise ValueError(f"shards: got {len(shards)} arrays; accepted: one per rank ({world})")
    xp = _xp(shards[0])
    axis = axis % shards[0].ndim
    if scheme == "contiguous":
        return xp.concatenate(shards, axis=axis)
    n = shards[0].shape[axis]
    if any(s.shape[axis] != n for s in shards) or n % 2:
        raise ValueError("shards: zigzag shards must all have the same even length along axis "
                         f"{axis}; got {[s.shape[axis] for s in shards]}")
    c = n // 2
    idx = [slice(None)] * shards[0].ndim
    first, second = [], []
    for s in shards:
        idx[axis] = slice(0, c)
        first.append(s[tuple(idx)])
        idx[axis] = slice(c, n)
        second.append(s[tuple(idx)])
    return xp.concatenate(first + second[::-1], axis=axis)


def segments(lengths: Sequence[int], scheme: str, shift: int = 0) -> List[List[Tuple[int, int, int]]]:
    """Per rank, its shard as (global position, local index, length) runs, in local order.

    ``lengths`` are the per-rank shard lengths (zigzag: all equal and even); ``shift`` is added to
    every global position (the bottom-right alignment of queries against keys)."""
    world = len(lengths)
    if scheme == "zigzag":
        n = lengths[0]
        if any(x != n for x in lengths) or n % 2:
            raise ValueError(
                f"zigzag sharding needs every rank to hold two equal chunks (the same even shard "
                f"length on every rank); got shard lengths {list(lengths)}. Use shard(x, rank, "
                f"world, scheme='zigzag') on a sequence whose length is a multiple of 2 * world, "
                f"or scheme='contiguous' for uneven shards")
        c = n // 2
        return [[(r * c + shift, 0, c), ((2 * world - 1 - r) * c + shift, c, c)]
                for r in range(world)]
    out, start = [], 0
    for n in lengths:
        out.append([(start + shift, 0, n)])
        start += n
    return out
