"""``python -m cupyflash bench`` on the CPU: cupyflash's CPU implementation beside textbook NumPy.

Textbook NumPy is attention as usually written: scores = scale · Q Kᵀ materialized as
[b, h, s_q, s_k] in the compute dtype, softmax, P V (and its backward from the stored P). Time:
wall clock, median of the repeats after one warm-up; memory: tracemalloc's peak of one more call
(NumPy reports its allocations to tracemalloc), inputs excluded.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass
from typing import Callable, List

import numpy as np

#: Defaults on the CPU (the GPU sweep's sizes would take minutes and GiB per textbook call).
DEFAULTS = {"dtype": ["fp32"], "head_dim": [64], "seqlen": [1024, 4096], "causal": [False],
            "direction": ["fwd"], "rep": 3, "batch": 1, "heads": 8, "kv_heads": None}


def _heads(x, h):
    """k or v (bshd) with each key / value head repeated for its h / h_k query heads (GQA)."""
    return x if x.shape[2] == h else np.repeat(x, h // x.shape[2], axis=2)


def _group_sum(g, h_k):
    """A [b, s, h, d] gradient summed over the query heads of each of the h_k groups."""
    b, s, h, d = g.shape
    return g if h == h_k else g.reshape(b, s, h_k, h // h_k, d).sum(axis=3)


def _textbook_probs(q, k, causal):
    k = _heads(k, q.shape[2])
    qt, kt = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    s = np.matmul(qt, kt.swapaxes(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        sq, sk = s.shape[-2:]
        s[..., np.triu(np.ones((sq, sk), bool), sk - sq + 1)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def textbook_forward(q, k, v, causal=False):
    """softmax(scale · Q Kᵀ) V with the full score matrix (bshd in and out; k, v may have fewer
    heads: GQA / MQA, repeated)."""
    p = _textbook_probs(q, k, causal)
    return np.matmul(p, _heads(v, q.shape[2]).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def textbook_backward(dout, q, k, v, causal=False):
    """dq, dk, dv of :func:`textbook_forward` through the stored P (bshd; dk, dv summed over
    each key / value head's query heads)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    h_k = k.shape[2]
    p = _textbook_probs(q, k, causal)
    k, v = _heads(k, q.shape[2]), _heads(v, q.shape[2])
    qt, kt, vt, dot = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    dv = np.matmul(p.swapaxes(-1, -2), dot)
    dp = np.matmul(dot, vt.swapaxes(-1, -2))
    dp -= (dp * p).sum(axis=-1, keepdims=True)
    dp *= p
    dq = np.matmul(dp, kt) * scale
    dk = np.matmul(dp.swapaxes(-1, -2), qt) * scale
    dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    return dq, _group_sum(dk, h_k), _group_sum(dv, h_k)


def time_ms(fn: Callable, rep: int) -> float:
    """Median wall-clock milliseconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_bytes(fn: Callable) -> int:
    """tracemalloc's peak over one call of ``fn`` (memory it allocated, its result included)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@dataclass
class CpuRow:
    dtype: str
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    direction: str
    cupyflash_ms: float
    cupyflash_peak_mib: float
    textbook_ms: float
    textbook_peak_mib: float

    @property
    def speedup(self) -> float:
        return self.textbook_ms / self.cupyflash_ms


def sweep(dtypes, head_dims, seqlens, causals, directions, *, batch, heads, rep,
          progress=print, kv_heads=None) -> List[CpuRow]:
    import cupyflash as cf

    from ._bench import DTYPES

    rng = np.random.default_rng(0)
    rows = []
    h_k = kv_heads or heads
    if heads % h_k:
        raise ValueError(f"--kv-heads {h_k} must divide --heads {heads}")
    for dt in dtypes:
        for hd in head_dims:
            for s in seqlens:
                q, k, v, dout = (rng.standard_normal((batch, s, hh, hd), np.float32).astype(DTYPES[dt])
                                 for hh in (heads, h_k, h_k, heads))
                for causal in causals:
                    for direction in directions:
                        if direction == "fwd":
                            ours = lambda: cf.attention(q, k, v, causal=causal, device="cpu")
                            book = lambda: textbook_forward(q, k, v, causal)
                        else:
                            out, lse = cf.attention(q, k, v, causal=causal, return_lse=True, device="cpu")
                            ours = lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                 device="cpu")
                            book = lambda: textbook_backward(dout, q, k, v, causal)
                        rows.append(CpuRow(dt, batch, s, heads, h_k, hd, causal, direction,
                                           time_ms(ours, rep), peak_bytes(ours) / 2**20,
                                           time_ms(book, rep), peak_bytes(book) / 2**20))
                        progress(f"{dt} hd{hd} s{s} causal={causal} {direction} done")
    return rows


def table(rows: List[CpuRow]) -> str:
    head = (f"{'dtype':>5} {'shape (b, s, h, d)':>20} {'causal':>6} {'dir':>3} | "
            f"{'cupyflash ms':>12} {'peak MiB':>8} | {'textbook ms':>11} {'peak MiB':>8} | "
            f"{'speedup':>7} {'memory':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        heads = f"{r.heads}/{r.kv_heads}" if r.kv_heads != r.heads else str(r.heads)
        shape = f"({r.batch}, {r.seqlen}, {heads}, {r.head_dim})"
        lines.append(f"{r.dtype:>5} {shape:>20} {str(r.causal):>6} {r.direction:>3} | "
                     f"{r.cupyflash_ms:12.1f} {r.cupyflash_peak_mib:8.1f} | {r.textbook_ms:11.1f} "
                     f"{r.textbook_peak_mib:8.1f} | {r.speedup:6.2f}x "
                     f"{r.textbook_peak_mib / max(r.cupyflash_peak_mib, 1e-9):6.1f}x")
    return "\n".join(lines)


def main(args) -> int:
    """The CPU bench: table on stdout, JSON to ``args.json``."""
    import os
    import platform

    from . import cpu

    header = (f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"{cpu.num_threads()} threads, NumPy {np.__version__}")
    print(f"# {header}")
    rows = sweep(args.dtype, args.head_dim, args.seqlen, args.causal, args.direction,
                 batch=args.batch, heads=args.heads, rep=args.rep, kv_heads=args.kv_heads,
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(rows))
    with open(args.json, "w") as f:
        json.dump({"device": header, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"# json: {args.json}")
    return 0
