# Question: How fast is the float32 forward: Hopper 3xTF32, portable 3xTF32 and SDPA's memory-efficient backend?
"""float32 attention forward on the H200: the Hopper 3xTF32 kernel (hopper/fwd_f32.cu, forced with
kernel="sm90"), the portable mma.sync 3xTF32 kernel, and PyTorch SDPA's memory-efficient backend
on float32 (when torch imports), FlashAttention's shapes (16k tokens, hidden 2048), tensors
stored bhsd (SDPA's layout; cupyflash takes the bshd views of them) unless --layout bshd.

    python lab/bench_f32.py                    # hd 64 / 128, s 1k / 4k / 16k, causal or not
    python lab/bench_f32.py --tf32             # also the one-pass TF32 variant (allow_tf32)
    python lab/bench_f32.py --head-dims 128 --variant 128,32,2,1,0   # tuning: an
        Sm90F32Variant d,bn,stages,nc,qreg (window instantiation: serves causal and not) or a
        planned variant's name

TFLOP/s = 4·b·h·s²·d (halved for causal) / median time (CUDA events, after warm-up). Each cell
also prints the Hopper kernel's norm-wise relative difference to the portable kernel (both are
float32-accurate: expect ~1e-6). Stops adding cells after --budget seconds (default 55).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import fwd as gpu_fwd, plan_fwd_sm90
from cupyflash._options import Options  # noqa: E402


def _time(fn, budget_ms=400.0):
    """Median ms of fn(): one timed call sizes the repetitions (5 .. 50, ~budget_ms in all)."""
    fn()
    cp.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    fn()
    cp.cuda.get_current_stream().synchronize()
    once = (time.perf_counter() - t0) * 1e3
    rep = max(5, min(50, int(budget_ms / max(once, 1e-3))))
    return _bench.time_ms(fn, warmup=2, rep=rep)


def _memeff(q, k, v, causal, direction="fwd"):
    """SDPA's memory-efficient peer for ``direction`` ("fwd" / "bwd"), None where it cannot run."""
    from benchmarks import peers
    return peers.try_peer("memeff", q, k, v, causal, direction)


def _variant(spec, d):
    if spec is None:
        return "sm90"
    if spec.startswith("fwd90_"):
        return spec
    dd, bn, st, nc, qreg = (int(x) for x in spec.split(","))
    return "sm90" if dd != d else plan_fwd_sm90.Sm90F32Variant("f32x3_t", d, bn, st, nc, True, bool(qreg))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="float32 attention forward: Hopper 3xTF32 vs portable vs SDPA memeff")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--tf32", action="store_true", help="also time allow_tf32 (one TF32 pass)")
    ap.add_argument("--variant", default=None, help="force a float32 Hopper variant (tuning)")
    ap.add_argument("--no-peers", action="store_true", help="skip PyTorch SDPA memeff")
    ap.add_argument("--budget", type=float, default=55.0, help="seconds before stopping")
    ap.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                    help="storage of q, k, v, out: bhsd (SDPA's own, default) or bshd")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    dev = cp.cuda.Device()
    print(f"# {_bench.device_line()}  cc {dev.compute_capability}, float32, layout {args.layout}")
    hdr = f"{'hd':>3} {'seqlen':>6} {'causal':>6} | {'sm90':>7} {'portable':>8} {'memeff':>7}"
    hdr += f" {'sm90tf32':>8}" if args.tf32 else ""
    print(hdr + f" | {'sm90/memeff':>11} {'sm90/port':>9} {'rel diff':>9}  kernel")
    for d in args.head_dims:
        for s in args.seqlens:
            for causal in causals:
                if time.perf_counter() - t_start > args.budget:
                    print("# time budget spent: stopping")
                    return 0
                b, h = _bench.TOKENS // s, _bench.HIDDEN // d
                shape = (b, h, s, d) if args.layout == "bhsd" else (b, s, h, d)
                bshd = (lambda x: x.transpose(0, 2, 1, 3)) if args.layout == "bhsd" else (  # noqa: E731
                    lambda x: x)
                q, k, v = (bshd(cp.random.standard_normal(shape, dtype=cp.float32))
                           for _ in range(3))
                lse = cp.empty((b, h, s), cp.float32)
                opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
                opts32 = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1,
                                 allow_tf32=True)
                o_h, o_p, o_t = (bshd(cp.empty(shape, cp.float32)) for _ in range(3))
                fl = _bench.flops(b, h, s, s, d, causal, "fwd")
                tf = lambda ms: fl / ms / 1e9 if ms else float("nan")   # noqa: E731
                kern = _variant(args.variant, d)
                res = {}
                name = "-"
                try:
                    name = gpu_fwd.forward(q, k, v, o_h, lse, opts, kernel=kern)
                    res["sm90"] = _time(lambda: gpu_fwd.forward(q, k, v, o_h, lse, opts, kernel=kern))
                except Exception as e:  # noqa: BLE001
                    print(f"  sm90: {type(e).__name__}: {e}")
                res["portable"] = _time(lambda: gpu_fwd.forward(q, k, v, o_p, lse, opts,
                                                             kernel="portable"))
                if not args.no_peers:
                    fn = _memeff(q, k, v, causal)
                    if fn is not None:
                        res["memeff"] = _time(fn)
                if args.tf32:
                    try:
                        res["tf32"] = _time(lambda: gpu_fwd.forward(q, k, v, o_t, lse, opts32,
                                                                 kernel="sm90"))
                    except Exception as e:  # noqa: BLE001
                        print(f"  sm90 tf32: {type(e).__name__}: {e}")
                rel = float(cp.linalg.norm(o_h - o_p) / cp.linalg.norm(o_p)) if "sm90" in res \
                    else float("nan")
                row = (f"{d:>3} {s:>6} {'yes' if causal else 'no':>6} | "
                       f"{tf(res.get('sm90')):7.1f} {tf(res.get('portable')):8.1f} "
                       f"{tf(res.get('memeff')):7.1f}")
                if args.tf32:
                    row += f" {tf(res.get('tf32')):8.1f}"
                r_me = (res["memeff"] / res["sm90"]) if "sm90" in res and "memeff" in res \
                    else float("nan")
                r_po = (res["portable"] / res["sm90"]) if "sm90" in res else float("nan")
                print(row + f" | {r_me:11.2f} {r_po:9.2f} {rel:9.2e}  {name}", flush=True)
                del q, k, v, o_h, o_p, o_t, lse
                cp.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
