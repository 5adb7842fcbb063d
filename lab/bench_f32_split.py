# Question: How fast are the portable float32 kernels, forward and backward, with the bf16x3 products against the 3xTF32 ones, beside SDPA's memory-efficient float32 backend?
"""float32 speed of the portable kernels (kernel="portable") per float32 product mode (the NVRTC
-D flags of lab/f32_accuracy_grid.py's MODES), beside PyTorch SDPA's memory-efficient backend on
float32 (when torch imports); FlashAttention's shapes (16k tokens, hidden 2048), tensors stored
bhsd. Timing interleaved (lab/ab_timing.py: every round times each mode once, then the peer;
medians). TFLOP/s = 4·b·h·s²·d (halved for causal; backward 2.5x) / median time; the backward
times the backward alone (out / lse from one forward beforehand).

    python lab/bench_f32_split.py [--head-dims 64 128] [--seqlens 4096] [--modes bf16x3 3xTF32]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, device, fwd as gpu_fwd  # noqa: E402
from cupyflash._options import Options  # noqa: E402

from ab_timing import interleaved_tflops  # noqa: E402
from f32_accuracy_grid import MODES, precompile, variants_of  # noqa: E402


def _memeff(q, k, v, causal, direction):
    from benchmarks import peers
    return peers.try_peer("memeff", q, k, v, causal, direction)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=8)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    cc, smem, num_sms = device.info(cp.cuda.runtime.getDevice())
    cells = [(d, s, c) for d in args.head_dims for s in args.seqlens for c in causals]
    jobs = []
    for d, s, c in cells:
        b, h = _bench.TOKENS // s, _bench.HIDDEN // d
        for v in variants_of(("", b, s, s, h, h, d, d, c, "bhsd"), smem, num_sms):
            jobs += [(v, MODES[m]) for m in args.modes]
    precompile(jobs, args.workers)
    print(f"# {_bench.device_line()}  cc {cc}, float32, portable kernels, layout bhsd; "
          f"medians of {args.rounds} interleaved rounds x {args.rep} calls")
    cols = " ".join(f"{m:>9}" for m in args.modes)
    ratio = " ".join(f"{m + '/' + args.modes[0]:>{max(9, len(m) + len(args.modes[0]) + 1)}}"
                     for m in args.modes[1:])
    print(f"{'dir':>3} {'hd':>3} {'seqlen':>6} {'causal':>6} | {cols} {'memeff':>7} | {ratio} "
          f"{args.modes[0] + '/memeff':>14}")
    for direction in ("fwd", "bwd"):
        for d, s, causal in cells:
            b, h = _bench.TOKENS // s, _bench.HIDDEN // d
            shape = (b, h, s, d)
            bshd = lambda x: x.transpose(0, 2, 1, 3)   # noqa: E731
            q, k, v, dout = (bshd(cp.random.standard_normal(shape, dtype=cp.float32))
                             for _ in range(4))
            out = bshd(cp.empty(shape, cp.float32))
            lse = cp.empty((b, h, s), cp.float32)
            opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
            grads = [bshd(cp.empty(shape, cp.float32)) for _ in range(3)]
            calls = []
            for m in args.modes:
                kern = ("portable", MODES[m])
                gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kern)
                if direction == "fwd":
                    calls.append(lambda kern=kern: gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kern))
                else:
                    calls.append(lambda kern=kern: gpu_bwd.backward(dout, q, k, v, out, lse, *grads,
                                                                    opts, kernel=kern))
            peer = _memeff(q, k, v, causal, direction)
            fl = _bench.flops(b, h, s, s, d, causal, direction)
            tf, t_peer = interleaved_tflops(calls, peer, fl, args.rounds, args.rep, _bench.time_ms)
            rel = " ".join(f"{x / tf[0]:>{max(9, len(m) + len(args.modes[0]) + 1)}.3f}"
                           for x, m in zip(tf[1:], args.modes[1:]))
            print(f"{direction:>3} {d:>3} {s:>6} {'yes' if causal else 'no':>6} | "
                  + " ".join(f"{x:9.1f}" for x in tf) + f" {t_peer:7.1f} | {rel} "
                  f"{tf[0] / t_peer if t_peer == t_peer else float('nan'):14.2f}", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
