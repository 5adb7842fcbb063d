// cupyflash: the float32 Hopper backward's consumer warpgroups (hopper/bwd_f32.cu): design T
// (hd 128, bwd_f32_consumer_t: consumers split by role, Sᵀ / Pᵀ and dPᵀ / dSᵀ, and own column
// halves of dK, dV, dQ) and design S (hd 64, bwd_f32_consumer_s: each consumer owns 64 keys of the
// tile), with their pieces: the dq adds, design T's descriptors and first product.
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_f32_layout.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

namespace sm90bf {

// dq rows m0 .. m0 + BM of one (batch, head) (dq_bh: float32 [s_q, D], zeroed by
// flash_bwd_pre_sm90_f32) += one consumer's dQᵀ partial [columns d0, d0 + 1 (relabelled rows),
// BM queries] straight from registers: register i holds (column d0 or d0 + 1 for i % 4 < 2 or
// >= 2, query (i / 4)·8 + 2c + i % 2), so (acc[i], acc[i + 2]) are two adjacent columns: one
// red.global.add.v2.f32 each (rows past s_q skipped)
__device__ __forceinline__ void add_dq(float* dq_bh, i64 stride_s, int m0, int s_q, int d0, int col_in_8,
                                       const float* acc) {
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
        if (i % 4 >= 2) continue;
        const int q = (i / 4) * 8 + col_in_8 + (i % 2);
        if (m0 + q < s_q) sm90b::red_add_v2(dq_bh + (m0 + q) * stride_s + d0, acc[i], acc[i + 2]);
    }
}

// Design T's dq adds (add_dq's values and order, for hd 128): the row pointer formed once and
// stepped (+stride_s, +8·stride_s), rows past s_q skipped by a predicate on the red.add itself
// (add_dq's `if` became a branch around each of its 8 red.adds: ~2 KB of step-loop SASS)
__device__ __forceinline__ void red_add_v2_if(bool pred, float* addr, float x, float y) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p red.global.add.v2.f32 [%0], {%1, %2};\n}\n"
                 :: "l"(addr), "f"(x), "f"(y), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void add_dq_t(float* dq_bh, i64 stride_s, int m0, int s_q, int d0, int col_in_8,
                                         const float* acc) {
    float* row = dq_bh + (m0 + col_in_8) * stride_s + d0;   // query m0 + col_in_8
    const int left = s_q - m0 - col_in_8;                   // query offsets q < left are rows of dq
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {                      // registers 4j, 4j + 1: queries 8j, 8j + 1
        red_add_v2_if(8 * j < left, row, acc[4 * j], acc[4 * j + 2]);
        red_add_v2_if(8 * j + 1 < left, row + stride_s, acc[4 * j + 1], acc[4 * j + 3]);
        row += 8 * stride_s;
    }
}

// Design T's wgmma B descriptors: a swizzled K-major tile (LBO 16, SBO 1024) at base + off, as
// smem_desc(base + off, 16, 1024): the low word of base's descriptor, computed once (desc_lo),
// plus off / 16 (hopper/sm90.cuh's desc_add), so every wgmma's descriptor is one add on uniform
// registers, not smem_desc's mask, shift and or (step-loop code size: see t_first_product)
__device__ __forceinline__ u32 desc_lo(u32 base) { return (u32)smem_desc(base, 16, 1024); }
__device__ __forceinline__ u64 desc_at(u32 lo, u32 off) {
    return desc_add((smem_desc(0, 16, 1024) & 0xFFFFFFFF00000000ull) | lo, off);
}

