"""CPU (NumPy) model of the float32 Hopper forward's shared-memory index math
(kernels_cu/hopper/fwd_f32.cu), checked without a GPU:

* the 128-byte swizzle as TMA writes it and wgmma reads it (16-byte chunk index XOR the row's
  index mod 8 inside each 1024-byte block: address bits 4-6 XOR bits 7-9);
* the converters' V transposition (``transpose_v``): every (key, column) of the raw V tile lands
  once in Vᵀ, with keys permuted inside each 8-key step (key 2c -> slot c, key 2c + 1 -> slot
  c + 4), and every 8-lane shared-memory phase of its loads and stores hits 8 distinct 16-byte
  bank groups;
* O += P V as the consumers issue it: A fragments taken from the S accumulator registers
  (``pack_p``: {s[4kk], s[4kk+2], s[4kk+1], s[4kk+3]}) in CUTLASS's m64nNk8 register layout for
  32-bit A (ALayout_64x8), B = Vᵀ read K-major through the descriptor (start + (kk/4)·panel +
  (kk%4)·32 bytes, rows of 128 bytes) — the model's product must equal P @ V;
* S = Q Kᵀ with both operands K-major from the TMA-swizzled panels;
* the 3xTF32 split (round to nearest, ties away, 10 mantissa bits) recovers float32 products.

The formulas below are the kernel's, transcribed; the layouts of the hardware side (accumulator,
A fragment, swizzle) are the PTX ISA's / CUTLASS's.
"""
from __future__ import annotations

import numpy as np
import pytest


def swz(addr):
    """Physical byte address of a logical one under the 128-byte swizzle (1024-aligned base)."""
    addr = np.asarray(addr)
    return addr ^ (((addr >> 7) & 7) << 4)


