# Question: Which float32 Hopper backward layout fits shared memory and registers, and what is its clock budget per step? (arithmetic)
"""Budget model of a float32 (3xTF32) Hopper backward: shared memory, registers, tensor-core and
shared-memory clocks per step, for the layouts discussed in docs/f32-backward-design.md.

    python lab/f32_bwd_budget.py          # the tables of the design document

Pure arithmetic, no GPU. Assumptions (per SM, stated in the document):
* wgmma TF32 dense: 1024 FMA / clock / SM (H100/H200: ~495 TFLOP/s at ~1.83 GHz, 132 SMs), so an
  m64nNk8 product takes N / 2 clocks; 3xTF32 takes three of them per k-step.
* shared memory: 128 bytes / clock / SM for everything (wgmma operand reads, TMA writes, ld/st).
  A shared-memory operand is read once per wgmma instruction: A [64, 8] = 2 KB, B [8, N] = 32·N B.
* 232,448 bytes of shared memory per block (opt-in), 65,536 registers per SM.
"""
from __future__ import annotations

SMEM_MAX = 232_448
F = 4   # bytes per float


def wgmma_clk(n: int) -> float:
    """Clocks of one m64nNk8 TF32 product at peak."""
    return n / 2


def gemm(m_rows: int, n: int, k: int, a_smem_passes: int, b_passes: int = 3, passes: int = 3):
    """(tensor clocks, shared-memory bytes) of one 3xTF32 GEMM [m_rows (multiple of 64), n] over k:
    ``a_smem_passes`` of the 3 passes read A from shared memory (the others from registers)."""
    steps = (m_rows // 64) * (k // 8)
    clk = steps * passes * wgmma_clk(n)
    byts = steps * (a_smem_passes * 64 * 8 * F + b_passes * 8 * n * F)
    return clk, byts


def design_s(d=64, bn=128, bm=32, k_small_smem=True, v_small_reg=True):
    """The chosen single-kernel design S (per block of two 64-key consumers, per step of bm
    query rows); returns a dict of shared-memory bytes, clocks and traffic."""
    nc = bn // 64
    lay = {
        "k_big [BN, D]": bn * d * F,
        "k_small [BN, D]": bn * d * F if k_small_smem else 0,
        "v_big [BN, D]": bn * d * F,
        "v_small [BN, D]": 0 if v_small_reg else bn * d * F,
        "q / do big + small [BM, D] x 4": 4 * bm * d * F,
        "qT / doT big + small [D, BM] x 4": 4 * bm * d * F,
        "q / do raw landing [BM, D] x 2": 2 * bm * d * F,
        "dS big + small [BM, 64] per consumer": nc * 2 * bm * 64 * F,
        "dQ partial [BM, D] per consumer": nc * bm * d * F,
        "lse, D rows [BM] x 2": 2 * bm * F,
    }
    total = sum(lay.values())
    # per consumer (64 keys), per step
    g1 = gemm(64, bm, d, a_smem_passes=3 if k_small_smem else 2)     # S^T = K Q^T (SS, SS, SS|RS)
    g2 = gemm(64, bm, d, a_smem_passes=2 if v_small_reg else 3)      # dP^T = V dO^T (SS, SS, RS)
    g3 = gemm(64, d, bm, a_smem_passes=0)                            # dV += P^T dO   (RS)
    g4 = gemm(64, d, bm, a_smem_passes=0)                            # dK += dS^T Q   (RS)
    g5 = gemm(d, bm, 64, a_smem_passes=0)                            # dQ^T part = K^T dS^T (RS)
    clk = nc * sum(g[0] for g in (g1, g2, g3, g4, g5))
    wg_bytes = nc * sum(g[1] for g in (g1, g2, g3, g4, g5))
    other = {
        "TMA q, dO raw": 2 * bm * d * F,
        "converters: read raw, write big, small, T big, T small": 2 * bm * d * F * 5,
        "consumers: dS big + small stores": nc * 2 * bm * 64 * F,
        "consumers: K^T fragment loads (big + small)": nc * 2 * 64 * d * F,
        "dQ partial stores + bulk reduce reads": nc * 2 * bm * d * F,
    }
    smem_clk = (wg_bytes + sum(other.values())) / 128
    flops = 5 * 2 * bn * bm * d          # counted (useful) FLOPs of the step
    return dict(layout=lay, smem_total=total, fits=total + 1024 <= SMEM_MAX, tensor_clk=clk,
                wgmma_bytes=wg_bytes, other_bytes=other, smem_clk=smem_clk,
                g1_bytes_per_clk=g1[1] / g1[0], g2_bytes_per_clk=g2[1] / g2[0],
                flops=flops)


def registers_s(d=64, bm=32):
    """Accumulator / fragment registers per consumer lane (fp32 or TF32 words) of design S."""
    perm = {"dK [64, D]": d // 2, "dV [64, D]": d // 2, "V small A fragments [64, D]": d // 2}
    step = {"S^T [64, BM]": bm // 2, "dP^T [64, BM]": bm // 2,
            "P small (big in place of S^T)": bm // 2, "dS small (big in place of dP^T)": bm // 2}
    dq = {"K^T A fragments big + small [D, 64 keys]": 64, "dQ^T [D, BM]": bm // 2}
    return perm, step, dq


def alternatives():
    """Shared memory of the layouts considered (bytes, before barriers / alignment)."""
    out = []
    for d in (64, 128):
        for bn, bm in ((128, 64), (128, 32), (64, 64), (64, 32)):
            tile_ss = 6 * bn * d * F          # K, V, K^T (big + small each) all in shared memory
            step = 8 * bm * d * F             # Q, dO natural + transposed, big + small
            ds = 2 * bm * bn * F
            dq = bm * d * F
            out.append((d, bn, bm, "one kernel, all operands in smem", tile_ss + step + ds + dq))
            # K^T from registers (per-step fragment loads), V small in registers
            tile_s = 3 * bn * d * F
            out.append((d, bn, bm, "design S (K^T frags, V small in regs, raw landing)",
                        tile_s + step + 2 * bm * d * F + ds + (bn // 64) * dq))
            # dK/dV kernel of a two-kernel split (no dS / K^T / dQ), K, V parts in smem
            out.append((d, bn, bm, "two kernels: dK/dV kernel", 4 * bn * d * F + step))
    return out


def main():
    s = design_s()
    print("design S, hd 64, BN 128 (two 64-key consumers), BM 32, one step buffer + raw landing")
    for k, v in s["layout"].items():
        print(f"  {k:45s} {v:8d} B")
    print(f"  {'total':45s} {s['smem_total']:8d} B (+1024 alignment; limit {SMEM_MAX}): "
          f"{'fits' if s['fits'] else 'does NOT fit'}")
    print(f"  tensor clocks per step (both consumers): {s['tensor_clk']:.0f}")
    print(f"  wgmma operand bytes per step: {s['wgmma_bytes']}")
    for k, v in s["other_bytes"].items():
        print(f"  other smem bytes: {k:50s} {v:8d}")
    print(f"  shared-memory clocks per step: {s['smem_clk']:.0f}"
          f"  (S^T: {s['g1_bytes_per_clk']:.0f} B/clk, dP^T: {s['g2_bytes_per_clk']:.0f} B/clk while they run)")
    bound = max(s["tensor_clk"], s["smem_clk"])
    print(f"  ceiling: {s['tensor_clk'] / bound:.0%} of the three-pass peak"
          f" = {165 * s['tensor_clk'] / bound:.0f} TFLOP/s (counted FLOPs)")
    perm, step, dq = registers_s()
    print("registers per consumer lane:", sum(perm.values()), "held,", sum(step.values()),
          "per step (P / dS phase),", sum(dq.values()), "in the dQ phase ->",
          sum(perm.values()) + max(sum(step.values()), sum(dq.values())), "at the peak")
    print("\nalternatives (shared memory bytes; limit", SMEM_MAX, ")")
    for d, bn, bm, what, b in alternatives():
        print(f"  hd {d:3d} BN {bn:3d} BM {bm:2d}  {what:55s} {b:8d} {'fits' if b + 1024 <= SMEM_MAX else '-'}")


if __name__ == "__main__":
    main()
