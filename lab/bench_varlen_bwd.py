# Question: Where does a varlen backward lose time against the dense backward on the same tokens?
"""Varlen backward beside the dense backward on the same tokens (bf16, hd 128, 16 heads).

Isolates where a varlen backward loses time: equal-length sequences packed as varlen against the
dense call of the same shape (same work: any gap is the varlen kernel's own cost), then the
mixed lengths of bench_bias_varlen.py against the dense call at the longest length (per token).
CUDA events around each whole call, median of the repeats.

    python lab/bench_varlen_bwd.py [--reps 7] [--kernel auto|sm90|portable]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from bench_bias_varlen import D, H, _lengths, _rnd  # noqa: E402
from cupyflash import _bench, _checks  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd


def varlen_ms(lens, causal, kernel, warmup, reps):
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    tot, longest = int(sum(lens)), max(lens)
    q, k, v, dout = (_rnd((1, tot, H, D)) for _ in range(4))
    opts = _checks.make_options(_checks.Dims(len(lens), tot, tot, H, H, D, D), cp, causal=causal)
    out, lse = cp.empty_like(q), cp.empty((H, tot), cp.float32)
    gpu_fwd.forward_varlen(q, k, v, cu, cu, longest, longest, out, lse, opts)
    g = [cp.empty_like(x) for x in (q, k, v)]
    fn = lambda: gpu_bwd.backward_varlen(dout, q, k, v, out, lse, cu, cu, longest, longest,  # noqa: E731
                                          *g, opts, kernel=kernel)
    return _bench.time_ms(fn, warmup, reps), fn()


def dense_ms(b, s, causal, warmup, reps):
    q, k, v, dout = (_rnd((b, s, H, D)) for _ in range(4))
    opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, causal=causal)
    out, lse = cp.empty_like(q), cp.empty((b, H, s), cp.float32)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    g = [cp.empty_like(x) for x in (q, k, v)]
    fn = lambda: gpu_bwd.backward(dout, q, k, v, out, lse, *g, opts)  # noqa: E731
    return _bench.time_ms(fn, warmup, reps), fn()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kernel", default="auto")
    a = ap.parse_args(argv)
    mixed = _lengths()
    cases = [("4x4096", [4096] * 4, (4, 4096)), ("64x256", [256] * 64, (64, 256)),
             ("mixed", mixed, (4, 4096))]
    print("case    causal | varlen ms  Mtok/s | dense ms  Mtok/s | per-token ratio | kernels")
    for name, lens, (b, s) in cases:
        for causal in (False, True):
            tv, kv = varlen_ms(lens, causal, a.kernel, a.warmup, a.reps)
            td, kd = dense_ms(b, s, causal, a.warmup, a.reps)
            mv, md = sum(lens) / tv / 1e3, b * s / td / 1e3
            print(f"{name:7s} {str(causal):6s} | {tv:8.3f} {mv:7.2f} | {td:8.3f} {md:7.2f} |"
                  f" {mv / md:6.3f} | {kv} / {kd}", flush=True)


if __name__ == "__main__":
    main()