// Design T's first product of a step, c0: Sᵀ = K Qᵀ, c1: dPᵀ = V dOᵀ  [BN keys, BM] -> x_acc: D / 8
// k-steps of 8 columns; A (K / V rows row_in_wg, +8, from x_raw) loaded raw and split on the fly,
// 4 k-steps per batch, two batches in flight; B = y_big / y_small; per k-step small·big +
// big·small + big·big.
// PARTS (c1's dPᵀ): each batch (12 products) into its own zeroed accumulator (part b % 2), the four
// added in fp32 (round to nearest) as they complete: the tensor cores' accumulation rounds toward
// zero, and 48 products in one accumulator biased dPᵀ by ~48·2⁻²⁴ relative, which dSᵀ = Pᵀ(dPᵀ − D)
// does not cancel (D is summed to nearest): dK 5.05e-5 with one key (P = 1, true dSᵀ ≈ 0, H200).
// !PARTS (c0's Sᵀ): one accumulator, 48 products, as the forward's S that made lse: its bias only
// scales P by a relative ~scale·|S|·48·2⁻²⁴ that nothing downstream cancels (P multiplies
// dPᵀ − D; tools/dp_cancellation_model.py --ordinary).
// Two inlined copies (c0, c1), kept small: B descriptors by desc_at (one uniform add each), A
// addresses from the lane's eight a_off (x_raw, panel b and row + 8 as immediates). The step loop
// is 31-32 KB of SASS with both copies (aed45d9, the same copies with smem_desc and swz per load:
// 40-43 KB; main, one copy: 34-37 KB); past ~40 KB the causal loop lost 17-22 % on the H200.
template <int D, bool PARTS, typename L>
__device__ __forceinline__ void t_first_product(float* x_acc, u32 x_raw, u32 y_big, u32 y_small,
                                                const u32* a_off) {
    constexpr int NS = BM / 2;
    float x_part[2][NS];
    if constexpr (PARTS) {
#pragma unroll
        for (int i = 0; i < NS; ++i) x_part[0][i] = x_part[1][i] = 0.f;
        fence_regs<NS>(x_part[0]);
        fence_regs<NS>(x_part[1]);
    } else {
#pragma unroll
        for (int i = 0; i < NS; ++i) x_acc[i] = 0.f;
        fence_regs<NS>(x_acc);
    }
    u32 a_big[2][16], a_small[2][16];                  // [batch buffer][4 k-steps][4]
    const u32 yb_lo = desc_lo(y_big), ys_lo = desc_lo(y_small);
#pragma unroll
    for (int b = 0; b < D / 32; ++b) {
        u32* fb = a_big[b % 2];
        u32* fs = a_small[b % 2];
        float* pa = PARTS ? x_part[b % 2] : x_acc;
        if (b >= 2) {                                  // batch b − 2 is done (buffers, part)
            wgmma_wait<1>();
            fence_regs<16>(fb);
            fence_regs<16>(fs);
            if constexpr (PARTS) {
                fence_regs<NS>(pa);
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    x_acc[i] = b == 2 ? pa[i] : x_acc[i] + pa[i];
                    pa[i] = 0.f;
                }
                fence_regs<NS>(pa);
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {              // A(r, c), A(r + 8, c), A(r, c + 4), A(r + 8, c + 4)
                // swz(row_in_wg + 8·(e % 2), 32·b + 8·k + c4 + 4·(e / 2), KV_PANEL)
                const u32 addr = x_raw + b * L::KV_PANEL + (e % 2) * 8 * 128 + a_off[2 * k + e / 2];
                split_tf32(lds32(addr), fb[4 * k + e], fs[4 * k + e]);
            }
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 off = b * L::Q_PANEL + 32 * k;
            wgmma_rs_tf32<BM>(pa, fs + 4 * k, desc_at(yb_lo, off));
            wgmma_rs_tf32<BM>(pa, fb + 4 * k, desc_at(ys_lo, off));
            wgmma_rs_tf32<BM>(pa, fb + 4 * k, desc_at(yb_lo, off));
        }
        wgmma_commit();
    }
    static_assert(D / 32 == 4, "four batches: parts 0, 1 folded in before batches 2, 3");
    wgmma_wait<0>();
    if constexpr (PARTS) {
        fence_regs<NS>(x_part[0]);
        fence_regs<NS>(x_part[1]);
#pragma unroll
        for (int i = 0; i < NS; ++i) x_acc[i] = (x_acc[i] + x_part[0][i]) + x_part[1][i];
    } else {
        fence_regs<NS>(x_acc);
    }
    fence_regs<16>(a_big[0]);                          // read by the last batches until here
    fence_regs<16>(a_small[0]);
    fence_regs<16>(a_big[1]);
    fence_regs<16>(a_small[1]);
}