def tma_store(smem, base, tile):
    """TMA box writes of a [rows, cols] float32 tile as cols / 32 panels of [rows, 32]."""
    rows, cols = tile.shape
    for c in range(cols):
        for r in range(rows):
            off = base + (c // 32) * rows * 128 + r * 128 + (c % 32) * 4
            smem[swz(off) // 4] = tile[r, c]


def staged_q_k(BM, BN, D, seed):
    """Random Q [BM, D], K [BN, D] and their TMA-stored shared-memory images (flat float arrays)."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((BM, D))
    K = rng.standard_normal((BN, D))
    qs = np.zeros(BM * D)
    ks = np.zeros(BN * D)
    tma_store(qs, 0, Q)
    tma_store(ks, 0, K)
    return Q, K, qs, ks


def acc_pos(t, i):
    """(row, col) of accumulator register i of lane t (0..127) in an m64nN fp32 accumulator."""
    return (16 * (t // 32) + (t % 32) // 4 + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * (t % 4) + (i % 2))


def a_frag_pos(t, v):
    """(row, k) of register v (0..3) of lane t in the m64nNk8 32-bit A fragment (CUTLASS
    ALayout_64x8: Shape ((4, 8, 4), (2, 2)), Stride ((64, 1, 16), (8, 256)) over m + 64·k)."""
    return (t % 32) // 4 + 16 * (t // 32) + 8 * (v % 2), t % 4 + 4 * (v // 2)


def transpose_items(BN, D, threads=96):
    """The converters' work items, as hopper/fwd_f32.cu's transpose_v walks them: per item the
    lane, 4 (load address, key, column) triples and 4 x 4 (store address, key, column)."""
    KV_PANEL, VT_PANEL = BN * 128, D * 128
    items = BN * D // 16
    out = []
    for cu in range(threads):
        for it, i in enumerate(range(cu, items, threads)):
            b, o = i % 8, i // 8
            rot, dc0, kgq = o % 4, (o // 4) % 2, (o // 8) % (BN // 32)
            dcq = o // (8 * (BN // 32))
            par, q4 = b & 1, b >> 1
            dc8 = dc0 + 2 * ((q4 + rot) & 3)
            kg = 4 * kgq + q4
            loads = []
            for ii in range(4):
                r = 8 * kg + par + 2 * ii
                loads.append((dcq * KV_PANEL + r * 128 + ((dc8 ^ (r % 8)) * 16), r, 4 * (8 * dcq + dc8)))
            pc = 2 * q4 + par
            stores = []
            for e in range(4):
                d = 4 * (8 * dcq + dc8) + e
                off = kgq * VT_PANEL + d * 128 + ((pc ^ (d % 8)) * 16)
                stores.append((off, [8 * kg + par + 2 * ii for ii in range(4)], d))
            out.append((cu, it, loads, stores))
    return out


CASES = [(64, 64), (32, 128), (64, 128), (128, 64), (96, 64)]   # (BN, D)


@pytest.mark.parametrize("BN,D", CASES)
def test_transpose_covers_and_has_no_bank_conflicts(BN, D):
    items = transpose_items(BN, D)
    seen = np.zeros((BN, D), int)
    for _, _, loads, stores in items:
        for _, keys, d in stores:
            for k in keys:
                seen[k, d] += 1
    assert (seen == 1).all()
    # 8-lane phases of one warp instruction: lanes 8m .. 8m + 7 at the same loop iteration
    by_phase = {}
    for cu, it, loads, stores in items:
        by_phase.setdefault((cu // 8, it), []).append((loads, stores))
    for lanes in by_phase.values():
        if len(lanes) < 2:
            continue
        for j in range(4):
            chunks = {(ld[j][0] % 128) // 16 for ld, _ in lanes}
            assert len(chunks) == len(lanes), "bank conflict in the V loads"
            chunks = {(st[j][0] % 128) // 16 for _, st in lanes}
            assert len(chunks) == len(lanes), "bank conflict in the Vᵀ stores"


@pytest.mark.parametrize("BN,D", CASES)
def test_pv_product_through_the_layouts(BN, D):
    rng = np.random.default_rng(0)
    V = rng.standard_normal((BN, D))
    P = rng.random((64, BN))
    # raw V by TMA, then the converters' loads / stores (physical addresses, already swizzled)
    raw = np.full(BN * D, np.nan)
    tma_store(raw, 0, V)
    vt = np.full(BN * D, np.nan)
    for _, _, loads, stores in transpose_items(BN, D):
        vals = {}
        for addr, r, c0 in loads:
            for e in range(4):
                got = raw[addr // 4 + e]
                assert got == V[r, c0 + e], "load reads the wrong element"
                vals[(r, c0 + e)] = got
        for addr, keys, d in stores:
            for ii, k in enumerate(keys):
                vt[addr // 4 + ii] = vals[(k, d)]
    assert not np.isnan(vt).any()
    # S accumulator registers of each lane (P in place), then pack_p's fragment order
    s_acc = np.zeros((128, BN // 2))
    for t in range(128):
        for i in range(BN // 2):
            s_acc[t, i] = P[acc_pos(t, i)]
    O = np.zeros((64, D))
    for kk in range(BN // 8):
        # A [64, 8] of this k-step as the hardware sees the registers
        A = np.full((64, 8), np.nan)
        for t in range(128):
            a = [s_acc[t, 4 * kk], s_acc[t, 4 * kk + 2], s_acc[t, 4 * kk + 1], s_acc[t, 4 * kk + 3]]
            for v in range(4):
                A[a_frag_pos(t, v)] = a[v]
        assert not np.isnan(A).any()
        # B [8, D]: Vᵀ K-major through the descriptor: start + n·128 + 4k, swizzled
        start = (kk // 4) * D * 128 + (kk % 4) * 32
        B = np.array([[vt[swz(start + n * 128 + 4 * k) // 4] for n in range(D)] for k in range(8)])
        O += A @ B
    np.testing.assert_allclose(O, P @ V, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("BN,D", CASES)
def test_s_product_through_the_layouts(BN, D):
    BM = 128
    Q, K, qs, ks = staged_q_k(BM, BN, D, seed=1)
    for cw in range(BM // 64):
        S = np.zeros((64, BN))
        for kk in range(D // 8):
            qa = cw * 64 * 128 + (kk // 4) * BM * 128 + (kk % 4) * 32
            ka = (kk // 4) * BN * 128 + (kk % 4) * 32
            A = np.array([[qs[swz(qa + m * 128 + 4 * k) // 4] for k in range(8)] for m in range(64)])
            B = np.array([[ks[swz(ka + n * 128 + 4 * k) // 4] for n in range(BN)] for k in range(8)])
            S += A @ B
        np.testing.assert_allclose(S, Q[64 * cw:64 * cw + 64] @ K.T, rtol=1e-12, atol=1e-12)


def tf32_rna(x):
    """cvt.rna.tf32.f32: keep 10 mantissa bits, round to nearest, ties away from zero."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x1000) & 0xFFFFE000
    return b.astype(np.uint32).view(np.float32)


def test_3xtf32_split_products():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((256, 64)).astype(np.float32)
    ab, bb = tf32_rna(a), tf32_rna(b)
    a_s, b_s = tf32_rna(a - ab), tf32_rna(b - bb)
    f64 = np.float64
    ref = a.astype(f64) @ b.astype(f64)
    three = a_s.astype(f64) @ bb.astype(f64) + ab.astype(f64) @ b_s.astype(f64) + ab.astype(f64) @ bb.astype(f64)
    one = ab.astype(f64) @ bb.astype(f64)
    rel = lambda x: np.linalg.norm(x - ref) / np.linalg.norm(ref)   # noqa: E731
    assert rel(three) < 1e-6 < 1e-4 < rel(one)


def split_q_addresses(D, BM, cw, kk, t):
    """QREG: hopper/fwd_f32.cu's split_q, the byte offsets (from q_smem) of lane t's A fragment
    a[e], e = 0..3, of k-step kk in consumer cw's 64 rows."""
    Q_PANEL = BM * 128
    row_in_wg = (t // 32) * 16 + (t % 32) // 4
    out = []
    for e in range(4):
        r, x = row_in_wg + 8 * (e % 2), 8 * kk + t % 4 + 4 * (e // 2)
        out.append(cw * 64 * 128 + (x // 32) * Q_PANEL + r * 128 + 16 * (((x % 32) // 4) ^ (r % 8))
                   + 4 * (x % 4))
    return out


@pytest.mark.parametrize("D", [64, 128])
def test_split_q_fragments_and_s_product(D):
    """QREG: the consumers' Q fragments read Q(r, 8kk + c) etc. from the TMA-swizzled tile, touch
    each of their 64 rows' elements once (in place), without bank conflicts, and
    q_small·k_big through them (A from registers, K-major K from shared memory) is Q Kᵀ."""
    BM, BN = 128, 32
    Q, K, qs, ks = staged_q_k(BM, BN, D, seed=3)
    for cw in range(BM // 64):
        touched = np.zeros(BM * D, int)
        S = np.zeros((64, BN))
        for kk in range(D // 8):
            A = np.full((64, 8), np.nan)
            addrs = [split_q_addresses(D, BM, cw, kk, t) for t in range(128)]
            for t in range(128):
                for v, a in enumerate(addrs[t]):
                    touched[a // 4] += 1
                    A[a_frag_pos(t, v)] = qs[a // 4]
            for w in range(4):   # one warp's 32 lanes per (kk, e): 32 distinct banks
                for v in range(4):
                    assert len({(addrs[t][v] // 4) % 32 for t in range(32 * w, 32 * w + 32)}) == 32
            ka = (kk // 4) * BN * 128 + (kk % 4) * 32
            B = np.array([[ks[swz(ka + n * 128 + 4 * k) // 4] for n in range(BN)] for k in range(8)])
            S += A @ B
        np.testing.assert_allclose(S, Q[64 * cw:64 * cw + 64] @ K.T, rtol=1e-12, atol=1e-12)
        rows = np.zeros(BM * D, int)
        for r in range(64 * cw, 64 * cw + 64):
            for c in range(D):
                rows[swz((c // 32) * BM * 128 + r * 128 + (c % 32) * 4) // 4] = 1
        np.testing.assert_array_equal(touched, rows)
