# Question: How does the float32 forward's error against float64 grow with the number of keys?
"""float32 forward error against a float64 reference as the number of keys grows (H200 check).

For s_k in --seqlens: q [1, 512, 2, d] (512 query rows keep the float64 reference small),
k, v [1, s_k, 2, d], random normal; prints the norm-wise relative error of out
(||out - ref|| / ||ref||) and the max abs error of out relative to max |ref|, for the portable
kernel and the Hopper float32 kernel (kernel="sm90"), both 3xTF32. The reference is the float64
computation on the GPU (CuPy). Usage: python lab/f32_error_growth.py [--seqlens ...]
"""
from __future__ import annotations

import argparse
import math

import cupy as cp

from cupyflash.gpu import fwd as gpu_fwd
from cupyflash._options import Options


def reference(q, k, v, scale, causal):
    """float64 attention out [b, s_q, h, d] (bottom-right causal when ``causal``)."""
    qt, kt, vt = (x.astype(cp.float64).transpose(0, 2, 1, 3) for x in (q, k, v))
    s = cp.matmul(qt, kt.swapaxes(-1, -2)) * scale
    if causal:
        s_q, s_k = s.shape[-2:]
        i = cp.arange(s_q)[:, None] + (s_k - s_q)
        s = cp.where(cp.arange(s_k)[None, :] <= i, s, -cp.inf)
    s = s - s.max(-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(-1, keepdims=True)
    return cp.matmul(p, vt).transpose(0, 2, 1, 3)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    a = ap.parse_args(argv)
    rs = cp.random.RandomState(1)
    print(" hd   s_k causal | kernel                          rel (norm)   max/max|ref|")
    for d in a.head_dims:
        for s_k in a.seqlens:
            for causal in (False, True):
                q = rs.standard_normal((1, 512, 2, d), dtype=cp.float32)
                k = rs.standard_normal((1, s_k, 2, d), dtype=cp.float32)
                v = rs.standard_normal((1, s_k, 2, d), dtype=cp.float32)
                scale = 1 / math.sqrt(d)
                ref = reference(q, k, v, scale, causal)
                opts = Options(scale=scale, window_left=-1, window_right=0 if causal else -1)
                for kernel in ("portable", "sm90"):
                    out = cp.full(q.shape, cp.nan, cp.float32)
                    lse = cp.empty((1, 2, 512), cp.float32)
                    name = gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kernel)
                    err = out.astype(cp.float64) - ref
                    rel = float(cp.linalg.norm(err) / cp.linalg.norm(ref))
                    mx = float(cp.abs(err).max() / cp.abs(ref).max())
                    print(f"{d:3d} {s_k:5d} {str(causal):6s} | {name:31s} {rel:10.2e} {mx:12.2e}")


if __name__ == "__main__":
    main()
