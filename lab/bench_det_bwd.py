# Question: How fast is the deterministic Hopper backward (DET: dQ tiles added in key-tile order) beside the default atomic one, and cuDNN?
"""Deterministic vs default Hopper backward (flash_bwd_sm90<..., DET>), bf16, in one process.

FlashAttention's benchmark shapes: batch·seqlen = 16k tokens, hidden 2048 (hd 64: 32 heads,
hd 128: 16 heads), seqlen 512..16k, causal and not. Both modes forced onto the Hopper kernel
(kernel="sm90"); the deterministic one in each order of ``--orders`` (``desc`` / ``asc``: the
key tiles' addition order, TUNING.det_descending; ``:auto`` / ``:G``: pairs per draw group,
plan_bwd_sm90.det_group or G; ``plan``: what the planner picks; default ``plan,desc:auto,asc:1``,
"asc:1" being the first version's order);
cuDNN through PyTorch SDPA (benchmarks/peers.py) where PyTorch is installed; ``--portable`` adds
the portable deterministic kernel (what deterministic=True ran before).
Timing: lab/ab_timing.interleaved_tflops (every round times each candidate once, then the peer;
median over rounds of the median of ``--rep`` calls between CUDA events). FLOPs: backward =
2.5 x forward (cupyflash._bench.flops). Each row also checks that two deterministic calls give
the same bits.

    PYTHONPATH=. python lab/bench_det_bwd.py [--seqlens 512,...,16384] [--hdims 64,128]
        [--rounds 5] [--rep 10] [--no-peer] [--portable] [--orders plan,desc:auto,asc:1]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lab"))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from ab_timing import interleaved_tflops  # noqa: E402
from cupyflash import _bench  # noqa: E402
from cupyflash._options import Options  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd  # noqa: E402
from cupyflash.gpu.tuning import tuning  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def order_switches(order: str) -> dict:
    """TUNING switches of one --orders entry ("plan", "desc:auto", "asc:1", ...)."""
    if order == "plan":
        return {}
    direction, group = order.split(":")
    return {"det_descending": direction == "desc", "det_group": None if group == "auto" else int(group)}


def row(s, d, causal, rounds, rep, peer_name, portable, orders):
    b, h = _bench.TOKENS // s, _bench.HIDDEN // d
    rnd = lambda: cp.random.standard_normal((b, s, h, d), dtype=cp.float32).astype(BF16)  # noqa: E731
    q, k, v, dout = rnd(), rnd(), rnd(), rnd()
    out, lse = cp.empty_like(q), cp.empty((b, h, s), cp.float32)
    mk = lambda det: Options(scale=d ** -0.5, window_right=0 if causal else -1,  # noqa: E731
                             deterministic=det)
    gpu_fwd.forward(q, k, v, out, lse, mk(False))
    grads = [cp.empty_like(x) for x in (q, k, v)]
    names = {}

    def call(det, kernel, **switches):
        def fn():
            with tuning(**switches):
                names[(det, kernel)] = gpu_bwd.backward(dout, q, k, v, out, lse, *grads, mk(det),
                                                        kernel=kernel)
        return fn

    calls = [call(False, "sm90")] + [call(True, "sm90", **order_switches(o)) for o in orders]
    calls += [call(True, "portable")] if portable else []
    peer = None
    if peer_name:
        from benchmarks.peers import try_peer
        peer = try_peer(peer_name, q, k, v, causal, "bwd")
    fl = _bench.flops(b, h, s, s, d, causal, "bwd")
    tf, t_peer = interleaved_tflops(calls, peer, fl, rounds, rep, _bench.time_ms)
    # two deterministic calls, the same bits
    first = [cp.empty_like(x) for x in (q, k, v)]
    gpu_bwd.backward(dout, q, k, v, out, lse, *first, mk(True), kernel="sm90")
    call(True, "sm90")()
    same = all(cp.array_equal(x.view(cp.uint16), y.view(cp.uint16)) for x, y in zip(first, grads))
    assert names[(True, "sm90")].endswith("_det") and not names[(False, "sm90")].endswith("_det"), names
    return b, h, tf, t_peer, same


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--no-peer", action="store_true", help="no cuDNN column")
    ap.add_argument("--portable", action="store_true", help="also the portable deterministic kernel")
    ap.add_argument("--orders", default="plan,desc:auto,asc:1",
                    help="deterministic orders to time: plan, desc:auto, asc:1, asc:auto, desc:G ...")
    a = ap.parse_args(argv)
    orders = a.orders.split(",")
    print(_bench.device_line())
    cols = "default " + " ".join(f"{o:>9}" for o in orders) + (" portdet" if a.portable else "") + "   cudnn"
    print(f"bf16 TFLOP/s (bwd = 2.5 x fwd), median of {a.rounds} rounds x {a.rep} calls")
    print(f"{'hd':>3} {'seqlen':>6} {'causal':>6} {'b':>3} {'h':>3} | {cols} | "
          + " ".join(f"{o:>9}" for o in orders) + " (/ default)"
          + (" portdet/default" if a.portable else "") + "  first/cudnn  bits")
    worst = math.inf
    for d in (int(x) for x in a.hdims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in a.seqlens.split(",")):
                b, h, tf, t_peer, same = row(s, d, causal, a.rounds, a.rep,
                                             None if a.no_peer else "cudnn", a.portable, orders)
                ratio = tf[1] / tf[0]
                worst = min(worst, ratio)
                n = len(orders)
                print(f"{d:3d} {s:6d} {str(causal):>6} {b:3d} {h:3d} | "
                      + f"{tf[0]:7.1f} " + " ".join(f"{x:9.1f}" for x in tf[1:n + 1])
                      + "".join(f" {x:7.1f}" for x in tf[n + 1:]) + f" {t_peer:7.1f} | "
                      + " ".join(f"{x / tf[0]:9.3f}" for x in tf[1:n + 1]) + "           "
                      + (f" {tf[n + 1] / tf[0]:15.3f}" if a.portable else "")
                      + f" {tf[1] / t_peer:10.2f}  {'same' if same else 'DIFFER'}", flush=True)
    print(f"worst {orders[0]}/default: {worst:.3f}")


if __name__ == "__main__":
    main()