// Design T consumers (hd 128; warpgroups 1, 2: wg, and t, the lane in the warpgroup).
template <int D, bool WINDOW>
__device__ __forceinline__ void bwd_f32_consumer_t(const Params& p, const BwdF32Smem<D>& sm, int wg, int t) {
    using L = typename LayoutOf<D>::type;
    constexpr int BN = Shape<D>::BN;
    constexpr int NS = BM / 2;       // Sᵀ / dPᵀ accumulator registers per lane: [64 keys, BM]
    const u32 smem = sm.smem;
    float* rows_smem = sm.rows_smem;
    volatile int* tile_smem = sm.tile_smem;
    const u32 tile_full = sm.tile_full, tile_empty = sm.tile_empty, kv_raw = sm.kv_raw;
    const u32 kv_empty = sm.kv_empty, nat_full = sm.nat_full, nat_empty = sm.nat_empty;
    const u32 r_full = sm.r_full, r_empty = sm.r_empty, pt_full = sm.pt_full, pt_empty = sm.pt_empty;
    // Consumer h = cw owns columns 64h .. 64h + 63 of dK, dV, dQ. Per step (32 queries, the
    // tile's 64 keys) c0 makes Sᵀ and Pᵀ, c1 makes dPᵀ and dSᵀ / dS (the role split); both then
    // make their column halves of dVᵀ, dKᵀ and dQᵀ (transposed products: M = 64 columns d).
    constexpr int DH = D / 2;                              // columns per consumer
    constexpr int NT = BN / 2;                             // dKᵀ_h / dVᵀ_h registers per lane: [DH, BN]
    const int cw = wg - 1;                                 // consumer 0 (Pᵀ) or 1 (dSᵀ, dS)
    const int g = (t % 32) / 4, c4 = t % 4;
    const int row_in_wg = 16 * (t / 32) + g;               // Sᵀ / dPᵀ accumulator rows (keys) row_in_wg, +8
    const int col_in_8 = 2 * c4;                           // accumulator columns col_in_8, +1 (of 8)
    // Rows r, r + 8 of the transposed products' M (this lane's fragment and accumulator rows)
    // are relabelled as columns d0, d0 + 1 of the half: every A fragment pair is one 8-byte load,
    // every accumulator pair one 8-byte store or red.add (undone there)
    const int d0 = DH * cw + 16 * (t / 32) + 2 * g;        // column of D
    // this consumer's first product: c0 Sᵀ = K Qᵀ, c1 dPᵀ = V dOᵀ  [BN keys, BM queries]
    const u32 x_raw = smem + (cw == 0 ? L::KR : L::VR);    // A: K / V raw [D/32][BN][32]
    const u32 y_big = smem + (cw == 0 ? L::QB : L::DOB);   // B: Q / dO big [D/32][BM][32]
    const u32 y_small = y_big + L::QT;                     //    (QS = QB + QT, DOS = DOB + QT)
    static_assert(L::QS == L::QB + L::QT && L::DOS == L::DOB + L::QT, "small parts after big");
    // the first product's A loads: byte offset of (row_in_wg, 4·c + c4) in a K / V panel,
    // chunk c = 0..7 (swizzled: c XOR row_in_wg % 8); rows + 8, other panels are immediates
    u32 a_off[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) a_off[c] = swz(row_in_wg, 4 * c + c4, L::KV_PANEL);
    // accumulator register i's place in the Pᵀ / dSᵀ tiles [BN keys][BM query slots] (one
    // 128-byte swizzled panel): pt_off[2·(i / 4) + i % 2] (+ 8 rows for (i % 4) >= 2), key
    // row_in_wg, query slot slot_of_key((i / 4)·8 + col_in_8 + i % 2); and in the dS tile
    // [BN/32][BM queries][32 key slots]: ds_off[2·((i % 4) >= 2) + i % 2] (+ (i / 4)·8 query
    // rows). Formed once: the swizzle's XOR per store cost ~3 KB of step-loop SASS
    u32 pt_off[8], ds_off[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int par = 0; par < 2; ++par)
            pt_off[2 * j + par] = swz(row_in_wg, slot_of_key(8 * j + col_in_8 + par), 0);
#pragma unroll
    for (int kr = 0; kr < 2; ++kr)
#pragma unroll
        for (int par = 0; par < 2; ++par)
            ds_off[2 * kr + par] = swz(col_in_8 + par, slot_of_key(row_in_wg + 8 * kr), L::DS_PANEL);

    // step_acc [DH columns, BN keys] = Xᵀ_h Y: A = Xᵀ_h loaded from the raw copy X [BM
    // queries][D] (columns d0, d0 + 1: one 8-byte load; queries in key_of_slot order inside
    // each 8-query k-step) and split on the fly, B = Y big / small [BN keys][BM query slots]
    // K-major (8 slots = 32 bytes per k-step); per k-step small·big + big·small + big·big, into
    // a zeroed accumulator (added to dKᵀ_h / dVᵀ_h in fp32 by the caller: section 8 (3)).
    // last_raw_read: once its fragments are in registers this warp is done with the raw
    // copies (r_empty arrival).
    float step_acc[NT];
    auto step_product = [&](u32 x_raw_tile, u32 yb, u32 ys, bool last_raw_read) {
        u32 fb[NS], fs[NS];   // [BM/8 k-steps][A(d0, c), A(d0 + 1, c), A(d0, c + 4), A(d0 + 1, c + 4)]
#pragma unroll
        for (int kk = 0; kk < BM / 8; ++kk) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                u32 x, y;
                lds64(x_raw_tile + swz(key_of_slot(8 * kk + c4 + 4 * hh), d0, L::Q_PANEL), x, y);
                split_tf32(__uint_as_float(x), fb[4 * kk + 2 * hh], fs[4 * kk + 2 * hh]);
                split_tf32(__uint_as_float(y), fb[4 * kk + 2 * hh + 1], fs[4 * kk + 2 * hh + 1]);
            }
        }
        if (last_raw_read) {
            mbar_arrive(r_empty);                          // this lane's fragments loaded
        }
#pragma unroll
        for (int i = 0; i < NT; ++i) step_acc[i] = 0.f;
        fence_regs<NT>(step_acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 8; ++kk) {
            wgmma_rs_tf32<BN>(step_acc, fs + 4 * kk, desc_at(desc_lo(yb), 32 * kk));
            wgmma_rs_tf32<BN>(step_acc, fb + 4 * kk, desc_at(desc_lo(ys), 32 * kk));
            wgmma_rs_tf32<BN>(step_acc, fb + 4 * kk, desc_at(desc_lo(yb), 32 * kk));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs<NT>(step_acc);
        fence_regs<NS>(fb);                                // read by the products until here
        fence_regs<NS>(fs);
    };

    float dkt_acc[NT], dvt_acc[NT];   // dKᵀ_h, dVᵀ_h [DH columns (relabelled), BN keys], fp32
    int q_it = 0, kv_it = 0;          // steps and K/V tiles consumed so far (barrier phases)
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const WorkTile wt = work_tile<D, WINDOW>(p, w);
        const int n0 = wt.n0;
