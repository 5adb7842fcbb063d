# Question: How much does the last, partly filled wave of work tiles cost the Hopper forward?
"""How much the last, partly filled wave of work tiles costs the Hopper forward: times the forward
(and a PyTorch SDPA peer, --peer) at a fixed seqlen over batch sizes b = 30 .. 34 with h heads
(default 4), so that the number of work tiles b · h · ceil(s / BM) steps across a multiple of the
SM count. With equal tiles and one block per SM the kernel takes ceil(tiles / SMs) rounds: if the
tail costs, TFLOP/s rises with the tile count up to a full last wave and drops right after it.

    python lab/wave_probe.py --head-dim 128 --seqlens 512 2048 --peer cudnn
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

import cupyflash as cf  # noqa: E402
from cupyflash import _bench  # noqa: E402

from ab_timing import interleaved_tflops  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--bm", type=int, default=128, help="query rows per work tile (to count tiles)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--peer", choices=["cudnn", "flash", "memeff"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=20)
    args = ap.parse_args(argv)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    d, h = args.head_dim, args.heads
    print(f"# {_bench.device_line()}; {sms} SMs; hd {d}, h {h}, causal {args.causal}")
    print(f"{'seqlen':>6} {'b':>4} {'tiles':>6} {'waves':>6} | {'ours':>7} {args.peer or 'peer':>7} | ratio")
    for s in args.seqlens:
        m_blocks = -(-s // args.bm)
        # b · h · m_blocks from ~0.9 to ~1.05 of the FA benchmark's 2048 tiles, in steps of ~1/4 SM wave
        batches = args.batches or sorted({max(1, round(w * sms / (h * m_blocks)))
                                          for w in (14.5, 15.0, 15.25, 15.5, 15.75, 16.0, 16.25, 16.5)})
        for b in batches:
            q, k, v = (cp.random.standard_normal((b, s, h, d), dtype=cp.float32).astype(ml_dtypes.bfloat16)
                       for _ in range(3))
            fn = lambda: cf.attention(q, k, v, causal=args.causal)   # noqa: E731
            peer = None
            if args.peer:
                from benchmarks import peers
                peer = peers.try_peer(args.peer, q, k, v, args.causal, "fwd")
            (tf,), tp = interleaved_tflops([fn], peer, _bench.flops(b, h, s, s, d, args.causal, "fwd"),
                                           args.rounds, args.rep, _bench.time_ms)
            tiles = b * h * m_blocks
            print(f"{s:>6} {b:>4} {tiles:>6} {tiles / sms:>6.2f} | {tf:7.1f} {tp:7.1f} | {tf / tp:5.3f}", flush=True)
            del q, k, v, fn, peer
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
