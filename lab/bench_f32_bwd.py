# Question: How fast is the float32 backward: Hopper 3xTF32, portable 3xTF32 and SDPA's memory-efficient backend?
"""float32 attention backward on the H200: the Hopper 3xTF32 backward (hopper/bwd_f32.cu, forced with
kernel="sm90"; hd 64 and 128: other head dims print the refusal), the portable 3xTF32 backward
(portable/bwd.cu) and PyTorch SDPA's memory-efficient backend on float32 (when torch imports);
FlashAttention's shapes (16k tokens, hidden 2048), tensors stored bhsd.

    python lab/bench_f32_bwd.py                          # hd 64, s 1k / 4k / 16k, both
    python lab/bench_f32_bwd.py --seqlens 4096 --causal no
    python lab/bench_f32_bwd.py --head-dims 128 --seqlens 1024 4096 16384   # design T

TFLOP/s = 2.5 · 4·b·h·s²·d (halved for causal) / median time of the backward alone (the
forward's out / lse computed once beforehand). Each cell also prints the Hopper kernel's largest
norm-wise relative difference to the portable kernel over dq, dk, dv (both float32-accurate:
expect ~1e-6). Stops adding cells after --budget seconds.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
from cupyflash._options import Options  # noqa: E402

from bench_f32 import _memeff, _time  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="float32 attention backward: Hopper vs portable vs SDPA memeff")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--no-peers", action="store_true", help="skip PyTorch SDPA memeff")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds before stopping")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    print(f"# {_bench.device_line()}  float32 backward, layout bhsd")
    print(f"{'hd':>3} {'seqlen':>6} {'causal':>6} | {'sm90_f32':>8} {'portable':>8} {'memeff':>7} | "
          f"{'/memeff':>7} {'/port':>6} {'rel diff':>9}  kernel")
    for d in args.head_dims:
        for s in args.seqlens:
            for causal in causals:
                if time.perf_counter() - t_start > args.budget:
                    print("# time budget spent: stopping")
                    return 0
                b, h = _bench.TOKENS // s, _bench.HIDDEN // d
                shape = (b, h, s, d)
                bshd = lambda x: x.transpose(0, 2, 1, 3)   # noqa: E731
                q, k, v, dout = (bshd(cp.random.standard_normal(shape, dtype=cp.float32))
                                 for _ in range(4))
                out = bshd(cp.empty(shape, cp.float32))
                lse = cp.empty((b, h, s), cp.float32)
                opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
                gpu_fwd.forward(q, k, v, out, lse, opts)
                g_h = [bshd(cp.empty(shape, cp.float32)) for _ in range(3)]
                g_p = [bshd(cp.empty(shape, cp.float32)) for _ in range(3)]
                fl = _bench.flops(b, h, s, s, d, causal, "bwd")
                tf = lambda ms: fl / ms / 1e9 if ms else float("nan")   # noqa: E731
                res, name = {}, "-"

                def run(kernel, g):
                    return gpu_bwd.backward(dout, q, k, v, out, lse, *g, opts, kernel=kernel)

                try:
                    name = run("sm90", g_h)
                    res["sm90_f32"] = _time(lambda: run("sm90", g_h))
                except Exception as e:  # noqa: BLE001
                    print(f"  sm90_f32: {type(e).__name__}: {e}")
                res["portable"] = _time(lambda: run("portable", g_p))
                if not args.no_peers:
                    fn = _memeff(q, k, v, causal, "bwd")
                    if fn is not None:
                        res["memeff"] = _time(fn)
                rel = max(float(cp.linalg.norm(a - b_) / cp.linalg.norm(b_)) for a, b_ in zip(g_h, g_p)) \
                    if "sm90_f32" in res else float("nan")
                r_me = res["memeff"] / res["sm90_f32"] if "sm90_f32" in res and "memeff" in res \
                    else float("nan")
                r_po = res["portable"] / res["sm90_f32"] if "sm90_f32" in res else float("nan")
                print(f"{d:>3} {s:>6} {'yes' if causal else 'no':>6} | {tf(res.get('sm90_f32')):8.1f} "
                      f"{tf(res.get('portable')):8.1f} {tf(res.get('memeff')):7.1f} | {r_me:7.2f} "
                      f"{r_po:6.2f} {rel:9.2e}  {name}", flush=True)
                del q, k, v, dout, out, lse, g_h, g_p
                cp.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