#pragma unroll
        for (int i = 0; i < NT; ++i) dkt_acc[i] = dvt_acc[i] = 0.f;
        // K, V landed (the phase cannot move on before this consumer's warps' kv_empty)
        if (wt.steps > 0) mbar_wait(kv_raw, kv_it & 1);

        // step st's query tile and head (step_m0, step_head as counters: no division per step)
        int mi = 0, head = wt.kv_head * p.h_per_hk;
        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int m0 = (wt.m_first + mi) * BM;
            const float* lse_smem = rows_smem + (q_it & 1) * 2 * BM;   // [BM] lse·log2 e of the step
            const float* dsum_smem = lse_smem + BM;                    // [BM] D of the step
            mbar_wait(nat_full, q_it & 1);             // Q, dO parts and rows written

            // ---- c0: Sᵀ = K Qᵀ (one accumulator), c1: dPᵀ = V dOᵀ (four per-batch accumulators)
            //      [BN keys, BM]: t_first_product
            float x_acc[NS];
            if (cw == 0) t_first_product<D, false, L>(x_acc, smem + L::KR, smem + L::QB, smem + L::QS, a_off);
            else t_first_product<D, true, L>(x_acc, smem + L::VR, smem + L::DOB, smem + L::DOS, a_off);
            // this thread's Sᵀ / dPᵀ done, and its reads of the rows of two steps back: the parts
            // may take the next step (TMA, converters). Each thread arrives for its own reads
            // (racecheck orders a later write only after the reader's own arrival)
            mbar_arrive(nat_empty);

            // accumulator register i: key row_in_wg + 8·((i % 4) >= 2), query (i / 4)·8 + col_in_8 + i % 2;
            // its place in the [BN keys][BM query slots] tiles Pᵀ, dSᵀ (one 128-byte swizzled panel)
            auto t_off = [&](int i) { return pt_off[2 * (i / 4) + i % 2] + ((i % 4) >= 2 ? 8 * 128 : 0); };
            if (cw == 0) {
                // ---- Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e), in place in x_acc
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    const int col = (i / 4) * 8 + col_in_8 + (i % 2);   // query row m0 + col
                    x_acc[i] = fast_exp2(x_acc[i] * p.scale_log2 - lse_smem[col]);
                }
                // ---- the mask, one branch for the step: P = 0 for keys past s_k and, with a
                //      window, outside [diag − window_left, diag + window_right] (diag = query row
                //      + diag_offset), tested on key − diag = rel0 + (key offset) − col. A test per
                //      value inside the exp loop made ptxas branch around each of the 16 values
                //      (~3 KB of SASS in the step loop: its size matters, see t_first_product)
                bool need_mask = n0 + BN > p.s_k;
                if (WINDOW)
                    need_mask |= n0 + BN - 1 > m0 + p.diag_offset + p.window_right ||
                                 n0 < m0 + BM - 1 + p.diag_offset - p.window_left;
                if (need_mask) {
                    const int key0 = n0 + row_in_wg, rel0 = key0 - m0 - p.diag_offset;
#pragma unroll
                    for (int i = 0; i < NS; ++i) {
                        const int col = (i / 4) * 8 + col_in_8 + (i % 2);
                        const int kr = (i % 4) >= 2 ? 8 : 0;            // key key0 + kr
                        bool keep = key0 + kr < p.s_k;
                        if (WINDOW) {
                            const int rel = rel0 + kr - col;             // key − diag
                            // & (no short circuit): the SASS this role had written inside the kernel
                            keep = keep & (rel <= p.window_right) & (rel >= -p.window_left);
                        }
                        if (!keep) x_acc[i] = 0.f;
                    }
                }
                // every reader of the last Pᵀ is done with it: each c1 thread's read-back and
                // dVᵀ_1 (pt_empty); every c0 warp's dVᵀ_0 (its DS_FULL sync)
                if (q_it > 0) mbar_wait(pt_empty, (q_it - 1) & 1);
                // ---- Pᵀ big / small -> pT tile [BN keys][BM query slots]: B of dVᵀ_0, dVᵀ_1
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    u32 big, small;
                    split_tf32(x_acc[i], big, small);
                    sts32(smem + L::PTB + t_off(i), big);
                    sts32(smem + L::PTS + t_off(i), small);
                }
                fence_proxy_async();                       // read by wgmma (async proxy)
                mbar_arrive(pt_full);                      // this thread's Pᵀ written (for c1)
                named_bar_sync(WG_BAR, 128);               // every c0 warp's Pᵀ rows, for dVᵀ_0
            } else {
                // every c0 thread's Pᵀ of the step written
                mbar_wait(pt_full, q_it & 1);
                // ---- dSᵀ = Pᵀ ∘ (dPᵀ − D)·scale, Pᵀ read back (big + small) where c0's lane t
                //      wrote it: the same accumulator position as this lane's dPᵀ register
                u32 ds_big[NS], ds_small[NS];
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    const int col = (i / 4) * 8 + col_in_8 + (i % 2);
                    const float pe = lds32(smem + L::PTB + t_off(i)) + lds32(smem + L::PTS + t_off(i));
                    split_tf32(pe * (x_acc[i] - dsum_smem[col]) * p.scale, ds_big[i], ds_small[i]);
                }
                // every reader of the last dSᵀ, dS is done with them: c0 (its arrival after
                // dQᵀ_0) and every c1 warp (this sync) after its dKᵀ_1, dQᵀ_1
                if (q_it > 0) named_bar_sync(DS_EMPTY, 256);
                // ---- dSᵀ [BN keys][BM query slots] (B of dKᵀ_h) and dS [BN/32][BM queries]
                //      [32 key slots] (B of dQᵀ_h), big / small
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    // swz(q, slot_of_key(kl), DS_PANEL), kl = row_in_wg + 8·((i % 4) >= 2),
                    // q = (i / 4)·8 + col_in_8 + i % 2
                    const u32 off = ds_off[2 * ((i % 4) >= 2) + i % 2] + (i / 4) * 8 * 128;
                    sts32(smem + L::DSTB + t_off(i), ds_big[i]);
                    sts32(smem + L::DSTS + t_off(i), ds_small[i]);
                    sts32(smem + L::DSB + off, ds_big[i]);
                    sts32(smem + L::DSS + off, ds_small[i]);
                }
                fence_proxy_async();                       // read by wgmma (async proxy)
                named_bar_arrive(DS_FULL, 256);            // dSᵀ, dS written: c0 may read them
                named_bar_sync(WG_BAR + 1, 128);           // every c1 warp's rows, for dKᵀ_1, dQᵀ_1
            }

            // ---- dVᵀ_h [DH, BN] += dOᵀ_h P  (A from the raw dO copy, B = Pᵀ)
            mbar_wait(r_full, q_it & 1);                   // the raw Q, dO copies landed
            step_product(smem + L::RDO, smem + L::PTB, smem + L::PTS, false);
