# Question: Which hd 128 float32 backward candidate fits shared memory and registers, at what traffic? (arithmetic)
"""Shared-memory / register / traffic arithmetic of the hd 128 float32 backward candidates
(docs/f32-backward-design.md, "Design T (hd 128)"). Pure arithmetic, no GPU; never run against a kernel.

    python lab/f32_bwd_budget_hd128.py

Units: bytes; one "step" of every candidate is 2.62 MFLOP counted (5 products x 2 x keys x
queries x d), the same as design S's hd 64 step (32 queries x 128 keys x 64), so the hd 64
kernel's measured ~8,800 clocks per step at ~80 TFLOP/s calibrates: TFLOP/s ~ 80 x 8800 / clocks.
"""
F = 4
LIMIT = 232_448 - 1024 - 512     # opt-in, minus alignment, minus barriers / rows / tile ring
KB = 1024


def t(rows, cols, parts=1):
    return rows * cols * F * parts


def show(name, items):
    tot = sum(items.values())
    print(f"{name}: {tot:,} B = {tot / KB:.0f} KB -> {'fits' if tot <= LIMIT else 'does NOT fit'}")
    for k, v in items.items():
        print(f"    {k:55s} {v / KB:6.0f} KB")


d, bm = 128, 32
show("S at hd 128 (BN 128, BM 32, as built)", {
    "K big + small, V big [128, 128]": t(128, d, 3),
    "Q, dO big + small [32, 128]": t(bm, d, 4),
    "Qt, dOt big + small [128, 32]": t(bm, d, 4),
    "raw landing x2 stages": t(bm, d, 4),
    "dS big + small per consumer x2": t(bm, 64, 4),
})
show("(a) d-split passes, BN 128, K/V raw (split on the fly), one landing stage", {
    "K, V raw [128, 128]": t(128, d, 2),
    "Q, dO big + small [32, 128] (full d: S^T, dP^T)": t(bm, d, 4),
    "Qt_h, dOt_h big + small [64, 32] (this pass's half)": t(bm, 64, 4),
    "raw landing x1": t(bm, d, 2),
    "dS big + small per consumer x2": t(bm, 64, 4),
})
show("(a') d-split, BN 64, both halves at once (two consumers, S^T/dP^T twice)", {
    "K big + small, V raw": t(64, d, 3),
    "Q, dO big + small": t(bm, d, 4),
    "Qt, dOt big + small (both halves)": t(bm, d, 4),
    "raw landing x1": t(bm, d, 2),
    "dS big + small (shared)": t(bm, 64, 2),
})
show("(b) kernel 1 (dK, dV), BN 64, role split, transposed outputs, K/V raw", {
    "K, V raw [64, 128]": t(64, d, 2),
    "Q, dO big + small [32, 128]": t(bm, d, 4),
    "P^T, dS^T big + small [64 keys][32 q]": t(64, bm, 4),
    "raw landing x1": t(bm, d, 2),
})
show("(b) kernel 2 (dQ), 128 queries (2 x 64), BN 32 keys per step, one stage", {
    "Q, dO raw [128, 128] (A operands split on the fly)": t(128, d, 2),
    "K, V big + small [32, 128], Kt big + small [128, 32]": t(32, d, 6),
})
show("T (recommended): BN 64, role split, transposed dK/dV, K/V raw, BM 32", {
    "K raw [64, 128]": t(64, d),
    "V raw [64, 128]": t(64, d),
    "Q big + small [32, 128]": t(bm, d, 2),
    "dO big + small [32, 128]": t(bm, d, 2),
    "P^T big + small [64 keys][32 q] (B of dV^T)": t(64, bm, 2),
    "dS^T big + small [64 keys][32 q] (B of dK^T)": t(64, bm, 2),
    "dS big + small [32 q][64 keys] (B of dQ^T)": t(bm, 64, 2),
    "raw landing Q, dO x1 stage": t(bm, d, 2),
})
show("T with K big + small stored (no on-the-fly split of K)", {
    "K big + small, V raw": t(64, d, 3),
    "Q, dO big + small": t(bm, d, 4),
    "P^T, dS^T, dS big + small": t(64, bm, 6),
    "raw landing x1": t(bm, d, 2),
})

# T: shared-memory traffic per step (64 keys x 32 queries x hd 128), bytes
B_N32, B_N64 = 8 * 32 * F, 8 * 64 * F          # B operand bytes of one m64n32k8 / m64n64k8
traffic = {
    "S^T  (c0) 16 k-steps x 3 RS m64n32k8, B reads": 48 * B_N32,
    "dP^T (c1) same": 48 * B_N32,
    "dV^T_h, dK^T_h: 2 consumers x 2 x 12 RS m64n64k8": 4 * 12 * B_N64,
    "dQ^T_h: 2 consumers x 24 RS m64n32k8": 2 * 24 * B_N32,
    "A loads: K raw (S^T) + V raw (dP^T)": t(64, d, 2),
    "A loads: dOt_h, Qt_h big + small, both consumers": 2 * t(64, bm, 4),
    "A loads: Kt_h raw, both consumers": 2 * t(64, 64),
    "stores P^T, dS^T, dS (big + small); P read by c1": t(64, bm, 6) + t(64, bm, 2),
    "TMA Q, dO raw": t(bm, d, 2),
    "converters: read raw, write Q, dO big + small": t(bm, d, 2) + t(bm, d, 4),
}
tot = sum(traffic.values())
print(f"\nT: shared-memory bytes per step {tot / KB:.0f} KB = {tot / 128:,.0f} clocks at 128 B/clk")
for k, v in traffic.items():
    print(f"    {k:55s} {v / KB:6.0f} KB")
tensor = 2 * 48 * 18.5 + 4 * 12 * 32 + 2 * 24 * 18.5
print(f"T: tensor clocks per step {tensor:,.0f} (RS m64n32k8 at the measured 18.5, m64n64k8 at 32); "
      f"ideal 3,840")
for clocks in (8800, 9500, 10500, 11500):
    print(f"    {clocks:6d} clocks / step -> {80 * 8800 / clocks:5.1f} TFLOP/s")
