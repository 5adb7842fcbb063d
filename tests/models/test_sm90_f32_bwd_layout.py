"""CPU (NumPy) models of the float32 Hopper backward (kernels_cu/hopper/bwd_f32.cu), checked
without a GPU:

* the shared-memory map (Layout) against its Python mirror and the 232,448-byte limit;
* the products whose layouts it shares with the float32 forward (tests/models/test_sm90_f32_layout.py's
  models, instantiated with this kernel's shapes): Sᵀ = K Qᵀ (A = a consumer's 64 rows of the
  128-key K tile, B = the 32-row Q tile), dV += Pᵀ dO through the converters' transposition of dO
  with BN := BM = 32, the consumers' V split (QREG addressing with 128 rows);
* what is new here: the dS tile [32 queries, 64 keys] the consumers store from their Sᵀ-shaped
  registers (every element once, no bank conflict) and dQᵀ = Kᵀ dSᵀ through it (A = Kᵀ fragments
  loaded from the K tile as 8-byte pairs of d columns with the keys in slot order, B = the dS
  tile through a K-major descriptor); dQᵀ's reductions from registers into the chunk-swizzled
  accumulator (every element once, adjacent pairs) and the conversion kernel's read-back;
* the work decomposition (work tiles of 128 keys, 32-row steps over the GQA group, the masks'
  need_mask shortcut) as a float64 NumPy backward against reference.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.gpu import plan_bwd_sm90_f32
from cupyflash import reference

from test_sm90_f32_layout import (a_frag_pos, acc_pos, swz, test_pv_product_through_the_layouts,
                                  test_s_product_through_the_layouts, test_split_q_fragments_and_s_product,
                                  test_transpose_covers_and_has_no_bank_conflicts, tma_store)

BM, BN, D = plan_bwd_sm90_f32.BM, plan_bwd_sm90_f32.BN, 64


def layout(d):
    """sm90bf::Layout<D> of hopper/bwd_f32.cu, transcribed (RAWQ, RAWDO: landing stage 0; RAW1:
    stage 1, RAW_STAGE = 2·QT further on)."""
    kvt, qt = BN * d * 4, BM * d * 4
    off, o = {}, 0
    for name, size in (("KB", kvt), ("KS", kvt), ("VB", kvt), ("QB", qt), ("QS", qt), ("DOB", qt),
                       ("DOS", qt), ("QTB", qt), ("QTS", qt), ("DOTB", qt), ("DOTS", qt), ("RAWQ", qt),
                       ("RAWDO", qt), ("RAW1", 2 * qt), ("DS", 2 * 2 * 2 * BM * 128),
                       ("ROWS", 2 * BM * 4), ("TILE", 16), ("BARS", 8 * 15)):
        off[name] = o
        o += size
    off["BYTES"] = o
    return off


def test_layout_fits_and_matches_the_mirror():
    off = layout(D)
    assert off["BYTES"] + 1024 == plan_bwd_sm90_f32.smem_bytes(D) == plan_bwd_sm90_f32.Sm90F32BwdVariant(D, False).smem_bytes
    assert plan_bwd_sm90_f32.smem_bytes(D) <= 232_448
    for name in ("KB", "KS", "VB", "QB", "QS", "DOB", "DOS", "QTB", "QTS", "DOTB", "DOTS", "RAWQ",
                 "RAWDO", "RAW1", "DS"):
        assert off[name] % 1024 == 0, name   # swizzled panels: 1024-byte aligned


def test_shared_products_with_this_kernels_shapes():
    """Sᵀ = K Qᵀ: the forward's S model with 'Q' = the 128-key K tile (two consumers' 64 rows) and
    'K' = the 32-row Q tile; dV += Pᵀ dO: the forward's P V model with BN := BM = 32 (the
    converters' transposition of dO with the query permutation); the consumers' V split: the
    forward's QREG model (its 128-row tile is the K / V tile here)."""
    test_s_product_through_the_layouts(BM, D)
    test_transpose_covers_and_has_no_bank_conflicts(BM, D)
    test_pv_product_through_the_layouts(BM, D)
    test_split_q_fragments_and_s_product(D)


