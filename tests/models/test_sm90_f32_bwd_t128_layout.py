"""CPU (NumPy) models of the hd 128 path of the float32 Hopper backward (design T:
kernels_cu/hopper/bwd_f32.cu, its roles in hopper/bwd_f32_*.cuh), checked without a GPU. Every
address below is the kernel's own expression transcribed (swz, key_of_slot, slot_of_key, t_off,
the fragment and accumulator positions); the wgmma reads of B go through the descriptor
(start + n·128 + 4·k, 128-byte swizzle):

* the shared-memory map (LayoutT) against its Python mirror and the 232,448-byte limit;
* one whole step of both consumers on random data: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ with A split on the
  fly from the raw K / V tiles (B = the Q / dO parts, split in place where TMA landed them), c0's
  Pᵀ stores and c1's read-back at the same places, c1's dSᵀ and dS stores, the transposed products
  dVᵀ_h = dOᵀ_h P and dKᵀ_h = Qᵀ_h dS (A fragments loaded from the raw Q / dO copies as 8-byte
  column pairs, queries in slot order, split on the fly; rows relabelled), and
  dQᵀ_h = Kᵀ_h dSᵀ (Kᵀ_h split on the fly from raw K), against float64 products: the d-half
  ownership (consumer h: columns 64h ..) and every relabelling;
* the stores: every (key, column) of dK, dV and every (query, column) of dq written / added
  exactly once over the two consumers, in adjacent 8-byte-aligned pairs; bank conflicts of the
  new shared-memory accesses;
* (the work decomposition with 64-key tiles: test_sm90_f32_bwd_layout.py, per head dim).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cupyflash.gpu import plan_bwd_sm90_f32

from test_sm90_f32_bwd_layout import key_of_slot, slot_of_key
from test_sm90_f32_layout import a_frag_pos, acc_pos, swz, tma_store

ROOT = Path(__file__).resolve().parents[2]
D, BM = 128, plan_bwd_sm90_f32.BM
BN = plan_bwd_sm90_f32.BN_OF[D]          # 64 keys per work tile
DH = D // 2                 # columns per consumer
KV_PANEL, Q_PANEL, DS_PANEL = BN * 128, BM * 128, BM * 128


def layout_t(d=D):
    """sm90bf::LayoutT<128> of hopper/bwd_f32.cu, transcribed."""
    kvt, qt, pt = BN * d * 4, BM * d * 4, BN * BM * 4
    off, o = {}, 0
    for name, size in (("KR", kvt), ("VR", kvt), ("QB", qt), ("QS", qt), ("DOB", qt), ("DOS", qt),
                       ("RQ", qt), ("RDO", qt), ("PTB", pt), ("PTS", pt), ("DSTB", pt),
                       ("DSTS", pt), ("DSB", pt), ("DSS", pt), ("ROWS", 2 * 2 * BM * 4), ("TILE", 16),
                       ("BARS", 8 * 15)):
        off[name] = o
        o += size
    off["BYTES"] = o
    return off


def kswz(row, col, panel):
    """hopper/bwd_f32.cu's swz(row, col, panel): byte offset in a [rows, 32·k] swizzled tile."""
    return (col // 32) * panel + row * 128 + ((((col % 32) // 4) ^ (row % 8)) << 4) + 4 * (col % 4)


def lane(t):
    """(row_in_wg, c4, col_in_8, g) of consumer lane t (0..127)."""
    g, c4 = (t % 32) // 4, t % 4
    return 16 * (t // 32) + g, c4, 2 * c4, g


def d0_of(t, cw):
    return DH * cw + 16 * (t // 32) + 2 * ((t % 32) // 4)


def d_of_row(m, cw):
    """Row m of a transposed product's M (fragment / accumulator rows) -> column of D."""
    w, i = m // 16, m % 16
    return DH * cw + 16 * w + 2 * (i % 8) + i // 8


def t_off(t, i):
    """The kernel's t_off(i): accumulator register i's place in the Pᵀ / dSᵀ tile [BN][BM slots]."""
    row_in_wg, _, col_in_8, _ = lane(t)
    return kswz(row_in_wg + (8 if i % 4 >= 2 else 0), slot_of_key((i // 4) * 8 + col_in_8 + i % 2), 0)


def split(x):
    """A big / small split whose big part keeps 10 fractional bits (a stand-in for tf32_rn: the
    model checks which part goes where; the small·small term the products drop is < 1e-6)."""
    big = np.round(x * 1024) / 1024
    return big, x - big


def b_tile(flat, start, n_rows):
    """The [8, n_rows] B operand of one k-step that a K-major 128-byte-swizzle descriptor at byte
    ``start`` reads from the flat float array ``flat`` (rows of 128 bytes: n, k = 0..7)."""
    return np.array([[flat[swz(start + n * 128 + 4 * k) // 4] for n in range(n_rows)] for k in range(8)])


def conflicts(word_addrs):
    """Largest number of distinct 4-byte words of one warp access that share a bank."""
    words = sorted(set(word_addrs))
    return max(np.bincount([w % 32 for w in words], minlength=32))


def test_layout_fits_and_matches_the_mirror():
    off = layout_t()
    assert off["BYTES"] + 1024 == plan_bwd_sm90_f32.smem_bytes(D) == plan_bwd_sm90_f32.Sm90F32BwdVariant(D, True).smem_bytes
    assert plan_bwd_sm90_f32.smem_bytes(D) <= 232_448
    for name in ("KR", "VR", "QB", "QS", "DOB", "DOS", "RQ", "RDO", "PTB", "PTS", "DSTB", "DSTS",
                 "DSB", "DSS"):
        assert off[name] % 1024 == 0, name   # swizzled panels, descriptors, TMA: 1024-byte aligned
    # the kernel takes the small part at big + QT
    assert off["QS"] == off["QB"] + BM * D * 4 and off["DOS"] == off["DOB"] + BM * D * 4


def test_barrier_slots_match_the_kernel():
    """LayoutT's 15 mbarrier slots: Layout's up to t_empty (one landing stage: 13 of them) and
    the two of the Pᵀ handoff between the consumers (pt_full, pt_empty after t_empty); the dSᵀ /
    dS handoff goes through the named barriers DS_FULL, DS_EMPTY. As the kernel's text declares
    them."""
    hopper = ROOT / "kernels_cu" / "hopper"
    layout = (hopper / "bwd_f32_layout.cuh").read_text()     # Layout, LayoutT, BwdF32Smem
    entry = (hopper / "bwd_f32.cu").read_text()              # the mbarrier counts
    consumer = (hopper / "bwd_f32_consumer.cuh").read_text() # the named-barrier handoff
    layout_t_src = layout[layout.index("struct LayoutT {"):layout.index("template <int D> struct LayoutOf")]
    assert "BYTES = BARS + 8 * 15;" in layout_t_src
    assert plan_bwd_sm90_f32.N_BARRIERS[D] == 15
    slots = 2 * plan_bwd_sm90_f32.TILE_RING + 3 + 2 * 1 + 4      # tile ring, kv, raw, nat / t
    assert slots + 2 == 15
    for decl in ("pt_full = t_empty + 8;", "pt_empty = pt_full + 8;"):
        assert decl in layout, decl
    for bar, count in (("pt_full", 128), ("pt_empty", 128)):
        assert f"mbar_init(sm.{bar}, {count});" in entry, bar
    for nbar in ("DS_FULL", "DS_EMPTY"):
        assert f"named_bar_sync({nbar}, 256);" in consumer and f"named_bar_arrive({nbar}, 256);" in consumer


def jit_a_first_product(t, kk, x_smem):
    """Sᵀ / dPᵀ: lane t's 4 A registers of k-step kk, loaded raw from the K / V tile and split
    (the kernel: r = row_in_wg + 8·(e % 2), column 32·b + 8·k + c4 + 4·(e / 2), kk = 4b + k)."""
    row_in_wg, c4, _, _ = lane(t)
    b, k = kk // 4, kk % 4
    out = []
    for e in range(4):
        r, x = row_in_wg + 8 * (e % 2), 32 * b + 8 * k + c4 + 4 * (e // 2)
        out.append((e, kswz(r, x, KV_PANEL), r, x))
    return out


def test_one_step_of_both_consumers():
    rng = np.random.default_rng(11)
    K, V = rng.standard_normal((BN, D)), rng.standard_normal((BN, D))
    Q, dO = rng.standard_normal((BM, D)), rng.standard_normal((BM, D))
    lse2, Dsum, scale = rng.standard_normal(BM), rng.standard_normal(BM), 0.09
    kr, vr = np.zeros(BN * D), np.zeros(BN * D)
    tma_store(kr, 0, K)
    tma_store(vr, 0, V)
    parts, raw = {}, {}
    for name, X in (("Q", Q), ("DO", dO)):
        raw[name] = np.zeros(BM * D)         # the raw copy (TMA)
        tma_store(raw[name], 0, X)
        landed = raw[name].copy()            # TMA into the big half, split there in place: the
        parts[name] = split(landed)          # elementwise split keeps the layout

    # ---- first products: c0 Sᵀ = K Qᵀ (B = Q parts), c1 dPᵀ = V dOᵀ (B = dO parts)
    first = {}
    for cw, (x_smem, yname) in enumerate(((kr, "Q"), (vr, "DO"))):
        acc = np.zeros((BN, BM))
        worst = 0
        for kk in range(D // 8):
            Ab, As = np.full((64, 8), np.nan), np.full((64, 8), np.nan)
            for w in range(4):
                for e in range(4):
                    worst = max(worst, conflicts([jit_a_first_product(t, kk, x_smem)[e][1] // 4
                                                  for t in range(32 * w, 32 * w + 32)]))
            for t in range(128):
                for e, off, r, x in jit_a_first_product(t, kk, x_smem):
                    assert a_frag_pos(t, e) == (r, x - 8 * kk)
                    Ab[a_frag_pos(t, e)], As[a_frag_pos(t, e)] = split(x_smem[off // 4])
            start = (kk // 4) * Q_PANEL + (kk % 4) * 32
            yb, ys = (b_tile(parts[yname][j], start, BM) for j in (0, 1))
            acc += As @ yb + Ab @ ys + Ab @ yb
        assert worst == 1   # 4-byte loads: 32 distinct banks per warp
        ref = (K @ Q.T) if cw == 0 else (V @ dO.T)
        np.testing.assert_allclose(acc, ref, atol=2e-5 * np.abs(ref).max())
        first[cw] = {(t, i): acc[acc_pos(t, i)] for t in range(128) for i in range(BM // 2)}

    # ---- c0: Pᵀ (no mask here) -> pT tile; c1 reads it back where c0's lane t wrote it
    P_t = np.exp2(K @ Q.T * scale - lse2[None, :])                 # [BN keys, BM], float64 Pᵀ
    pt = [np.full(BN * BM, np.nan), np.full(BN * BM, np.nan)]
    for i in range(BM // 2):
        for w in range(4):
            assert conflicts([t_off(t, i) // 4 for t in range(32 * w, 32 * w + 32)]) <= 2
        for t in range(128):
            key, q = acc_pos(t, i)
            big, small = split(P_t[key, q])
            assert np.isnan(pt[0][t_off(t, i) // 4])                 # every element once
            pt[0][t_off(t, i) // 4], pt[1][t_off(t, i) // 4] = big, small
    assert not np.isnan(pt[0]).any()
    dS_t = np.zeros((BN, BM))
    dst = [np.full(BN * BM, np.nan), np.full(BN * BM, np.nan)]
    ds = [np.full(BN * BM, np.nan), np.full(BN * BM, np.nan)]
    ds_conf = 0
    for i in range(BM // 2):
        for w in range(4):
            offs = []
            for t in range(32 * w, 32 * w + 32):
                row_in_wg, _, col_in_8, _ = lane(t)
                kl, q = row_in_wg + (8 if i % 4 >= 2 else 0), (i // 4) * 8 + col_in_8 + i % 2
                assert (kl, q) == acc_pos(t, i)
                pe = pt[0][t_off(t, i) // 4] + pt[1][t_off(t, i) // 4]
                v = pe * (first[1][(t, i)] - Dsum[q]) * scale
                dS_t[kl, q] = v
                big, small = split(v)
                dst[0][t_off(t, i) // 4], dst[1][t_off(t, i) // 4] = big, small
                off = kswz(q, slot_of_key(kl), DS_PANEL)
                offs.append(off // 4)
                assert np.isnan(ds[0][off // 4])
                ds[0][off // 4], ds[1][off // 4] = big, small
            ds_conf = max(ds_conf, conflicts(offs))
    assert ds_conf == 1 and not np.isnan(ds[0]).any() and not np.isnan(dst[0]).any()
    ref_dS_t = P_t * ((V @ dO.T) - Dsum[None, :]) * scale
    np.testing.assert_allclose(dS_t, ref_dS_t, atol=1e-4 * np.abs(ref_dS_t).max())

    # ---- transposed products of consumer cw: A = Xᵀ_h split on the fly from a raw tile, B parts
    def t_product(cw, src, panel, k_steps, b_parts):
        """Σ over k-steps of A_small B_big + A_big B_small + A_big B_big (3xTF32 order), A = Xᵀ_h
        gathered by consumer cw's lanes from the raw tile ``src`` (swizzled, ``panel`` bytes per
        panel), B = b_parts(kk) -> (big, small); rows in fragment order (d_of_row)."""
        acc = None
        worst = 0
        for kk in range(k_steps):
            Ab, As = np.full((64, 8), np.nan), np.full((64, 8), np.nan)
            for hh in range(2):
                for w in range(4):
                    words = []
                    for t in range(32 * w, 32 * w + 32):
                        off = kswz(key_of_slot(8 * kk + t % 4 + 4 * hh), d0_of(t, cw), panel)
                        words += [off // 4, off // 4 + 1]
                    worst = max(worst, conflicts(words))
            for t in range(128):
                d0 = d0_of(t, cw)
                for hh in range(2):
                    q = key_of_slot(8 * kk + t % 4 + 4 * hh)
                    off = kswz(q, d0, panel)
                    assert off % 8 == 0
                    for j in range(2):            # fragment registers 2hh + j: columns d0 + j
                        m, col = a_frag_pos(t, 2 * hh + j)
                        assert (d_of_row(m, cw), key_of_slot(8 * kk + col)) == (d0 + j, q)
                        Ab[m, col], As[m, col] = split(src[off // 4 + j])
            yb, ys = b_parts(kk)
            part = As @ yb + Ab @ ys + Ab @ yb
            acc = part if acc is None else acc + part
        assert worst == 2     # 8-byte loads: two wavefronts, no conflict beyond them
        return acc

    def step_product(cw, xname, y):   # dVᵀ_h / dKᵀ_h [64, BN]: X = dO / Q, B = Y [BN][BM slots]
        return t_product(cw, raw[xname], Q_PANEL, BM // 8,
                         lambda kk: tuple(b_tile(y[j], 32 * kk, BN) for j in (0, 1)))

    def relabel(acc, cw):
        out = np.zeros((DH, acc.shape[1]))
        for m in range(64):
            out[d_of_row(m, cw) - DH * cw] = acc[m]
        return out

    P_model = P_t            # c0 stored big + small of P (the model's split is exact in sum)
    for cw in range(2):
        cols = slice(DH * cw, DH * cw + DH)
        dvt = relabel(step_product(cw, "DO", pt), cw)           # dVᵀ_h [DH, BN]
        np.testing.assert_allclose(dvt, (P_model @ dO).T[cols], atol=2e-5 * np.abs(dvt).max())
        dkt = relabel(step_product(cw, "Q", dst), cw)           # dKᵀ_h
        np.testing.assert_allclose(dkt, (dS_t @ Q).T[cols], atol=2e-5 * np.abs(dkt).max())

        # ---- dQᵀ_h [DH, BM] = Kᵀ_h dSᵀ: A = Kᵀ_h split on the fly from raw K, B = dS tile
        acc = t_product(cw, kr, KV_PANEL, BN // 8,
                        lambda kk: tuple(b_tile(ds[j], (kk // 4) * DS_PANEL + (kk % 4) * 32, BM)
                                         for j in (0, 1)))
        dqt = relabel(acc, cw)
        ref = (dS_t.T @ K).T[cols]
        np.testing.assert_allclose(dqt, ref, atol=2e-5 * np.abs(ref).max())


def test_dk_dv_stores_and_dq_adds_cover_each_element_once():
    """dK, dV rows (keys) x D columns and dq rows (queries) x D columns over both consumers:
    each element once, as adjacent pairs (acc[i], acc[i + 2]) at an even column d0."""
    seen_kv = np.zeros((BN, D), int)
    seen_q = np.zeros((BM, D), int)
    for cw in range(2):
        for t in range(128):
            d0 = d0_of(t, cw)
            _, _, col_in_8, _ = lane(t)
            assert d0 % 2 == 0
            for i in range(BN // 2):                 # dKᵀ_h / dVᵀ_h accumulators [64, BN]
                m, key = acc_pos(t, i)
                assert d_of_row(m, cw) == d0 + (1 if i % 4 >= 2 else 0)
                if i % 4 >= 2:
                    continue
                assert key == (i // 4) * 8 + col_in_8 + i % 2 and acc_pos(t, i + 2) == (m + 8, key)
                seen_kv[key, d0:d0 + 2] += 1
            for i in range(BM // 2):                 # dQᵀ_h accumulator [64, BM]: add_dq
                m, q = acc_pos(t, i)
                if i % 4 >= 2:
                    continue
                assert q == (i // 4) * 8 + col_in_8 + i % 2 and acc_pos(t, i + 2) == (m + 8, q)
                assert d_of_row(m, cw) == d0
                seen_q[q, d0:d0 + 2] += 1
    assert (seen_kv == 1).all() and (seen_q == 1).all()


def test_pt_tile_is_the_accumulator_once():
    """t_off covers the [BN keys][BM query slots] tile once, and the slot of accumulator
    register i's query is where the transposed products' fragments look for that query."""
    seen = np.zeros(BN * BM, int)
    for t in range(128):
        for i in range(BM // 2):
            key, q = acc_pos(t, i)
            off = t_off(t, i)
            seen[off // 4] += 1
            row, slot = off // 128, None
            assert row == key
            # undo the swizzle of the 128-byte row: logical byte = physical chunk ^ row % 8
            phys = off % 128
            slot = ((((phys // 16) ^ (row % 8)) * 16) + phys % 16) // 4
            assert key_of_slot(slot) == q
    assert (seen == 1).all()
