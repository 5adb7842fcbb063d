"""Ring attention speed and memory: one GPU (plain attention vs the ring of one) and, with two
GPUs, two ranks over NCCL.

    PYTHONPATH=. python benchmarks/bench_ring.py [--seqlens 131072 262144] [--json PATH]

bf16, head dim 128, 16 heads, batch 1, total sequence 128k and 256k, causal or not (zigzag
sharding for causal, contiguous otherwise). FLOPs = 4 b h s^2 d (halved for causal), backward
2.5x forward. Timing: CUDA events around each call on the current stream (the NCCL stream is
joined into it), warm-up first, median of the repeats; for two ranks the slower rank's median.

Rows:
- plain: ``cupyflash.attention`` / ``attention_backward`` on the whole sequence, one GPU;
- ring w1: ``ring_attention`` with ``InProcessTransport(1)`` on the same arrays (target: within
  3 % of plain);
- nccl w2: two processes (``python -m cupyflash.distributed.run --nproc 2``), each holding half
  the sequence (target: >= 1.85x plain's throughput). Memory, in units of a rank's K+V shard
  bytes, the larger rank's: K/V buffers held at once (its own shard plus the high water of the
  received ones, counted in a memory pool of their own; target <= 3), the received float32
  dK/dV accumulators likewise, and the whole device-memory high water of the call (CuPy pool,
  after freeing cached blocks: out, accumulators and the kernels' workspace included).

The two-rank part runs when two GPUs and NCCL are present (``--ranks-only`` is the per-rank
entry the launcher starts; not for direct use).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hd", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--causal", choices=["both", "causal", "full"], default="both")
    p.add_argument("--no-nccl", action="store_true", help="skip the two-rank NCCL part")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--ranks-only", default=None, metavar="DIR", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def flops(b, h, s, d, causal, backward=False):
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * 2.5 if backward else f


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _draw(cp, shape, seed):
    rs = cp.random.RandomState(seed)
    return rs.standard_normal(shape, dtype=cp.float32).astype(_bf16())


def _cases(a):
    causal = {"both": [False, True], "causal": [True], "full": [False]}[a.causal]
    return [(s, c) for s in a.seqlens for c in causal]


def single_gpu(a):
    """plain vs ring of one on one GPU: rows of dicts."""
    import cupy as cp
    import cupyflash as cf
    from cupyflash._bench import time_ms
    from cupyflash.distributed import InProcessTransport, ring_attention, ring_attention_backward

    t1 = InProcessTransport(1)
    rows = []
    for s, causal in _cases(a):
        shape = (a.batch, s, a.heads, a.hd)
        q, k, v, do = (_draw(cp, shape, i) for i in range(4))
        row = dict(seqlen=s, causal=causal)
        out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
        row["plain_fwd_ms"] = time_ms(lambda: cf.attention(q, k, v, causal=causal, return_lse=True),
                                      a.warmup, a.reps)
        row["ring1_fwd_ms"] = time_ms(lambda: ring_attention([q], [k], [v], t1, causal=causal,
                                                                 return_lse=True), a.warmup, a.reps)
        if not a.no_backward:
            row["plain_bwd_ms"] = time_ms(
                lambda: cf.attention_backward(do, q, k, v, out, lse, causal=causal),
                a.warmup, a.reps)
            row["ring1_bwd_ms"] = time_ms(
                lambda: ring_attention_backward([do], [q], [k], [v], [out], [lse], t1,
                                                    causal=causal), a.warmup, a.reps)
        q = k = v = do = out = lse = None  # free before the next case
        cp.get_default_memory_pool().free_all_blocks()
        rows.append(row)
        print(f"# one GPU s={s} causal={causal}: {row}", flush=True)
    return rows


def rank_main(a):
    """One rank of the NCCL run (started by the launcher): writes DIR/rank{r}.json."""
    import cupy as cp
    from cupyflash._bench import time_ms
    from cupyflash.distributed import (NcclTransport, init_process_group, ring_attention,
                                       ring_attention_backward, shard_lengths)

    comm, rank, world = init_process_group()
    pool = cp.get_default_memory_pool()
    # received buffers come from their own pools, one for the K/V dtype, one for the float32
    # dK/dV accumulators: a pool's total_bytes() is then the high water of what was held at once
    recv_pools = {}

    def recv_alloc(shape, dtype):
        p = recv_pools.setdefault(np.dtype(dtype).name, cp.cuda.MemoryPool())
        with cp.cuda.using_allocator(p.malloc):
            return cp.empty(shape, dtype)

    comm = NcclTransport(comm, recv_alloc=recv_alloc)
    rows = []
    for s, causal in _cases(a):
        scheme = "zigzag" if causal else "contiguous"
        n = shard_lengths(s, world, scheme)[rank]
        shape = (a.batch, n, a.heads, a.hd)
        # each rank draws its own shard (the values do not change the speed)
        q, k, v, do = (_draw(cp, shape, 100 * rank + i) for i in range(4))
        kw = dict(causal=causal, scheme=scheme)
        row = dict(seqlen=s, causal=causal, rank=rank, world=world, scheme=scheme)
        out, lse = ring_attention(q, k, v, comm, return_lse=True, **kw)
        row["fwd_ms"] = time_ms(lambda: ring_attention(q, k, v, comm, return_lse=True, **kw),
                                a.warmup, a.reps)
        if not a.no_backward:
            row["bwd_ms"] = time_ms(
                lambda: ring_attention_backward(do, q, k, v, out, lse, comm, **kw),
                a.warmup, a.reps)
        kv_bytes = k.nbytes + v.nbytes
        for what, fn in (("fwd", lambda: ring_attention(q, k, v, comm, return_lse=True, **kw)),
                         ("bwd", lambda: ring_attention_backward(do, q, k, v, out, lse, comm, **kw))):
            if what == "bwd" and a.no_backward:
                continue
            cp.cuda.Device().synchronize()
            pool.free_all_blocks()
            recv_pools.clear()
            base = pool.used_bytes()
            fn()
            cp.cuda.Device().synchronize()
            held = pool.total_bytes() - base + sum(p.total_bytes() for p in recv_pools.values())
            row[f"{what}_peak_extra_kv_shards"] = held / kv_bytes
            kv_recv = recv_pools.get(k.dtype.name)
            f32_recv = recv_pools.get("float32")
            # K/V shards held at once: this rank's own plus the received ones in use or arriving
            row[f"{what}_kv_buffers_shards"] = 1 + (kv_recv.total_bytes() if kv_recv else 0) / kv_bytes
            row[f"{what}_recv_f32_shards"] = (f32_recv.total_bytes() if f32_recv else 0) / kv_bytes
        row["kv_shard_bytes"] = kv_bytes
        rows.append(row)
        q = k = v = do = out = lse = None  # free before the next case
        pool.free_all_blocks()
    with open(os.path.join(a.ranks_only, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def nccl_two_ranks(a):
    """Launch two ranks; per case, the slower rank's medians and each rank's memory."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "cupyflash.distributed.run", "--nproc", "2", __file__,
                "--ranks-only", tmp, "--seqlens", *map(str, a.seqlens), "--heads", str(a.heads),
                "--hd", str(a.hd), "--batch", str(a.batch), "--warmup", str(a.warmup),
                "--reps", str(a.reps), "--causal", a.causal]
        if a.no_backward:
            argv.append("--no-backward")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        done = subprocess.run(argv, env=env, cwd=ROOT)
        if done.returncode:
            print(f"# NCCL run failed with status {done.returncode}")
            return None
        per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
    rows = []
    for cases in zip(*per_rank):
        row = dict(seqlen=cases[0]["seqlen"], causal=cases[0]["causal"], scheme=cases[0]["scheme"])
        for key in ("fwd_ms", "bwd_ms"):
            if key in cases[0]:
                row[key] = max(c[key] for c in cases)
        for key in ("fwd_peak_extra_kv_shards", "bwd_peak_extra_kv_shards",
                    "fwd_kv_buffers_shards", "bwd_kv_buffers_shards",
                    "fwd_recv_f32_shards", "bwd_recv_f32_shards"):
            if key in cases[0]:
                row[key] = max(c[key] for c in cases)
        rows.append(row)
    return rows


