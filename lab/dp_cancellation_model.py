# Question: How large is the float32 Hopper backward's dK error when dS = dP - D is only rounding (one key; CPU model)?
"""CPU model of the float32 Hopper backward's one-key cancellation case (test_seqlens[239-1]):
with one key P = 1, so dS = dP − D is only rounding, and dK = scale·Σ_q dS_q·Q_q shows how
dP (3xTF32 wgmma k8 steps; fp32 accumulation modelled as the exact sum truncated toward zero
after each product) and D (flash_bwd_pre_sm90_f32's fp32 order) differ. 478 queries (h 2 / h_k 1),
random normal inputs, 20 draws; "parts" = accumulators of the dP contraction added in fp32 RN.

    python lab/dp_cancellation_model.py
    # d64 parts1 ~3.2e-5 mean (hd 64 kernel), d128 parts1 ~7.5e-5 (H200: 5.05e-5 > 5e-5),
    # d128 parts2 ~3.6e-5, d128 parts4 ~1.8e-5 (the kernel now), naive float32 ~6e-6

    python lab/dp_cancellation_model.py --ordinary
    # ordinary (many-key) cases at hd 128: dq / dk / dv errors with c0's Sᵀ in one accumulator
    # (as the forward's S that made lse) or four, dPᵀ in four (the kernel's); see ordinary()
"""
import sys
import numpy as np
rng = np.random.default_rng(1)
def tf32(x):  # rna to tf32 (10 explicit bits)
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return u.view(np.float32)
def split(x):
    b = tf32(x); s = tf32(np.float32(x) - b); return b, s
def trunc32(x64):
    r = x64.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x64)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r
def wgmma_dot(a, b, parts):
    """a [n, d], b [n, d] float32 rows; dot per row via 3xTF32 k8 steps, `parts` accumulators added RN"""
    n, d = a.shape
    ab, as_ = split(a); bb, bs = split(b)
    per = d // parts
    tot = np.zeros(n, np.float32)
    for p in range(parts):
        acc = np.zeros(n, np.float32)
        for k in range(p * per, (p + 1) * per, 8):
            sl = slice(k, k + 8)
            for x, y in ((as_, bb), (ab, bs), (ab, bb)):
                acc = trunc32(acc.astype(np.float64) + (x[:, sl].astype(np.float64) * y[:, sl]).sum(1))
        tot = (tot + acc).astype(np.float32)
    return tot
def pre_dot(a, b):
    d = a.shape[1]; L = 32 if d == 128 else 16
    # d128: lane j sums cols j, j+32, j+64, j+96 by fma (fp32), then butterfly
    lanes = []
    for j in range(32):
        acc = np.zeros(a.shape[0], np.float32)
        if d == 128:
            for e in range(4):
                acc = (acc.astype(np.float64) + a[:, j+32*e].astype(np.float64) * b[:, j+32*e]).astype(np.float32)
        else:
            jj = j % 16
            lo = (a[:, jj+32].astype(np.float64)*b[:, jj+32] + (a[:, jj].astype(np.float64)*b[:, jj]).astype(np.float32)).astype(np.float32)
            hi = (a[:, jj+48].astype(np.float64)*b[:, jj+48] + (a[:, jj+16].astype(np.float64)*b[:, jj+16]).astype(np.float32)).astype(np.float32)
            acc = (lo + hi).astype(np.float32)
        lanes.append(acc)
    lanes = np.array(lanes)
    idx = np.arange(32)
    for m in ([16] if d == 128 else []) + [8, 4, 1, 2]:
        lanes = (lanes + lanes[idx ^ m]).astype(np.float32)
    return lanes[0]
def fwd_o(v):  # O = P V with P = 1: 1*small + 0 + 1*big (3xTF32), exact in fp32 up to trunc
    b, s = split(v); return (b.astype(np.float64) + s).astype(np.float32)
def case(d, parts, nq=478, trials=20):
    errs = []; naive = []
    for _ in range(trials):
        q = rng.standard_normal((nq, d)).astype(np.float32)
        do = rng.standard_normal((nq, d)).astype(np.float32)
        v = rng.standard_normal(d).astype(np.float32)
        o = np.tile(fwd_o(v), (nq, 1))
        dp = wgmma_dot(do, np.tile(v, (nq, 1)), parts)
        D = pre_dot(do, o)
        ds = (dp - D).astype(np.float64) / np.sqrt(d)
        errs.append(np.abs(ds @ q).max())
        # naive fp32: dp = do @ v, D = sum(do*o) in fp32 (numpy pairwise)
        dpn = (do @ v).astype(np.float32); Dn = (do * o).sum(1, dtype=np.float32)
        naive.append(np.abs(((dpn - Dn).astype(np.float64) / np.sqrt(d)) @ q).max())
    errs = np.array(errs)
    print(f"d{d} parts{parts}: dk err mean {errs.mean():.3g} max {errs.max():.3g}  naive-f32 mean {np.mean(naive):.3g}")

