"""Benchmark machinery behind ``python -m cupyflash bench`` (and benchmarks/).

Timing: CUDA events around each call on the current stream, warm-up first, median of the
repeats. FLOPs: FlashAttention's count, 4·b·h·s_q·s_k·d forward (halved for causal), backward
2.5× the forward. Peers are factories ``peer(q, k, v, causal, direction) -> callable | None``
taking CuPy bshd arrays; the plain CuPy recipe (matmul, softmax, matmul) is built in. More peers
(PyTorch SDPA's backends) come from a module named on the command line (``--peers
benchmarks.peers``): nothing in this package imports PyTorch.
"""
from __future__ import annotations

import importlib
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import ml_dtypes
import numpy as np

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}
TOKENS, HIDDEN = 16384, 2048  # FlashAttention's benchmark shapes: batch·seqlen, heads·head_dim


def flops(b, h, sq, sk, d, causal, direction):
    """FlashAttention's FLOP count of one call."""
    f = 4.0 * b * h * sq * sk * d / (2 if causal else 1)
    return f * 2.5 if direction == "bwd" else f


def time_ms(fn: Callable, warmup: int = 3, rep: int = 20) -> float:
    """Median milliseconds of ``fn()`` between CUDA events on the current stream."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(rep)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(a, b) for a, b in events)


def measure_memory(fn: Callable):
    """Device memory one call of ``fn`` asks of CuPy's default pool, after one warm-up call.

    Returns (peak, kept, sizes): the most bytes the call held at once (every request counted,
    including blocks the pool hands back from its cache, which its byte counters do not show),
    the bytes still held when it returned (its outputs), and each request's size in bytes."""
    import cupy
    from cupy.cuda import memory_hook

    class PoolCounter(memory_hook.MemoryHook):
        name = "PoolCounter"

        def __init__(self):
            self.live = self.peak = 0
            self.sizes, self.by_ptr = [], {}

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.by_ptr[mem_ptr] = mem_size
            self.live += mem_size
            self.peak = max(self.peak, self.live)
            self.sizes.append(size)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.live -= self.by_ptr.pop(mem_ptr, 0)   # blocks from before the hook: not counted

    fn()  # warm-up: compile, plan caches, scheduler counters
    cupy.cuda.Device().synchronize()
    with PoolCounter() as hook:
        result = fn()
        cupy.cuda.Device().synchronize()
    del result
    return hook.peak, hook.live, hook.sizes


def cupyflash_peer(q, k, v, causal, direction):
    """cupyflash itself, through the public API."""
    import cupyflash as cf

    if direction == "fwd":
        return lambda: cf.attention(q, k, v, causal=causal)
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    dout = out.copy()
    try:
        cf.attention_backward(dout, q, k, v, out, lse, causal=causal)
    except NotImplementedError:
        return None
    return lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=causal)


def cupy_peer(q, k, v, causal, direction, max_bytes=24e9):
    """The plain CuPy recipe: scores = QKᵀ (float32), softmax, P V; forward only.

    CuPy has no bfloat16 batched matmul: bfloat16 inputs are timed on float16 copies (made
    outside the timed region), the closest plain-CuPy path.
    """
    import cupy as cp

    b, s, h, d = q.shape
    sk = k.shape[1]
    if direction != "fwd" or b * h * s * sk * 4 * 3 > max_bytes or k.shape[2] != h:
        return None
    if q.dtype == np.dtype(ml_dtypes.bfloat16):
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scale = 1.0 / math.sqrt(d)
    mask = cp.triu(cp.ones((s, sk), bool), sk - s + 1) if causal else None

    def run():
        scores = cp.matmul(qt, kt.swapaxes(-1, -2)).astype(cp.float32) * scale
        if mask is not None:
            scores = cp.where(mask, -cp.inf, scores)
        scores -= scores.max(-1, keepdims=True)
        p = cp.exp(scores)
        p /= p.sum(-1, keepdims=True)
        return cp.matmul(p.astype(q.dtype), vt)

    return run


