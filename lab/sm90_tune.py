# Question: Which Hopper forward tile (BN, STAGES, NC) is fastest for each shape (the source of _plan.SM90_TILES)?
"""Time Hopper-kernel instantiations (tile width BN, ring depth STAGES, consumer warpgroups NC)
side by side on the FA benchmark shapes (bf16, batch·seqlen = 16k tokens, hidden 2048), each
checked against the portable kernel first. For choosing plan_fwd_sm90.SM90_TILES; run on a cc 9.0 GPU:

    PYTHONPATH=. python lab/sm90_tune.py [--seqlen 1024 4096 16384] [--rounds 5] [--peer cudnn]

A candidate ``D:BN,STAGES,NC,s`` is the SPLIT variant (the grid's last partial wave split along
the keys, always: plan_fwd_sm90.sm90_split with force), timed in non-causal cells only; ``...,m`` (after
the s, if any) the MAXFREE variant (the max-free softmax: dense hd 128 × 128 keys), likewise.

With --rounds N each cell times its candidates N times, interleaved (A B C A B C ...), and prints
the median TFLOP/s with the lowest and highest in brackets: the card's clock drifts between
consecutive timings by several percent, which one timing per candidate takes for a difference.
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # benchmarks/peers.py for --peer

import cupy as cp
import ml_dtypes

from cupyflash.gpu import fwd as gpu_fwd, plan_fwd_sm90
from cupyflash._bench import time_ms
from cupyflash._options import Options
from benchmarks.peers import try_peer   # benchmarks/peers.py: imports torch only when a peer is asked for

#: (BN, STAGES, NC) per head dim
CANDIDATES = {64: [(128, 2, 2), (128, 2, 3), (192, 2, 2)],
              128: [(128, 2, 2), (128, 3, 2), (160, 2, 2)],
              256: [(64, 2, 2), (80, 2, 2)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--head-dim", nargs="+", type=int, default=sorted(CANDIDATES))
    ap.add_argument("--causal", nargs="+", default=["false", "true"], help="e.g. --causal true")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timings per candidate")
    ap.add_argument("--tiles", nargs="+", default=[], metavar="D:BN,STAGES,NC[,s][,m]",
                    help="candidates instead of CANDIDATES, e.g. 64:96,2,2 128:128,2,2 "
                         "128:128,2,2,s (s: the SPLIT variant) 128:128,2,2,m (m: MAXFREE)")
    ap.add_argument("--batch", type=int, help="batch instead of the FA shapes' 16k / seqlen")
    ap.add_argument("--heads", type=int, help="heads instead of the FA shapes' 2048 / head dim")
    ap.add_argument("--peer", choices=["cudnn", "flash", "memeff"],
                    help="a PyTorch SDPA backend timed in every round after the candidates")
    args = ap.parse_args()
    candidates = CANDIDATES
    if args.tiles:
        candidates = {}
        for spec in args.tiles:
            d, tiles = spec.split(":")
            bn, st, nc, *flags = tiles.split(",")
            if flags not in ([], ["s"], ["m"], ["s", "m"]):
                raise SystemExit(f"--tiles {spec}: expected D:BN,STAGES,NC[,s][,m]")
            candidates.setdefault(int(d), []).append((int(bn), int(st), int(nc), "s" in flags,
                                                      "m" in flags))
    causals = [c.lower() in ("1", "true", "yes") for c in args.causal]
    for d in (args.head_dim if not args.tiles else sorted(candidates)):
        for s in args.seqlen:
            b, h = args.batch or max(1, 16384 // s), args.heads or 2048 // d
            q, k, v = (cp.random.standard_normal((b, s, h, d), dtype=cp.float32)
                       .astype(ml_dtypes.bfloat16) for _ in range(3))
            out = cp.empty_like(q)
            lse = cp.empty((b, h, s), cp.float32)
            for causal in causals:
                opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
                gpu_fwd.forward(q, k, v, out, lse, opts, kernel="portable")
                ref = out.astype(cp.float32)
                variants = [plan_fwd_sm90.Sm90Variant("bf16_t", d, bn, st, causal, False, nc,
                                              split=bool(flags and flags[0]),
                                              maxfree=bool(len(flags) > 1 and flags[1]))
                            for bn, st, nc, *flags in candidates[d]
                            if not (causal and any(flags))]
                bad = {}
                for var in variants:     # each candidate checked against the portable kernel
                    out.fill(0)
                    gpu_fwd.forward(q, k, v, out, lse, opts, kernel=var)
                    err = float(cp.abs(out.astype(cp.float32) - ref).max())
                    bad[var] = "" if err < 2e-2 else " BAD %.1e" % err
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                label = {var: f"{var.bm}x{var.bn}s{var.stages}" + ("split" if var.split else "")
                         + ("maxfree" if var.maxfree else "") for var in variants}
                calls = {label[var]:
                         (lambda var=var: gpu_fwd.forward(q, k, v, out, lse, opts, kernel=var))
                         for var in variants}
                marks = {label[var]: bad[var] for var in variants}
                if args.peer:
                    fn = try_peer(args.peer, q, k, v, causal, "fwd")
                    if fn is not None:
                        calls[args.peer], marks[args.peer] = fn, ""
                tfs = {name: [] for name in calls}
                for _ in range(args.rounds):   # interleaved: clock drift hits every candidate
                    for name, fn in calls.items():
                        tfs[name].append(flops / time_ms(fn) / 1e9)
                cells = []
                for name, t in tfs.items():
                    spread = f" [{min(t):5.1f}-{max(t):5.1f}]" if args.rounds > 1 else ""
                    cells.append(f"{name}: {statistics.median(t):6.1f}{spread}{marks[name]}")
                print(f"d{d:3d} s{s:6d} b{b} h{h} causal={causal!s:5}  " + "  ".join(cells),
                      flush=True)
            del q, k, v, out
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