def wgmma_mat(a, b, parts):
    """[m, d] x [n, d] -> [m, n]: 3xTF32 k8 steps (small·big, big·small, big·big; A = a), truncating
    fp32 accumulation, `parts` accumulators (consecutive k ranges) added in fp32 RN"""
    m, d = a.shape
    ab, as_ = split(a); bb, bs = split(b)
    per = d // parts
    tot = np.zeros((m, b.shape[0]), np.float32)
    for p in range(parts):
        acc = np.zeros_like(tot)
        for k in range(p * per, (p + 1) * per, 8):
            sl = slice(k, k + 8)
            for x, y in ((as_, bb), (ab, bs), (ab, bb)):
                acc = trunc32(acc.astype(np.float64) + x[:, sl].astype(np.float64) @ y[:, sl].T.astype(np.float64))
        tot = (tot + acc).astype(np.float32)
    return tot
def ordinary(nq=512, nk=128, d=128, mag=1.0, trials=4):
    """Many keys, random normal Q, K (times mag: larger = more peaked P), V, dO. Forward's S = Q Kᵀ
    in one accumulator (hopper/fwd_f32.cu) -> lse (float64), O = P V (float64); D in
    flash_bwd_pre's fp32 order. Backward: Sᵀ = K Qᵀ with 1 or 4 accumulators, P = exp(scale·Sᵀ −
    lse), dPᵀ = V dOᵀ in 4 (the kernel's), dS = P(dP − D)·scale in fp32; dV, dK, dQ products in
    float64 (their own 3xTF32 rounding is the same for both choices). Errors against float64, as
    max |err| / max(1, max |ref|) (the GPU tests' measure; bound 5e-5)."""
    scale = 1 / np.sqrt(d)
    res = {1: [], 4: []}
    for _ in range(trials):
        q = (mag * rng.standard_normal((nq, d))).astype(np.float32)
        k = (mag * rng.standard_normal((nk, d))).astype(np.float32)
        v = rng.standard_normal((nk, d)).astype(np.float32)
        do = rng.standard_normal((nq, d)).astype(np.float32)
        q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
        s_ref = q64 @ k64.T * scale
        lse_ref = np.log(np.exp(s_ref - s_ref.max(1, keepdims=True)).sum(1)) + s_ref.max(1)
        p_ref = np.exp(s_ref - lse_ref[:, None])
        o_ref = p_ref @ v64
        dp_ref = do64 @ v64.T
        ds_ref = p_ref * (dp_ref - (do64 * o_ref).sum(1, keepdims=True)) * scale
        ref = dict(dq=ds_ref @ k64, dk=ds_ref.T @ q64, dv=p_ref.T @ do64)
        s_f = wgmma_mat(q, k, 1).astype(np.float64) * scale                      # forward's S
        lse = np.log(np.exp(s_f - s_f.max(1, keepdims=True)).sum(1)) + s_f.max(1)
        o = (np.exp(s_f - lse[:, None]) @ v64).astype(np.float32)
        D = pre_dot(do, o)
        dp = wgmma_mat(v, do, 4).T                                              # dPᵀ, 4 parts
        for parts in (1, 4):
            s_b = wgmma_mat(k, q, parts).T.astype(np.float64) * scale            # Sᵀ, A = K
            p = np.exp(s_b - lse[:, None]).astype(np.float32)
            ds = (p * ((dp - D[:, None]) * np.float32(scale))).astype(np.float64)
            got = dict(dq=ds @ k64, dk=ds.T @ q64, dv=p.T.astype(np.float64) @ do64)
            res[parts].append({n: np.abs(got[n] - ref[n]).max() / max(1, np.abs(ref[n]).max()) for n in ref})
    for parts in (1, 4):
        print(f"mag {mag} Sᵀ parts{parts}: " + "  ".join(
            f"{n} mean {np.mean([r[n] for r in res[parts]]):.3g} max {np.max([r[n] for r in res[parts]]):.3g}"
            for n in ("dq", "dk", "dv")))
if "--ordinary" in sys.argv:
    for mag in (1.0, 2.0, 3.0):
        ordinary(mag=mag)
else:
    case(64, 1); case(128, 1); case(128, 2); case(128, 4)