def portable_peer(q, k, v, causal, direction):
    """cupyflash's portable (mma.sync) kernels, forced through the launchers: shown beside
    "cupyflash" on a Hopper card, where the planner runs hopper/fwd.cu / hopper/bwd.cu instead."""
    import cupy as cp

    from .gpu import bwd as _gpu_bwd
    from .gpu import fwd as _gpu
    from ._options import Options

    if int(cp.cuda.Device().compute_capability) != 90:
        return None
    b, s, h, d = q.shape
    out = cp.empty(q.shape[:3] + (v.shape[3],), q.dtype)
    lse = cp.empty((b, h, s), cp.float32)
    opts = Options(scale=1.0 / math.sqrt(d), window_right=0 if causal else -1)
    if direction == "fwd":
        return lambda: _gpu.forward(q, k, v, out, lse, opts, kernel="portable")
    _gpu.forward(q, k, v, out, lse, opts)
    dout, grads = out.copy(), [cp.empty_like(x) for x in (q, k, v)]
    return lambda: _gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, kernel="portable")


BUILTIN_PEERS = {"cupy": cupy_peer, "portable": portable_peer}


def load_peers(module_names, skip=()) -> Dict[str, Callable]:
    """Peers: the built-in ones plus ``PEERS`` (name -> factory) of each module named, less
    those named in ``skip``."""
    peers = dict(BUILTIN_PEERS)
    for name in module_names or ():
        peers.update(importlib.import_module(name).PEERS)
    return {n: f for n, f in peers.items() if n not in skip}


@dataclass
class Row:
    dtype: str
    head_dim: int
    seqlen: int
    causal: bool
    direction: str
    batch: int
    heads: int
    kv_heads: int = 0          # key / value heads (GQA, MQA); 0: as many as ``heads``
    tflops: Dict[str, float] = field(default_factory=dict)  # implementation -> TFLOP/s

    def ratio(self, peer: str) -> float:
        ours, other = self.tflops.get("cupyflash", math.nan), self.tflops.get(peer, math.nan)
        return ours / other if other and not math.isnan(other) else math.nan