def _gpus(cp):
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


def _nccl_ok():
    try:
        from cupy.cuda import nccl

        return bool(getattr(nccl, "available", True))
    except Exception:  # noqa: BLE001
        return False


def table(a, one, two):
    b, h, d = a.batch, a.heads, a.hd
    tf = lambda s, c, ms, bwd=False: flops(b, h, s, d, c, bwd) / (ms * 1e-3) / 1e12  # noqa: E731
    print(f"\nbf16, hd {d}, {h} heads, batch {b}; TFLOP/s (ms); ratio = plain time / other time")
    head = "| seqlen | causal | pass | plain 1 GPU | ring w1 | w1 / plain |"
    if two:
        head += (" nccl w2 (2 GPUs) | speed-up vs 1 GPU | K/V buffers (shards) |"
                 " received f32 dK/dV (shards) | pool high water / K+V shard |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    two_by = {(r["seqlen"], r["causal"]): r for r in (two or [])}
    for r in one:
        s, c = r["seqlen"], r["causal"]
        for p in ("fwd", "bwd"):
            if f"plain_{p}_ms" not in r:
                continue
            pm, rm = r[f"plain_{p}_ms"], r[f"ring1_{p}_ms"]
            bw = p == "bwd"
            label = f"{s // 1024}k" if s % 1024 == 0 else str(s)
            line = (f"| {label} | {'yes' if c else 'no'} | {p} | {tf(s, c, pm, bw):.0f} ({pm:.1f}) "
                    f"| {tf(s, c, rm, bw):.0f} ({rm:.1f}) | {pm / rm:.3f} |")
            t = two_by.get((s, c))
            if two is not None and t is not None and f"{p}_ms" in t:
                tm = t[f"{p}_ms"]
                line += (f" {tf(s, c, tm, bw):.0f} ({tm:.1f}) | {pm / tm:.2f}x | "
                         f"{t[f'{p}_kv_buffers_shards']:.2f} | {t[f'{p}_recv_f32_shards']:.2f} | "
                         f"{t[f'{p}_peak_extra_kv_shards']:.2f} |")
            print(line)


def main(argv=None):
    a = _args(argv)
    if a.ranks_only:
        rank_main(a)
        return 0
    import cupy as cp

    one = single_gpu(a)
    two = None
    if a.no_nccl:
        print("# two-rank NCCL part skipped (--no-nccl)")
    elif _gpus(cp) < 2 or not _nccl_ok():
        print(f"# two-rank NCCL part skipped: {_gpus(cp)} GPU(s), NCCL "
              f"{'present' if _nccl_ok() else 'missing'}")
    else:
        two = nccl_two_ranks(a)
    table(a, one, two)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"one_gpu": one, "nccl_two_ranks": two, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
