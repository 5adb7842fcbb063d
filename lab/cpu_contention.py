"""Question: does cupyflash's CPU forward stay ahead of textbook NumPy when the cores are shared?

Times ``cupyflash.attention(q, k, v, device="cpu")`` ("cupyflash": blocks on a thread pool, BLAS
single-threaded), the same code run inline with BLAS left to its own threads ("inline", how the
CPU implementation ran before it was threaded) and textbook NumPy (softmax(Q Kᵀ · scale) V with
the full score matrix) on 1×4096×8×64 float32 (--shape to change), interleaved, on a quiet
machine, beside two busy Python loops, and beside one process running BLAS matmuls. Prints the
median of --reps calls per cell, each load's slowdown against quiet, and textbook / cupyflash.

    python lab/cpu_contention.py [--reps 5] [--shape 1 4096 8 64] [--loads quiet,busy2,blas1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cupyflash as cf  # noqa: E402
from cupyflash import _cpubench, cpu  # noqa: E402

LOADS = {
    "quiet": [],
    "busy2": [[sys.executable, "-c", "while True: pass"]] * 2,
    "blas1": [[sys.executable, "-c", "import numpy as np\n"
               "a = np.random.default_rng(0).standard_normal((1024, 1024), np.float32)\n"
               "while True: a @ a"]],
}


def textbook(q, k, v):
    """softmax(scale · Q Kᵀ) V with the [b, h, s, s] scores materialized (bshd in and out): the
    bench's textbook NumPy (exp and normalization in place, one score-sized temporary)."""
    return _cpubench.textbook_forward(q, k, v)


def timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 4096, 8, 64])
    ap.add_argument("--loads", default="quiet,busy2,blas1")
    ap.add_argument("--threads", default="",
                    help="also time cupyflash with these CUPYFLASH_CPU_THREADS, e.g. 2,4")
    args = ap.parse_args(argv)
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal(args.shape, np.float32) for _ in range(3))
    ours = lambda: cf.attention(q, k, v, device="cpu")

    def inline():
        old, cpu._PARALLEL_MIN_SCORES = cpu._PARALLEL_MIN_SCORES, 1 << 62
        try:
            return cf.attention(q, k, v, device="cpu")
        finally:
            cpu._PARALLEL_MIN_SCORES = old

    def with_threads(n):
        def fn():
            old = os.environ.get("CUPYFLASH_CPU_THREADS")
            os.environ["CUPYFLASH_CPU_THREADS"] = str(n)
            try:
                return cf.attention(q, k, v, device="cpu")
            finally:
                if old is None:
                    del os.environ["CUPYFLASH_CPU_THREADS"]
                else:
                    os.environ["CUPYFLASH_CPU_THREADS"] = old
        return fn

    book = lambda: textbook(q, k, v)
    impls = {"cupyflash": ours, "inline": inline, "textbook": book}
    for n in filter(None, args.threads.split(",")):
        impls[f"t{int(n)}"] = with_threads(int(n))
    for fn in impls.values():
        fn()  # warm-up
    rows = {}
    for load in args.loads.split(","):
        procs = [subprocess.Popen(cmd) for cmd in LOADS[load]]
        try:
            time.sleep(1.0 if procs else 0.0)
            times = {name: [] for name in impls}
            for _ in range(args.reps):
                for name, fn in impls.items():
                    times[name].append(timed(fn))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        rows[load] = {name: statistics.median(t) for name, t in times.items()}
        print(f"# {load}: " + "  ".join(f"{n} {sorted(round(x) for x in t)}" for n, t in times.items()),
              file=sys.stderr, flush=True)
    base = rows.get("quiet")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"shape {tuple(args.shape)} float32, {cores} cores, median of {args.reps}, "
          f"CUPYFLASH_CPU_THREADS={os.environ.get('CUPYFLASH_CPU_THREADS', '(default)')}")
    print(f"{'load':>6} | " + " | ".join(f"{n + ' ms':>12} {'slowdown':>8}" for n in impls)
          + f" | {'textbook/cupyflash':>18}")
    for load, r in rows.items():
        cells = [f"{r[n]:12.0f} {(f'{r[n] / base[n]:.2f}x' if base else '-'):>8}" for n in impls]
        print(f"{load:>6} | " + " | ".join(cells) + f" | {r['textbook'] / r['cupyflash']:18.2f}")


if __name__ == "__main__":
    main()
