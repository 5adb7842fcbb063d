# Question: Is the bf16x3 split of mma_f32 exact (hi + mid + lo = x), and do three bf16 m16n8k16 on the tf32-layout fragments, packed as common/mma.cuh packs them, give A Bᵀ? (CPU model)
"""CPU model of kernels_cu/common/mma.cuh's default float32 product (no GPU): split_bf16x3 in
NumPy (ml_dtypes.bfloat16, round to nearest even as cvt.rn.bf16x2.f32; lo as the upper half of
the last remainder) and the PTX ISA's bf16 m16n8k16 fragment layout (lane g = lane / 4,
t = lane % 4: A rows g / g + 8 at k 2t, 2t+1 (regs 0, 1) and 2t+8, 2t+9 (regs 2, 3); B at k 2t,
2t+1 (reg 0) and 2t+8, 2t+9 (reg 1)), fed with the portable kernels' tf32-layout fragments
(k pair 2t, 2t + 1 of each 8-column step) packed as mma_f32 packs them. Products and sums of the
model are exact (float64), so this checks the layout and the split, not the tensor cores'
rounding (lab/probe_mma_f32.py does that on a GPU).

    python lab/bf16x3_split_model.py
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def split(x):
    """hi, mid, lo (float32 arrays) of float32 x, as split_bf16x3."""
    x = np.asarray(x, np.float32)
    hi = x.astype(BF16).astype(np.float32)
    r = x - hi                                   # exact in fp32
    mid = r.astype(BF16).astype(np.float32)
    q = r - mid                                  # exact, <= 8 significant bits
    lo = (q.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)   # its upper half
    return hi, mid, lo, q


def mma16816(c, a_regs, b_regs):
    """c [16, 8] += A B for per-lane registers: a_regs[lane] = 4 pairs, b_regs[lane] = 2 pairs."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r in range(4):
            for i in range(2):
                A[g + 8 * (r & 1), 2 * t + i + 8 * (r >> 1)] = a_regs[lane][r][i]
        for r in range(2):
            for i in range(2):
                B[2 * t + i + 8 * r, g] = b_regs[lane][r][i]
    return c + A @ B


def mma_f32(a_mat, b_mat):
    """One k8 step, C [16, 8] = A [16, 8] · B [8 (n), 8 (k)]ᵀ, as mma_f32's bf16x3 branch."""
    c = np.zeros((16, 8))
    parts = {}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        k0, k1 = 2 * t, 2 * t + 1                    # the kernels' pair loads
        a = [a_mat[g, k0], a_mat[g + 8, k0], a_mat[g, k1], a_mat[g + 8, k1]]
        ag = split([a[0], a[2]])[:3]                 # (hi, mid, lo), each a (κ0, κ1) pair
        ag8 = split([a[1], a[3]])[:3]
        b = split([b_mat[g, k0], b_mat[g, k1]])[:3]
        parts[lane] = (ag, ag8, b)
    hi, mid, lo = 0, 1, 2
    for a_x, a_y, b_u, b_v in ((lo, hi, hi, lo), (hi, mid, mid, hi), (hi, mid, hi, mid)):
        a_regs = [[p[0][a_x], p[1][a_x], p[0][a_y], p[1][a_y]] for p in (parts[ln] for ln in range(32))]
        b_regs = [[parts[ln][2][b_u], parts[ln][2][b_v]] for ln in range(32)]
        c = mma16816(c, a_regs, b_regs)
    return c


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-60, 60, 200_000))).astype(np.float32)
    hi, mid, lo, q = split(x)
    exact_lo = bool((lo == q).all())
    exact_sum = bool((hi.astype(np.float64) + mid + lo == x.astype(np.float64)).all())
    bad += not (exact_lo and exact_sum)
    print(f"split of 200000 floats over 120 binades: lo exact {exact_lo}, hi + mid + lo == x {exact_sum}")
    worst = 0.0
    for _ in range(200):
        a = rng.standard_normal((16, 8)).astype(np.float32)
        b = rng.standard_normal((8, 8)).astype(np.float32)
        exact = a.astype(np.float64) @ b.astype(np.float64).T
        scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T
        worst = max(worst, float((np.abs(mma_f32(a, b) - exact) / scale).max()))
    ok = worst <= 2.0**-23
    bad += not ok
    print(f"three m16n8k16 on the packed fragments vs A Bᵀ, 200 draws: max |err| / Σ|a||b| = "
          f"{worst:.2e} (2^{np.log2(worst):.1f}; the dropped products' bound is about 2^-23)")
    print("bf16x3_split_model:", "OK" if bad == 0 else "FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
