# Question: How accurate are the float32 backward kernels against float64 at long sequences?
"""Accuracy of the float32 backward at long sequences: the Hopper kernel (hopper/bwd_f32.cu, forced
with kernel="sm90") and the portable one (portable/bwd.cu) against reference.py's float64 backward, per
gradient: norm-wise relative error ||g - ref|| / ||ref|| and max error / max(1, max|ref|) (the GPU
tests' float32 criterion: <= 5e-5). Inputs standard normal, scale 1/sqrt(d), one batch, two heads.

    python lab/f32_bwd_accuracy.py --seqlens 1024 4096 --causal both
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import reference  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd
from cupyflash._options import Options  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    d, h = args.head_dim, 2
    print(f"{'seqlen':>6} {'causal':>6} {'kernel':>8} | " + " ".join(
        f"{g + ' norm':>9} {g + ' max':>9}" for g in ("dq", "dk", "dv")))
    for s in args.seqlens:
        for causal in {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]:
            qn, kn, vn, don = (rng.standard_normal((1, s, h, d), dtype=np.float32) for _ in range(4))
            ref = reference.attention_backward(don, qn, kn, vn, causal=causal)
            q, k, v, dout = (cp.asarray(x) for x in (qn, kn, vn, don))
            out, lse = cp.empty_like(q), cp.empty((1, h, s), cp.float32)
            opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
            gpu_fwd.forward(q, k, v, out, lse, opts)
            for kernel in ("sm90", "portable"):
                g = [cp.full_like(q, cp.nan) for _ in range(3)]
                try:
                    gpu_bwd.backward(dout, q, k, v, out, lse, *g, opts, kernel=kernel)
                except ValueError as e:
                    print(f"{s:>6} {'yes' if causal else 'no':>6} {kernel:>8} | {e}")
                    continue
                cells = []
                for a, r in zip(g, ref[:3]):
                    a = cp.asnumpy(a).astype(np.float64)
                    cells.append(np.linalg.norm(a - r) / np.linalg.norm(r))
                    cells.append(np.abs(a - r).max() / max(1.0, np.abs(r).max()))
                print(f"{s:>6} {'yes' if causal else 'no':>6} {kernel:>8} | "
                      + " ".join(f"{c:9.2e}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