#pragma unroll
            for (int i = 0; i < NT; ++i) dvt_acc[i] += step_acc[i];
            if (cw == 1) mbar_arrive(pt_empty);            // this c1 thread is done with the step's Pᵀ
            // c1's dSᵀ, dS of the step written; every c0 warp's dVᵀ_0 done (next Pᵀ may go)
            if (cw == 0) named_bar_sync(DS_FULL, 256);
            // ---- dKᵀ_h [DH, BN] += Qᵀ_h dS  (A from the raw Q copy, B = dSᵀ); once its
            //      fragments are loaded, this warp is done with the raw copies
            step_product(smem + L::RQ, smem + L::DSTB, smem + L::DSTS, true);
#pragma unroll
            for (int i = 0; i < NT; ++i) dkt_acc[i] += step_acc[i];

            // ---- dQᵀ_h [DH, BM] = Kᵀ_h dSᵀ over the BN keys: A = Kᵀ_h split on the fly from
            //      raw K (columns d0, d0 + 1: one 8-byte load per key; keys in slot order),
            //      B = dS [BM][BN key slots] K-major; kt_small·ds_big first (zeroed dq_acc)
            float dq_acc[NS];
            u32 kt_big[NT], kt_small[NT];                  // [BN/8 k-steps][4]
#pragma unroll
            for (int kk = 0; kk < BN / 8; ++kk) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    u32 x, y;
                    lds64(smem + L::KR + swz(key_of_slot(8 * kk + c4 + 4 * hh), d0, L::KV_PANEL), x, y);
                    split_tf32(__uint_as_float(x), kt_big[4 * kk + 2 * hh], kt_small[4 * kk + 2 * hh]);
                    split_tf32(__uint_as_float(y), kt_big[4 * kk + 2 * hh + 1], kt_small[4 * kk + 2 * hh + 1]);
                }
            }
#pragma unroll
            for (int i = 0; i < NS; ++i) dq_acc[i] = 0.f;
            fence_regs<NS>(dq_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 8; ++kk) {
                const u32 off = (kk / 4) * L::DS_PANEL + (kk % 4) * 32;
                wgmma_rs_tf32<BM>(dq_acc, kt_small + 4 * kk, desc_at(desc_lo(smem + L::DSB), off));
                wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, desc_at(desc_lo(smem + L::DSS), off));
                wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, desc_at(desc_lo(smem + L::DSB), off));
            }
            wgmma_commit();
            // the tile's last reads of K, V by this thread are done (K, V are only loaded into
            // registers): the next tile's K, V may land
            if (st == wt.steps - 1) mbar_arrive(kv_empty);
            wgmma_wait<0>();
            fence_regs<NS>(dq_acc);
            fence_regs<NT>(kt_big);
            fence_regs<NT>(kt_small);
            if (cw == 0) named_bar_arrive(DS_EMPTY, 256);  // c0 is done with the step's dSᵀ, dS

            // ---- dq rows m0 .. += dQᵀ_hᵀ: this consumer's columns over the tile's keys
            float* dq_bh = (float*)p.dq + wt.batch * p.dq_stride_b + head * p.dq_stride_h;   // [s_q, D]
            add_dq_t(dq_bh, p.dq_stride_s, m0, p.s_q, d0, col_in_8, dq_acc);
            if (++mi == wt.m_count) {
                mi = 0;
                ++head;
            }
        }
        if (wt.steps > 0) ++kv_it;

        // ---- dK, dV rows n0 .. n0 + BN, this consumer's columns (GQA: summed over the group's
        //      query heads; zeros for a tile that no query sees): register i holds (column d0
        //      or d0 + 1 for i % 4 < 2 or >= 2, key 8·(i / 4) + col_in_8 + i % 2), float32 pairs
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            if (i % 4 >= 2) continue;
            const int key = n0 + (i / 4) * 8 + col_in_8 + (i % 2);
            if (key < p.s_k) {
                float* dk_row = (float*)p.dk + wt.batch * p.dk_stride_b + (i64)key * p.dk_stride_s +
                                wt.kv_head * p.dk_stride_h;   // [D]
                float* dv_row = (float*)p.dv + wt.batch * p.dv_stride_b + (i64)key * p.dv_stride_s +
                                wt.kv_head * p.dv_stride_h;   // [D]
                *(float2*)(dk_row + d0) = make_float2(dkt_acc[i], dkt_acc[i + 2]);
                *(float2*)(dv_row + d0) = make_float2(dvt_acc[i], dvt_acc[i + 2]);
            }
        }
    }
    // pt_full / pt_empty need no drain: each thread they count arrives once per step,
    // unconditionally, so each completes one phase per step (parity q_it & 1, q_it running on
    // across work tiles); the last pt_empty phase completes with nobody waiting. DS_EMPTY's
    // last arrivals (c0's) are taken, so the named barrier is left with no generation open
    if (q_it > 0 && cw == 1) named_bar_sync(DS_EMPTY, 256);
}

