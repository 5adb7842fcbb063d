# Question: Is a cell bound by the card's power cap, and at what SM clock does each kernel run?
"""SM clock and board power while one forward runs back to back (bf16, FlashAttention's benchmark
shapes): ours, cuDNN (PyTorch SDPA), and optionally probe trees of lab/fwd_tile_probe.py.
nvidia-smi samples the card every --ms milliseconds in a background process; each phase launches
its call for --seconds and reports the samples taken inside it (first 20 % dropped): whether a
cell is bound by the card's power limit (the clock falls below its 1980 MHz maximum at the
limit) and at what clock each kernel runs, with its TFLOP/s from CUDA events.

    python lab/power_probe.py --seqlens 2048 8192 [--trees /tmp/probe/nosoftmax/kernels_cu]
"""
from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import fwd as gpu_fwd, fwd_sm90
from cupyflash._options import Options  # noqa: E402

from ab_fwd_kernels import compile_from  # noqa: E402


def sampler(ms: int, samples: list):
    """nvidia-smi in the background; a thread appends (arrival time, MHz, W) to ``samples``"""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", f"-lms={ms}"],
                           stdout=subprocess.PIPE, text=True)

    def read():
        for line in smi.stdout:
            try:
                mhz, w = (float(x) for x in line.split(","))
            except ValueError:
                continue
            samples.append((time.time(), mhz, w))
    threading.Thread(target=read, daemon=True).start()
    return smi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--trees", nargs="*", default=[], help="kernels_cu trees timed as well")
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--ms", type=int, default=50)
    args = ap.parse_args(argv)
    from benchmarks import peers
    d = args.head_dim
    samples = []
    smi = sampler(args.ms, samples)
    time.sleep(1.0)
    phases = []                                           # (name, t0, t1, TFLOP/s)
    for s in args.seqlens:
        b, h = _bench.TOKENS // s, _bench.HIDDEN // d
        q, k, v = (cp.random.standard_normal((b, s, h, d), dtype=cp.float32).astype(ml_dtypes.bfloat16)
                   for _ in range(3))
        out, lse = cp.empty_like(q), cp.empty((b, h, s), cp.float32)
        opts = Options(scale=1 / math.sqrt(d))
        name = gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
        calls = {f"cupyflash s={s}": lambda: gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")}
        if args.trees:
            variant = fwd_sm90.variant_by_name(name)
            ent = gpu_fwd._launch_cache[gpu_fwd._key(q, k, v, out, opts, "sm90")]   # the cached launch
            base_fn = ent.fn
            for i, tree in enumerate(args.trees):
                fn = compile_from(Path(tree), variant, cp.cuda.Device().id, 100 + i)

                def call(fn=fn):
                    ent.fn = fn
                    gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
                    ent.fn = base_fn
                calls[f"{Path(tree).parent.name} s={s}"] = call
        cudnn = peers.try_peer("cudnn", q, k, v, False, "fwd")
        if cudnn:
            calls[f"cudnn s={s}"] = cudnn
        fl = _bench.flops(b, h, s, s, d, False, "fwd")
        for label, fn in calls.items():
            tf = fl / _bench.time_ms(fn) / 1e9
            cp.cuda.Device().synchronize()
            t0 = time.time()
            while time.time() - t0 < args.seconds:
                for _ in range(20):
                    fn()
                cp.cuda.Device().synchronize()
            phases.append((label, t0, time.time(), tf))
            time.sleep(0.5)
        del q, k, v, out, lse
        cp.get_default_memory_pool().free_all_blocks()
    time.sleep(0.3)
    smi.terminate()
    print(f"# {_bench.device_line()}; hd {d}, bf16, non-causal; nvidia-smi every {args.ms} ms")
    print(f"{'call':28s} | {'TFLOP/s':>7} | {'MHz med':>7} {'min':>5} {'max':>5} | {'W med':>6} | samples")
    for label, t0, t1, tf in phases:
        lo = t0 + 0.2 * (t1 - t0)
        got = [(mhz, w) for t, mhz, w in samples if lo <= t <= t1]
        if not got:
            print(f"{label:28s} | {tf:7.1f} | no samples")
            continue
        mhz = [g[0] for g in got]
        w = [g[1] for g in got]
        print(f"{label:28s} | {tf:7.1f} | {statistics.median(mhz):7.0f} {min(mhz):5.0f} {max(mhz):5.0f} | "
              f"{statistics.median(w):6.1f} | {len(got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