def heads_for(head_dim: int, heads: Optional[int] = None, kv_heads: Optional[int] = None):
    """(query heads, key / value heads) of a case: ``heads`` or FlashAttention's HIDDEN //
    head_dim; ``kv_heads`` or as many. ValueError naming --kv-heads when they do not divide."""
    h = heads or max(1, HIDDEN // head_dim)
    h_k = kv_heads or h
    if h % h_k:
        raise ValueError(f"--kv-heads {h_k} must divide the {h} query heads (head dim {head_dim})")
    return h, h_k


def sweep(dtypes, head_dims, seqlens, causals, directions, peers, *, rep=20, progress=print,
          heads=None, kv_heads=None) -> List[Row]:
    """Time cupyflash and every peer on FlashAttention's benchmark shapes (``heads`` query heads
    instead of HIDDEN // head_dim where given; ``kv_heads`` key / value heads: GQA, MQA)."""
    import cupy as cp

    rows = []
    cases = [(dt, hd, s) for dt in dtypes for hd in head_dims for s in seqlens]
    rng = np.random.default_rng(0)
    for n, (dt, hd, s) in enumerate(cases, 1):
        b = max(1, TOKENS // s)
        h, h_k = heads_for(hd, heads, kv_heads)
        q, k, v = (cp.asarray(rng.standard_normal((b, s, hh, hd), np.float32)).astype(DTYPES[dt])
                   for hh in (h, h_k, h_k))
        for causal in causals:
            for direction in directions:
                row = Row(dt, hd, s, causal, direction, b, h, h_k)
                fl = flops(b, h, s, s, hd, causal, direction)
                for name, factory in [("cupyflash", cupyflash_peer), *peers.items()]:
                    try:
                        fn = factory(q, k, v, causal, direction)
                        row.tflops[name] = fl / time_ms(fn, rep=rep) / 1e9 if fn else math.nan
                    except Exception as exc:  # a peer refusing a problem is a gap, not a failure
                        progress(f"  {name} failed on {dt} hd{hd} s{s}: {type(exc).__name__}: {str(exc)[:80]}")
                        row.tflops[name] = math.nan
                    cp.get_default_memory_pool().free_all_blocks()
                rows.append(row)
        progress(f"[{n}/{len(cases)}] {dt} hd{hd} s{s} done")
        del q, k, v
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def table(rows: List[Row]) -> str:
    """The TFLOP/s table with cupyflash's ratio to each peer."""
    peers = [p for p in rows[0].tflops if p != "cupyflash"] if rows else []
    head = (f"{'dtype':>5} {'hd':>3} {'heads':>6} {'seqlen':>6} {'causal':>6} {'dir':>3} | {'cupyflash':>9} "
            + " ".join(f"{p:>9}" for p in peers) + " | " + " ".join(f"{'/' + p:>9}" for p in peers))
    lines = [head, "-" * len(head)]
    for r in rows:
        heads = f"{r.heads}/{r.kv_heads}" if r.kv_heads and r.kv_heads != r.heads else str(r.heads)
        lines.append(f"{r.dtype:>5} {r.head_dim:>3} {heads:>6} {r.seqlen:>6} {str(r.causal):>6} {r.direction:>3} | "
                     f"{r.tflops['cupyflash']:9.1f} " + " ".join(f"{r.tflops[p]:9.1f}" for p in peers)
                     + " | " + " ".join(f"{r.ratio(p):9.2f}" for p in peers))
    return "\n".join(lines)


def plot(rows: List[Row], path: str) -> Optional[str]:
    """TFLOP/s against seqlen per implementation, one panel per (dtype, hd, causal, dir)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = sorted({(r.dtype, r.head_dim, r.causal, r.direction) for r in rows})
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        sel = sorted((r for r in rows if (r.dtype, r.head_dim, r.causal, r.direction) == key),
                     key=lambda r: r.seqlen)
        for impl in sel[0].tflops:
            ax.plot([r.seqlen for r in sel], [r.tflops[impl] for r in sel], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]} hd{key[1]} {'causal' if key[2] else 'full'} {key[3]}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def device_line() -> str:
    """GPU name, CuPy, CUDA runtime and driver versions: the header of a measured table."""
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return (f"{name}, CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, "
            f"driver {cp.cuda.runtime.driverGetVersion()}")


def main(args) -> int:
    """``python -m cupyflash bench``: sweep, print the table, write JSON and a PNG."""
    from ._interop import gpu_available

    if not gpu_available():
        print("bench needs a CUDA GPU with CuPy", file=sys.stderr)
        return 2
    peers = load_peers(args.peers, args.skip_peers)
    from contextlib import nullcontext

    from .gpu.device import limit_shared_memory

    smem = getattr(args, "smem_limit", None)
    print(f"# {device_line()}" + (f"; planned for at most {smem} B of shared memory per block"
                                   if smem else ""))
    with limit_shared_memory(smem) if smem else nullcontext():
        rows = sweep(args.dtype, args.head_dim, args.seqlen, args.causal, args.direction, peers,
                     rep=args.rep, progress=lambda m: print(m, file=sys.stderr, flush=True),
                     heads=getattr(args, "heads", None), kv_heads=getattr(args, "kv_heads", None))
    print(table(rows))
    with open(args.json, "w") as f:
        json.dump({"device": device_line(), "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"# json: {args.json}")
    png = plot(rows, args.png)
    print(f"# plot: {png}" if png else "# plot: skipped (matplotlib not installed)")
    return 0


def add_arguments(p) -> None:
    """The ``bench`` subcommand's options."""
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    p.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    p.add_argument("--seqlen", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", nargs="+", type=lambda s: s.lower() in ("1", "true", "yes"),
                   default=[False, True], help="e.g. --causal false true")
    p.add_argument("--direction", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    p.add_argument("--peers", nargs="*", default=[],
                   help="modules with a PEERS dict of more peers, e.g. benchmarks.peers (PyTorch SDPA)")
    p.add_argument("--skip-peers", nargs="*", default=[],
                   help="peers to leave out, e.g. cupy (slow at long sequences) or portable")
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--json", default="cupyflash-bench.json")
    p.add_argument("--png", default="cupyflash-bench.png")
    p.add_argument("--smem-limit", type=int, default=None,
                   help="GPU only: plan every cupyflash kernel as if a block could use at most "
                        "this many bytes of shared memory, e.g. 101376 (99 KB: sm_86, sm_89, "
                        "sm_120); the PyTorch peers are not limited")