// Design S consumers (hd 64; warpgroups 1, 2: wg, and t, the lane in the warpgroup): each owns
// 64 keys of the tile (keys n0 + 64·cw ..) and all D columns of their dK, dV.
template <int D, bool WINDOW>
__device__ __forceinline__ void bwd_f32_consumer_s(const Params& p, const BwdF32Smem<D>& sm, int wg, int t) {
    using L = typename LayoutOf<D>::type;
    constexpr int BN = Shape<D>::BN;
    constexpr int NS = BM / 2;       // Sᵀ / dPᵀ accumulator registers per lane: [64 keys, BM]
    constexpr int NKV = D / 2;       // dK / dV accumulator registers per lane: [64 keys, D]
    constexpr int NQ = BM / 2;       // dQᵀ accumulator registers per lane: [D, BM]
    const u32 smem = sm.smem;
    float* rows_smem = sm.rows_smem;
    volatile int* tile_smem = sm.tile_smem;
    const u32 tile_full = sm.tile_full, tile_empty = sm.tile_empty, kv_raw = sm.kv_raw;
    const u32 kv_full = sm.kv_full, kv_empty = sm.kv_empty, nat_full = sm.nat_full;
    const u32 nat_empty = sm.nat_empty, t_full = sm.t_full, t_empty = sm.t_empty;
    const int cw = wg - 1;                                 // consumer 0 or 1: keys n0 + 64·cw ..
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int c4 = t % 4;
    const int col_in_8 = 2 * c4;                           // accumulator columns col_in_8, +1 (of 8)
    const u32 k_wg = smem + L::KB + cw * 64 * 128;         // this consumer's 64 rows of k_big
    const u32 ks_wg = smem + L::KS + cw * 64 * 128;        // ... of k_small
    const u32 v_wg = smem + L::VB + cw * 64 * 128;         // ... of v_big
    const u32 ds_big = smem + L::DS + cw * 2 * L::DS_PART; // dS [BM, 64 keys] big, then small
    const u32 ds_small = ds_big + L::DS_PART;
    const float* lse_smem = rows_smem;                     // [BM] lse·log2 e of the step
    const float* dsum_smem = rows_smem + BM;               // [BM] D of the step

    float dk_acc[NKV], dv_acc[NKV];   // dK, dV [64 keys, D], fp32
    u32 vs_frag[D / 2];               // V small [64 keys, D] as TF32 A fragments (4 per k-step)

    int q_it = 0, kv_it = 0;          // steps and K/V tiles consumed so far (barrier phases)
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const WorkTile wt = work_tile<D, WINDOW>(p, w);
        const int n0 = wt.n0;
        const int key0 = n0 + cw * 64 + row_in_wg;         // this lane's keys: key0, key0 + 8

#pragma unroll
        for (int i = 0; i < NKV; ++i) dk_acc[i] = dv_acc[i] = 0.f;
        if (wt.steps > 0) {
            mbar_wait(kv_raw, kv_it & 1);                  // V landed (the phase cannot move on
                                                           // before this consumer's kv_empty)
            // ---- V rows of this consumer: big back in place (the shared operand of v_big·do_big,
            //      v_big·do_small), small kept in vs_frag. Per 8-column k-step kk the A fragment is
            //      V(r, 8kk + c), V(r + 8, 8kk + c), V(r, 8kk + c + 4), V(r + 8, 8kk + c + 4)
            //      (r = row_in_wg, c = t % 4)
#pragma unroll
            for (int kk = 0; kk < D / 8; ++kk) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = row_in_wg + 8 * (e % 2), x = 8 * kk + c4 + 4 * (e / 2);
                    const u32 a = v_wg + swz(r, x, L::KV_PANEL);
                    u32 big;
                    split_tf32(lds32(a), big, vs_frag[4 * kk + e]);
                    sts32(a, big);
                }
            }
            fence_proxy_async();                   // the big part is read by wgmma (async proxy)
            named_bar_sync(WG_BAR + cw, 128);      // every warp of the warpgroup has written its rows
            // K split: waited after the V split, so the two splits overlap
            mbar_wait(kv_full, kv_it & 1);
        }

        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int m0 = step_m0(wt, st);
            const int head = step_head(p, wt, st);
            mbar_wait(nat_full, q_it & 1);                 // Q, dO parts and rows written

            // ---- Sᵀ = K Qᵀ  [64 keys, BM]: k-steps of 8 columns (32 bytes) through the D / 32
            //      panels; per k-step k_small·q_big + k_big·q_small + k_big·q_big (all SS)
            float s_acc[NS], dp_acc[NS];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 8; ++kk) {
                const u32 k_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;
                const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
                wgmma_ss_tf32<BM>(s_acc, smem_desc(ks_wg + k_off, 16, 1024),
                                  smem_desc(smem + L::QB + q_off, 16, 1024), kk > 0);
                wgmma_ss_tf32<BM>(s_acc, smem_desc(k_wg + k_off, 16, 1024),
                                  smem_desc(smem + L::QS + q_off, 16, 1024), 1);
                wgmma_ss_tf32<BM>(s_acc, smem_desc(k_wg + k_off, 16, 1024),
                                  smem_desc(smem + L::QB + q_off, 16, 1024), 1);
            }
            wgmma_commit();
            // ---- dPᵀ = V dOᵀ  [64 keys, BM]: v_big·do_big (first: it overwrites), v_big·do_small,
            //      v_small·do_big (registers); its own group, so Pᵀ starts when Sᵀ is done