def key_of_slot(s):
    """hopper/bwd_f32.cu's key_of_slot: the key in slot s of the dS tile (8-key k-steps)."""
    return 8 * (s // 8) + (s % 2) * 4 + (s % 8) // 2


def slot_of_key(k):
    return 8 * (k // 8) + 2 * (k % 4) + (k % 8) // 4


def test_key_slots_are_a_permutation_inside_each_k_step():
    assert sorted(key_of_slot(s) for s in range(64)) == list(range(64))
    for s in range(64):
        assert slot_of_key(key_of_slot(s)) == s and key_of_slot(s) // 8 == s // 8


def ds_store_offset(t, kk, e):
    """Consumer lane t's dS store of fragment slot e of query step kk: (byte offset in its dS part,
    key row, query) as hopper/bwd_f32.cu computes it (swz(q, slot_of_key(kl), DS_PANEL))."""
    row_in_wg = (t // 32) * 16 + (t % 32) // 4
    kl, q = row_in_wg + 8 * (e % 2), 8 * kk + 2 * (t % 4) + e // 2
    sl = slot_of_key(kl)
    off = (sl // 32) * BM * 128 + q * 128 + 16 * (((sl % 32) // 4) ^ (q % 8)) + 4 * (sl % 4)
    return off, kl, q


def d0_of(t):
    """The even K column of consumer lane t's Kᵀ fragment rows r, r + 8 (and of its dQᵀ rows)."""
    return 16 * (t // 32) + 2 * ((t % 32) // 4)


def kt_load_offset(t, kk, h):
    """Consumer lane t's 8-byte Kᵀ A-fragment load h (fragment slots 2h, 2h + 1) of key step kk:
    (byte offset from the consumer's 64 rows of the K tile, d of the first word, key)."""
    d, kl = d0_of(t), key_of_slot(8 * kk + t % 4 + 4 * h)
    off = (d // 32) * BN * 128 + kl * 128 + 16 * (((d % 32) // 4) ^ (kl % 8)) + 4 * (d % 4)
    return off, d, kl


def d_of_row(m):
    """dQᵀ / Kᵀ-fragment row m of the 64-row product -> column d of K (rows r, r + 8 of a lane
    are d0, d0 + 1)."""
    w, i = m // 16, m % 16
    return 16 * w + 2 * (i % 8) + i // 8


def test_ds_slots_are_the_accumulator_registers():
    """The fragment slot order a = {x[4kk], x[4kk+2], x[4kk+1], x[4kk+3]} names the accumulator
    positions the dS stores claim (key, query)."""
    for t in range(128):
        for kk in range(BM // 8):
            for e in range(4):
                i = 4 * kk + (0, 2, 1, 3)[e]
                _, kl, q = ds_store_offset(t, kk, e)
                assert acc_pos(t, i) == (kl, q)


def test_ds_stores_cover_the_tile_without_bank_conflicts():
    seen = np.zeros(BM * 64, int)
    for kk in range(BM // 8):
        for e in range(4):
            for w in range(4):
                offs = [ds_store_offset(t, kk, e)[0] for t in range(32 * w, 32 * w + 32)]
                assert len({(o // 4) % 32 for o in offs}) == 32   # one warp store: 32 banks
                for o in offs:
                    seen[o // 4] += 1
    assert (seen == 1).all()


def test_dq_product_through_the_ds_tile_and_kt_fragments():
    """dQᵀ_c = Kᵀ_c dSᵀ_c with A = Kᵀ fragments read from the TMA-swizzled K tile (rows = keys)
    and B = the dS tile through the descriptor (start + (kk/4)·panel + (kk%4)·32, rows of 128
    bytes: query n, key k), summed over both consumers = (dS K)ᵀ."""
    rng = np.random.default_rng(5)
    K = rng.standard_normal((BN, D))
    dS = rng.standard_normal((BM, BN))
    k_smem = np.full(BN * D, np.nan)
    tma_store(k_smem, 0, K)
    total = np.zeros((D, BM))
    conflicts = 0
    for cw in range(2):
        ds_tile = np.full(BM * 64, np.nan)
        for t in range(128):
            for kk in range(BM // 8):
                for e in range(4):
                    off, kl, q = ds_store_offset(t, kk, e)
                    ds_tile[off // 4] = dS[q, 64 * cw + kl]
        assert not np.isnan(ds_tile).any()
        part = np.zeros((D, BM))   # rows in fragment order: row m is column d_of_row(m)
        for kk in range(64 // 8):
            A = np.full((64, 8), np.nan)
            for t in range(128):
                for h in range(2):
                    off, d, kl = kt_load_offset(t, kk, h)
                    assert off % 8 == 0
                    for j in range(2):   # the pair's words: fragment slots 2h + j
                        v = 2 * h + j
                        A[a_frag_pos(t, v)] = k_smem[(cw * 64 * 128 + off) // 4 + j]
                        m, col = a_frag_pos(t, v)
                        assert (d_of_row(m), key_of_slot(8 * kk + col)) == (d + j, kl)
            for w in range(4):
                for h in range(2):   # one 8-byte load per lane: 64 words, each bank twice at best
                    words = [kt_load_offset(t, kk, h)[0] // 4 + j for t in range(32 * w, 32 * w + 32)
                             for j in range(2)]
                    conflicts = max(conflicts, max(np.bincount([x % 32 for x in words])))
            start = (kk // 4) * BM * 128 + (kk % 4) * 32
            B = np.array([[ds_tile[swz(start + n * 128 + 4 * k) // 4] for n in range(BM)] for k in range(8)])
            part += A @ B
        part = part[np.argsort([d_of_row(m) for m in range(64)])]
        np.testing.assert_allclose(part, K[64 * cw:64 * cw + 64].T @ dS[:, 64 * cw:64 * cw + 64].T,
                                   rtol=1e-12, atol=1e-12)
        total += part
    np.testing.assert_allclose(total, (dS @ K).T, rtol=1e-12, atol=1e-12)
    assert conflicts == 2   # two wavefronts per 8-byte warp load: no bank conflict


def test_dq_reductions_into_dq():
    """dQᵀ accumulator registers -> red.global.add.v2.f32 straight into the float32 dq rows
    (hopper/bwd_f32.cu; dq zeroed by flash_bwd_pre_sm90_f32, no accumulator, no conversion): each
    (query, d) element once per consumer, the pairs (dq_acc[i], dq_acc[i + 2]) adjacent columns
    d0, d0 + 1 with d0 even (8-byte aligned, as the launcher requires of dq's rows)."""
    rng = np.random.default_rng(6)
    dQ = rng.standard_normal((BM, D))
    stride_s = D * 3 + 2                      # a row stride of dq (e.g. h = 3, padded; even)
    dq = np.full(BM * stride_s, np.nan)

    for t in range(128):
        d0 = d0_of(t)
        assert d0 % 2 == 0
        for i in range(BM // 2):
            m, q = acc_pos(t, i)
            assert d_of_row(m) == d0 + (1 if i % 4 >= 2 else 0)
            if i % 4 >= 2:
                continue
            assert acc_pos(t, i + 2) == (m + 8, q)
            w = q * stride_s + d0
            assert w % 2 == 0 and np.isnan(dq[w:w + 2]).all()
            dq[w], dq[w + 1] = dQ[q, d0], dQ[q, d0 + 1]
    back = dq.reshape(BM, stride_s)[:, :D]
    np.testing.assert_array_equal(back, dQ)


# ---- the work decomposition, as a float64 NumPy backward -----------------------------------------

def work_tile(w, s_q, s_k, h_k, h_per_hk, diag_offset, window, left, right, BN=BN):
    num_n = -(-s_k // BN)
    n0 = (w % num_n) * BN
    kv_head = (w // num_n) % h_k
    batch = w // num_n // h_k
    n_rows = min(BN, s_k - n0)
    i_lo, i_hi = 0, s_q - 1
    if window:
        i_lo = max(0, n0 - diag_offset - right)
        i_hi = min(s_q - 1, n0 + n_rows - 1 - diag_offset + left)
    m_first = i_lo // BM
    m_count = i_hi // BM - i_lo // BM + 1 if i_hi >= i_lo else 0
    return n0, kv_head, batch, m_first, m_count, m_count * h_per_hk


def model_backward(dout, q, k, v, scale, causal=False, window=None, bn=BN):
    """The kernel's loops (work tiles, steps, need_mask) in float64; bottom-right alignment;
    ``bn`` keys per work tile (128 at hd 64, 64 at hd 128)."""
    BN = bn
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    hp = h // h_k
    diag_offset = s_k - s_q
    left, right = (window if window else (s_q + s_k, s_q + s_k))
    if causal:
        right = 0
    win = causal or window is not None
    out, lse = reference.attention(q, k, v, scale=scale, causal=causal, window=window, return_lse=True)
    dsum = np.einsum("bihd,bihd->bhi", dout, out)
    dq = np.zeros((b, h, s_q, d))
    dk = np.full(k.shape, np.nan)
    dv = np.full(v.shape, np.nan)
    num_work = -(-s_k // BN) * h_k * b
    for w in range(num_work):
        n0, kvh, bb, m_first, m_count, steps = work_tile(w, s_q, s_k, h_k, hp, diag_offset, win, left, right, BN)
        dk_t = np.zeros((BN, d))
        dv_t = np.zeros((BN, d))
        K = np.zeros((BN, d))
        V = np.zeros((BN, d))
        K[:min(BN, s_k - n0)] = k[bb, n0:n0 + BN, kvh]   # TMA: zeros past s_k
        V[:min(BN, s_k - n0)] = v[bb, n0:n0 + BN, kvh]
        for st in range(steps):
            head = kvh * hp + st // m_count
            m0 = (m_first + st % m_count) * BM
            Q = np.zeros((BM, d))
            dO = np.zeros((BM, d))
            rows = min(BM, s_q - m0)
            Q[:rows] = q[bb, m0:m0 + rows, head]
            dO[:rows] = dout[bb, m0:m0 + rows, head]
            l2 = np.full(BM, np.inf)
            dd = np.zeros(BM)
            ls = lse[bb, head, m0:m0 + rows]
            l2[:rows] = np.where(ls == -np.inf, np.inf, ls)
            dd[:rows] = dsum[bb, head, m0:m0 + rows]
            St = K @ Q.T                                   # [BN keys, BM]
            dPt = V @ dO.T
            Pt = np.exp(St * scale - l2[None, :])
            need_mask = n0 + BN > s_k
            if win:
                need_mask |= (n0 + BN - 1 > m0 + diag_offset + right) or (n0 < m0 + BM - 1 + diag_offset - left)
            if need_mask:
                key = n0 + np.arange(BN)[:, None]
                diag = m0 + np.arange(BM)[None, :] + diag_offset
                keep = key < s_k
                if win:
                    keep = keep & (key <= diag + right) & (key >= diag - left)
                Pt = np.where(keep, Pt, 0.0)
            dSt = Pt * (dPt - dd[None, :]) * scale
            dv_t += Pt @ dO
            dk_t += dSt @ Q
            dq[bb, head, m0:m0 + rows] += (dSt.T @ K)[:rows]
        n = min(BN, s_k - n0)
        dk[bb, n0:n0 + n, kvh] = dk_t[:n]
        dv[bb, n0:n0 + n, kvh] = dv_t[:n]
    return dq.transpose(0, 2, 1, 3), dk, dv


@pytest.mark.parametrize("head_dim", sorted(plan_bwd_sm90_f32.BN_OF), ids=lambda d: f"hd{d}")
@pytest.mark.parametrize("s_q,s_k,h,h_k,causal,window", [
    (33, 200, 2, 1, False, None),
    (200, 33, 2, 2, True, None),
    (100, 300, 4, 2, True, None),
    (300, 100, 1, 1, False, (40, 7)),
    (1, 129, 2, 1, True, None),
    (97, 64, 2, 1, True, None),
])
def test_work_decomposition_matches_the_reference(s_q, s_k, h, h_k, causal, window, head_dim):
    """The kernel's work tiles and steps (BN_OF[head_dim] keys per tile: 128 at hd 64, 64 at
    hd 128) cover every kept (query, key) pair exactly once."""
    rng = np.random.default_rng(7)
    d = 16   # the decomposition does not depend on d
    q = rng.standard_normal((2, s_q, h, d))
    k = rng.standard_normal((2, s_k, h_k, d))
    v = rng.standard_normal((2, s_k, h_k, d))
    dout = rng.standard_normal((2, s_q, h, d))
    scale = d ** -0.5
    dq, dk, dv = model_backward(dout, q, k, v, scale, causal, window, bn=plan_bwd_sm90_f32.BN_OF[head_dim])
    rq, rk, rv, _ = reference.attention_backward(dout, q, k, v, scale=scale, causal=causal, window=window)
    for got, ref in ((dq, rq), (dk, rk), (dv, rv)):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def _why(dtype="float32", d=64, cc=90, **kw):
    args = dict(allow_tf32=False, scale=0.125, softcap=0.0, has_alibi=False, has_bias=False,
                has_mask=False, deterministic=False, window_left=-1, window_right=-1, cc=cc,
                smem_optin=232_448)
    args.update(kw)
    return plan_bwd_sm90_f32.why_unsupported(dtype, d, d, **args)


def test_coverage_rules():
    """What hopper/bwd_f32.cu accepts: float32, hd 64 or 128 (d = d_v), cc 9.0, no extras."""
    assert _why() is None
    assert _why(window_left=10, window_right=0) is None
    assert _why(d=128) is None
    assert "shared memory" in _why(d=128, smem_optin=plan_bwd_sm90_f32.smem_bytes(128) - 1)
    assert "dtype" in _why("bfloat16")
    for d in (32, 96, 100, 256):
        assert "head dims" in _why(d=d)
    assert "compute capability" in _why(cc=80)
    assert "allow_tf32" in _why(allow_tf32=True)
    assert "deterministic" in _why(deterministic=True)
    assert "softcap" in _why(softcap=30.0)
    assert "shared memory" in _why(smem_optin=plan_bwd_sm90_f32.smem_bytes(64) - 1)


def test_16_bit_hopper_backward_refuses_float32():
    """The 16-bit Hopper backward's variants are 16-bit only: float32 goes to hopper/bwd_f32.cu
    (or the portable kernel)."""
    from cupyflash.gpu import plan_bwd_sm90
    assert all(v.elem in ("f16_t", "bf16_t") for v in plan_bwd_sm90.variants())
    assert plan_bwd_sm90.why_unsupported("float32", 64, 64, scale=0.125, softcap=0.0, has_alibi=False,
                                     deterministic=False, cc=90, smem_optin=232_448) is not None