#pragma unroll
            for (int kk = 0; kk < D / 8; ++kk) {
                const u32 v_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;
                const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
                wgmma_ss_tf32<BM>(dp_acc, smem_desc(v_wg + v_off, 16, 1024),
                                  smem_desc(smem + L::DOB + q_off, 16, 1024), kk > 0);
                wgmma_ss_tf32<BM>(dp_acc, smem_desc(v_wg + v_off, 16, 1024),
                                  smem_desc(smem + L::DOS + q_off, 16, 1024), 1);
                wgmma_rs_tf32<BM>(dp_acc, vs_frag + 4 * kk, smem_desc(smem + L::DOB + q_off, 16, 1024));
            }
            wgmma_commit();
            wgmma_wait<1>();                               // Sᵀ done (dPᵀ may still run)
            fence_regs<NS>(s_acc);

            // ---- Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e), masked, in place in s_acc
            bool need_mask = n0 + BN > p.s_k;
            if (WINDOW)
                need_mask |= n0 + BN - 1 > m0 + p.diag_offset + p.window_right ||
                             n0 < m0 + BM - 1 + p.diag_offset - p.window_left;
#pragma unroll
            for (int i = 0; i < NS; ++i) {
                const int col = (i / 4) * 8 + col_in_8 + (i % 2);   // query row m0 + col
                const int key = key0 + ((i % 4) >= 2 ? 8 : 0);
                float pe = fast_exp2(s_acc[i] * p.scale_log2 - lse_smem[col]);
                if (need_mask) {
                    const int diag = m0 + col + p.diag_offset;
                    bool keep = key < p.s_k;
                    // & (no short circuit): the SASS this role had written inside the kernel
                    if (WINDOW) keep = keep & (key <= diag + p.window_right) & (key >= diag - p.window_left);
                    if (!keep) pe = 0.f;
                }
                s_acc[i] = pe;
            }
            wgmma_wait<0>();                               // dPᵀ done
            fence_regs<NS>(dp_acc);
            fence_regs<D / 2>(vs_frag);                    // read by dPᵀ until here

            // ---- dSᵀ = Pᵀ ∘ (dPᵀ − D)·scale; Pᵀ and dSᵀ split into TF32 A fragments. Accumulator
            //      registers 4kk .. 4kk + 3 of query step kk hold (key r, query 2c), (r, 2c + 1),
            //      (r + 8, 2c), (r + 8, 2c + 1); fragment slots c, c + 4 are queries 2c, 2c + 1
            //      (Qᵀ / dOᵀ are stored to match): a = {x[4kk], x[4kk + 2], x[4kk + 1], x[4kk + 3]}
            u32 p_big[NS], p_small[NS], ds_bigf[NS], ds_smallf[NS];
#pragma unroll
            for (int kk = 0; kk < BM / 8; ++kk) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = 4 * kk + (e == 1 ? 2 : e == 2 ? 1 : e);
                    const int col = kk * 8 + col_in_8 + (i % 2);
                    const float ds = s_acc[i] * (dp_acc[i] - dsum_smem[col]) * p.scale;
                    split_tf32(s_acc[i], p_big[4 * kk + e], p_small[4 * kk + e]);
                    split_tf32(ds, ds_bigf[4 * kk + e], ds_smallf[4 * kk + e]);
                }
            }
            // this thread has read its rows (lse, D) and its Sᵀ, dPᵀ are done: Q, dO parts and
            // rows free. One arrival per thread: racecheck orders the next write of the rows
            // only after each reader's own arrival. (s_q > 0 holds in every step; as a branch it
            // keeps ptxas's schedule: unconditional, the hd 64 non-window variant spills 112 B.)
            if (p.s_q > 0) mbar_arrive(nat_empty);

            // ---- dS big / small -> this consumer's dS tile [BM queries, 64 keys] (keys
            //      contiguous in slot order, 128-byte swizzle, panels of 32 keys): the B operand of
            //      dQᵀ = Kᵀ dSᵀ. Slot e of step kk is key row_in_wg + 8(e % 2), query 8kk + 2c + e / 2.
#pragma unroll
            for (int kk = 0; kk < BM / 8; ++kk) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kl = row_in_wg + 8 * (e % 2), q = 8 * kk + col_in_8 + e / 2;
                    const u32 off = swz(q, slot_of_key(kl), L::DS_PANEL);
                    sts32(ds_big + off, ds_bigf[4 * kk + e]);
                    sts32(ds_small + off, ds_smallf[4 * kk + e]);
                }
            }
            fence_proxy_async();   // for the dQᵀ product (before the dV / dK group: ptxas 12.9)

            // ---- dV += Pᵀ dO, dK += dSᵀ Q  [64 keys, D]: B = dOᵀ / Qᵀ [D, BM] K-major, 8 queries
            //      (32 bytes) per k-step; per k-step small·big + big·small + big·big. Each step's
            //      product goes to a zeroed step accumulator, added to dV / dK in fp32 (round to
            //      nearest): the tensor cores' accumulation rounds toward zero, and 12 products per
            //      step into dV / dK directly biased them by ~steps·12·2⁻²⁴ relative (2048 rows:
            //      5e-5). dV, then dK, through the one step accumulator (32 registers).
            float step_acc[NKV];
            // step_acc [64 keys, D] += A [64 keys, BM] (big / small TF32 fragments) · B [BM, D]
            // (its transposed parts xt_big / xt_small [D, BM] K-major), issued and committed
            auto issue_step_product = [&](const u32* a_big, const u32* a_small, u32 xt_big, u32 xt_small) {
                fence_regs<NKV>(step_acc);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BM / 8; ++kk) {
                    const u32 off = (kk / 4) * L::T_PANEL + (kk % 4) * 32;
                    wgmma_rs_tf32<D>(step_acc, a_small + 4 * kk, smem_desc(xt_big + off, 16, 1024));
                    wgmma_rs_tf32<D>(step_acc, a_big + 4 * kk, smem_desc(xt_small + off, 16, 1024));
                    wgmma_rs_tf32<D>(step_acc, a_big + 4 * kk, smem_desc(xt_big + off, 16, 1024));
                }
                wgmma_commit();
            };
            mbar_wait(t_full, q_it & 1);                   // Qᵀ, dOᵀ parts written
#pragma unroll
            for (int i = 0; i < NKV; ++i) step_acc[i] = 0.f;
            issue_step_product(p_big, p_small, smem + L::DOTB, smem + L::DOTS);   // dV
            // every warp of this consumer has stored its dS rows (for dQᵀ below)
            named_bar_sync(WG_BAR + cw, 128);
            wgmma_wait<0>();                               // dV's step product done
            fence_regs<NKV>(step_acc);
            fence_regs<NS>(p_big);
            fence_regs<NS>(p_small);
#pragma unroll
            for (int i = 0; i < NKV; ++i) {
                dv_acc[i] += step_acc[i];
                step_acc[i] = 0.f;
            }
            issue_step_product(ds_bigf, ds_smallf, smem + L::QTB, smem + L::QTS);   // dK
            wgmma_wait<0>();                               // dK's step product done: fragments free
            fence_regs<NKV>(step_acc);
            fence_regs<NS>(ds_bigf);
            fence_regs<NS>(ds_smallf);
#pragma unroll
            for (int i = 0; i < NKV; ++i) dk_acc[i] += step_acc[i];
            if (t == 0) mbar_arrive(t_empty);              // Qᵀ, dOᵀ parts no longer needed

            // ---- dQᵀ_c [D, BM] = Kᵀ_c dSᵀ_c over this consumer's 64 keys: A = Kᵀ fragments from
            //      k_big / k_small, B = its dS tile [BM, 64 key slots] K-major (k-steps of 8 slots =
            //      32 bytes); kt_small·ds_big first (dq_acc zeroed: register-A products always
            //      accumulate), kt_big·ds_small, kt_big·ds_big. The fragment rows r, r + 8 are
            //      columns d0, d0 + 1 of K (d0 = 16·warp + 2·(lane / 4): a permutation of dQᵀ's rows,
            //      undone at the store), so each pair is one 8-byte load; columns c, c + 4 are the
            //      keys in slots c, c + 4.
            float dq_acc[NQ];
#pragma unroll
            for (int i = 0; i < NQ; ++i) dq_acc[i] = 0.f;
            const int d0 = 16 * (t / 32) + 2 * ((t % 32) / 4);
            u32 kt_big[D / 2], kt_small[D / 2];
#pragma unroll
            for (int kk = 0; kk < 64 / 8; ++kk) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 off = swz(key_of_slot(8 * kk + c4 + 4 * h), d0, L::KV_PANEL);
                    lds64(k_wg + off, kt_big[4 * kk + 2 * h], kt_big[4 * kk + 2 * h + 1]);
                    lds64(ks_wg + off, kt_small[4 * kk + 2 * h], kt_small[4 * kk + 2 * h + 1]);
                }
            }
            fence_regs<NQ>(dq_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 64 / 8; ++kk) {
                const u32 off = (kk / 4) * L::DS_PANEL + (kk % 4) * 32;
                wgmma_rs_tf32<BM>(dq_acc, kt_small + 4 * kk, smem_desc(ds_big + off, 16, 1024));
                wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, smem_desc(ds_small + off, 16, 1024));
                wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, smem_desc(ds_big + off, 16, 1024));
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs<NQ>(dq_acc);
            fence_regs<D / 2>(kt_big);
            fence_regs<D / 2>(kt_small);
            // every warp's dQᵀ product has read its dS tile before the next step's stores (and,
            // in the last step, its Kᵀ fragments: K, V free)
            named_bar_sync(WG_BAR + cw, 128);
            // the tile's last reads of K (Sᵀ, Kᵀ fragments) and V (dPᵀ) have completed: the next
            // tile's K, V may land while this one's dQ is added and dK, dV are stored
            if (st == wt.steps - 1 && t == 0) mbar_arrive(kv_empty);

            // ---- dq rows m0 .. += dQᵀ_cᵀ: this consumer's partial over its keys
            float* dq_bh = (float*)p.dq + wt.batch * p.dq_stride_b + head * p.dq_stride_h;   // [s_q, D]
            add_dq(dq_bh, p.dq_stride_s, m0, p.s_q, d0, col_in_8, dq_acc);
        }
        if (wt.steps > 0) ++kv_it;

        // ---- dK, dV of this consumer's 64 keys (GQA: summed over the group's query heads;
        //      zeros for a tile that no query sees), float32 pairs
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 8 * r;
            if (key < p.s_k) {
                float* dk_row = (float*)p.dk + wt.batch * p.dk_stride_b + (i64)key * p.dk_stride_s +
                                wt.kv_head * p.dk_stride_h;
                float* dv_row = (float*)p.dv + wt.batch * p.dv_stride_b + (i64)key * p.dv_stride_s +
                                wt.kv_head * p.dv_stride_h;
#pragma unroll
                for (int i = 0; i < NKV; i += 4) {
                    const int col = (i / 4) * 8 + col_in_8;
                    *(float2*)(dk_row + col) = make_float2(dk_acc[i + 2 * r], dk_acc[i + 2 * r + 1]);
                    *(float2*)(dv_row + col) = make_float2(dv_acc[i + 2 * r], dv_acc[i + 2 * r + 1]);
                }
            }
        }
    }
}

}  // namespace sm90bf
