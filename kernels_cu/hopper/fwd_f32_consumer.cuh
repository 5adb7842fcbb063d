// cupyflash: the float32 Hopper forward's consumer warpgroups (hopper/fwd_f32.cu): fwd_f32_consumer,
// the mainloop of one consumer over its 64 query rows of each work tile (QREG: its own Q split, S =
// Q Kᵀ in 3xTF32, masks and online softmax, P split into TF32 fragments, O += P V, pingpong turns
// with the other consumer) and the epilogue (hopper/fwd.cu's store_rows, empty rows).
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/epilogue.cuh"
#include "hopper/fwd_f32_layout.cuh"
#include "hopper/fwd_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/softmax.cuh"
#include "hopper/wgmma.cuh"

namespace sm90 {

// One consumer warpgroup of the float32 forward (wg = 1 .. NC, t: its lane in the warpgroup): the
// work tiles of the block, their key tiles taken from the producer's ring in consumption order.
template <typename E, int D, int BN, int STAGES, int NC, bool WINDOW, bool QREG>
__device__ __forceinline__ void fwd_f32_consumer(const Params& p,
                                                 const sm90f32::FwdF32Smem<D, BN, STAGES, NC, QREG>& sm,
                                                 int wg, int t) {
    using namespace sm90f32;   // (Regs and Layout exist in both: named with their namespace)
    using L = sm90f32::Layout<D, BN, STAGES, NC, QREG>;
    constexpr int BM = L::BM;
    constexpr bool SPLIT = Elem<E>::split;   // 3xTF32 (f32x3_t) or one TF32 product (tf32_t)
    constexpr int NS = BN / 2;       // S accumulator registers per lane: [64, BN] over 128 lanes
    constexpr int NO = D / 2;        // O accumulator registers per lane: [64, D]
    // O_RN: each key tile's P V goes to a zeroed accumulator added to O in fp32 (round to
    // nearest; the tensor cores' accumulation rounds toward zero, so O summed over s_k keys in
    // one accumulator drifts with s_k). 3xTF32 only (allow_tf32 keeps one accumulator). d <= 64:
    // one [64, D] accumulator (NO registers); d 128: PV_PARTS = 2 column halves through one
    // [64, D / 2] accumulator, the second half issued once the first is added (a whole second
    // [64, 128] fragment spills 324-440 B: these consumers also hold 64 registers of q_small)
    constexpr bool O_RN = SPLIT;
    constexpr int PV_PARTS = O_RN && D > 64 ? 2 : 1;
    constexpr int NPV = NO / PV_PARTS;   // accumulator registers of one P V part
    const u32 q_smem = sm.q_smem, q_small = sm.q_small, k_big = sm.k_big, k_small = sm.k_small;
    const u32 vt_big = sm.vt_big, vt_small = sm.vt_small, v_raw = sm.v_raw;
    const u32 q_raw = sm.q_raw, q_full = sm.q_full, q_empty = sm.q_empty, k_raw = sm.k_raw, v_rawb = sm.v_rawb;
    const u32 k_full = sm.k_full, v_full = sm.v_full, k_empty = sm.k_empty, v_empty = sm.v_empty;
    const u32 vraw_empty = sm.vraw_empty;
    volatile int* tile_smem = sm.tile_smem;
    const int cw = wg - 1;                                 // consumer 0 .. NC-1: rows 64·cw .. of a tile
    const int next_turn = TURN_BAR + (cw + 1) % NC;        // the consumer whose turn follows ours
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (t % 4);                      // accumulator columns col_in_8, +1 (of 8)
    const float sl2 = p.scale_log2;                        // score -> base-2 exponent factor

    // The consumer's state, declared last to first (in this order the role compiles to the SASS it
    // had written inside the kernel):
    u32 qs_frag[QREG && SPLIT ? D / 2 : 1];   // QREG: small part of this warpgroup's Q rows, TF32
                                              // A fragments (4 per 8-column k-step)
    u32 p_small[SPLIT ? NS : 1];   // P of the current key tile, TF32 A fragments: small part
    u32 p_big[NS];             // and big part
    float s_acc[NS];           // S [64, BN] of the current key tile, then P in place
    float alpha[2];            // O rescale factors of the current key tile
    float l_run[2] = {0.f, 0.f};           // running denominators (this lane's columns only)
    float m_run[2] = {-CF_INF, -CF_INF};   // running row max (raw scores)
    float pv_acc[O_RN ? NPV : 1];  // O_RN: P V [64, D / PV_PARTS] of the current key tile, fp32
    float o_acc[NO];           // O [64, D] of this warpgroup, fp32
    FwdTile wt;               // the current work tile
    int tile_i = 0;            // work tiles taken so far (the Q barriers' phase)
    int kv_it = 0;             // K/V ring position of the current key tile (runs on across tiles)

    // QREG: split this warpgroup's 64 rows of the landed Q tile: big written back in place (the
    // shared operand of q_big·k_big, q_big·k_small), small kept in qs_frag. Per k-step kk the A
    // fragment is Q(r, 8kk + c), Q(r + 8, 8kk + c), Q(r, 8kk + c + 4), Q(r + 8, 8kk + c + 4)
    // (r = row_in_wg, c = t % 4); in the swizzled panel, column x of row y sits at
    // (x / 32)·Q_PANEL + y·128 + 16·((x % 32 / 4) XOR y % 8) + 4·(x % 4): 8 rows x 4 columns of a
    // warp hit 32 distinct banks.
    auto split_q = [&]() {
        const u32 q_wg = q_smem + cw * WG_ROWS * 128;
#pragma unroll
        for (int kk = 0; kk < D / 8; kk += 2) {   // two k-steps at a time: 8 loads in flight
            u32 a[8];
            float q[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int r = row_in_wg + 8 * (e % 2), x = 8 * (kk + e / 4) + t % 4 + 4 * ((e / 2) % 2);
                a[e] = q_wg + (x / 32) * L::Q_PANEL + r * 128 + 16 * (((x % 32) / 4) ^ (r % 8)) + 4 * (x % 4);
                asm volatile("ld.shared.f32 %0, [%1];" : "=f"(q[e]) : "r"(a[e]) : "memory");
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                u32 big;
                if constexpr (SPLIT) split_tf32(q[e], big, qs_frag[4 * kk + e]);
                else big = tf32_rn(q[e]);
                asm volatile("st.shared.b32 [%0], %1;" :: "r"(a[e]), "r"(big) : "memory");
            }
        }
        fence_proxy_async();                   // the big part is read by wgmma (async proxy)
        named_bar_sync(WG_BAR + cw, 128);      // every warp of the warpgroup has written its rows
    };

    // Wait for work tile tile_i (index published, Q split). Tiles whose rows see no key are
    // finished right here (out = 0, lse = -inf). False when no work is left.
    auto fetch_tile = [&]() -> bool {
        for (;; ++tile_i) {
            mbar_wait(QREG ? q_raw : q_full, tile_i & 1);
            const int w = *tile_smem;   // released by this thread's own arrival on q_empty
            if (w < 0) return false;
            wt = fwd_work_tile<WINDOW, false, BM, BN>(p, w);
            if (wt.n_tiles > 0) {
                if constexpr (QREG) split_q();
                return true;
            }
            store_empty_rows<E, D, false>(p, wt, wt.m0 + cw * WG_ROWS, t);
            mbar_arrive(q_empty);
        }
    };
    auto key0 = [&](int it) { return (wt.t_first + wt.n_tiles - 1 - it) * BN; };   // right to left

    // ---- S = Q Kᵀ  [64, BN], fp32, of the key tile in ring position kv: k-steps of 8 columns
    //      (32 bytes) through the D / 32 panels; per k-step q_small·k_big + q_big·k_small +
    //      q_big·k_big (QREG: q_big·k_big first, q_small from registers) (issued and committed)
    auto issue_s = [&](int kv) {
        const int s = kv % STAGES;
        const u32 qb = q_smem + cw * WG_ROWS * 128;        // this warpgroup's 64 rows of each Q panel
        const u32 qs = q_small + cw * WG_ROWS * 128;
        const u32 kb = k_big + s * L::KVT, ks = k_small + s * L::KVT;
        mbar_wait(k_full + 8 * s, (kv / STAGES) & 1);
        wgmma_fence();   // a pipeline stage of its own: O's product may be waited for alone
#pragma unroll
        for (int kk = 0; kk < D / 8; ++kk) {
            const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
            const u32 k_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;
            if constexpr (QREG) {
                wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                  smem_desc(kb + k_off, 16, 1024), kk > 0);
                if constexpr (SPLIT) {
                    wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                      smem_desc(ks + k_off, 16, 1024), 1);
                    wgmma_rs_tf32<BN>(s_acc, qs_frag + 4 * kk, smem_desc(kb + k_off, 16, 1024));
                }
            } else {
                if constexpr (SPLIT) {
                    wgmma_ss_tf32<BN>(s_acc, smem_desc(qs + q_off, 16, 1024),
                                      smem_desc(kb + k_off, 16, 1024), kk > 0);
                    wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                      smem_desc(ks + k_off, 16, 1024), 1);
                }
                wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                  smem_desc(kb + k_off, 16, 1024), SPLIT || kk > 0);
            }
        }
        wgmma_commit();
    };
    // ---- O += P V  [64, D] of the key tile in ring position kv (columns of part `part`: D /
    //      PV_PARTS of them): B = Vᵀ [D, BN] K-major, 8 keys (32 bytes) per k-step through the
    //      BN / 32 panels; per k-step p_small·vt_big + p_big·vt_small + p_big·vt_big
    auto issue_pv = [&](int kv, int part) {
        constexpr int N = D / PV_PARTS;                   // output columns of one part
        const int s = kv % STAGES;
        const u32 rows = part * N * 128;                  // the part's Vᵀ rows (1024-aligned)
        const u32 vb = vt_big + s * L::KVT + rows, vs = vt_small + s * L::KVT + rows;
        if (part == 0) mbar_wait(v_full + 8 * s, (kv / STAGES) & 1);
        float* acc = O_RN ? pv_acc : o_acc;               // O_RN: a fresh P V, added by add_pv
        if constexpr (O_RN) {
#pragma unroll
            for (int i = 0; i < NPV; ++i) pv_acc[i] = 0.f;
        }
        fence_regs<O_RN ? NPV : NO>(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 8; ++kk) {
            const u32 off = (kk / 4) * L::VT_PANEL + (kk % 4) * 32;
            if constexpr (SPLIT) {
                wgmma_rs_tf32<N>(acc, p_small + 4 * kk, smem_desc(vb + off, 16, 1024));
                wgmma_rs_tf32<N>(acc, p_big + 4 * kk, smem_desc(vs + off, 16, 1024));
            }
            wgmma_rs_tf32<N>(acc, p_big + 4 * kk, smem_desc(vb + off, 16, 1024));
        }
        wgmma_commit();
    };
    // O_RN: the completed P V of part `part` added to O's columns of that part in fp32
    auto add_pv = [&](int part) {
        if constexpr (O_RN) {
            fence_regs<NPV>(pv_acc);
#pragma unroll
            for (int i = 0; i < NPV; ++i) o_acc[part * NPV + i] += pv_acc[i];   // rounded to nearest
        }
    };
    // S of ring position kv has completed: release its K stage, and, when it was the work tile's
    // last S, the Q tile and the tile index (every consumer thread arrives after its own reads:
    // the producer overwrites them once q_empty completes; once per work tile, and a warp
    // broadcast of the index cost the hd 128 variant 4 bytes of spill)
    auto s_done = [&](int kv, bool last_s) {
        fence_regs<NS>(s_acc);
        if constexpr (QREG && SPLIT) fence_regs<D / 2>(qs_frag);   // read by S until here
        if (t == 0) mbar_arrive(k_empty + 8 * (kv % STAGES));
        if (last_s) mbar_arrive(q_empty);
    };
    // O += P V of ring position kv, part 0 issued (the last wgmma group): with PV_PARTS = 2 wait
    // for it, add it and issue part 1 (the same P, the next D / 2 rows of Vᵀ) into the same
    // accumulator. (Issuing part 0 before the next S, so that part 1 follows it while S runs,
    // timed 0-5 % slower at hd 128 on the H200)
    auto pv_next = [&](int kv) {
#pragma unroll
        for (int part = 1; part < PV_PARTS; ++part) {
            wgmma_wait<0>();
            add_pv(part - 1);
            issue_pv(kv, part);
        }
    };
    // The last part of O += P V of ring position kv: wait for it, add it, release the Vᵀ stage
    auto pv_done = [&](int kv) {
        wgmma_wait<0>();
        fence_regs<NO>(o_acc);
        add_pv(PV_PARTS - 1);
        fence_regs<NS>(p_big);           // P stayed untouched while the product read it
        if constexpr (SPLIT) fence_regs<NS>(p_small);
        if (t == 0) mbar_arrive(v_empty + 8 * (kv % STAGES));
    };

    // Online softmax on the scores of one key tile (keys n0 ..), in place in s_acc: masks,
    // running max m, P = exp2(s·scale·log2e − shift), denominator l, and the factors alpha that
    // rescale O (applied by pack_p, once the previous O += P V has completed): hopper/fwd.cu's
    auto softmax_scores = [&](int n0) {
        online_softmax<NS, BN, WINDOW>(s_acc, m_run, l_run, alpha, p, wt, n0,
                                       wt.m0 + cw * WG_ROWS + row_in_wg, col_in_8, sl2);
    };
    // O rescale by alpha, and P split into the TF32 A fragments of the next O += P V (the
    // previous product, which read O and the old P, has completed). Accumulator registers
    // 4kk .. 4kk + 3 of key step kk hold P(r, 2c), P(r, 2c + 1), P(r + 8, 2c), P(r + 8, 2c + 1);
    // fragment slots c and c + 4 of the step are keys 2c and 2c + 1 (Vᵀ is stored to match), so
    // a = {P(r, 2c), P(r + 8, 2c), P(r, 2c + 1), P(r + 8, 2c + 1)}.
    auto pack_p = [&]() {
        rescale_o<NO>(o_acc, alpha);
#pragma unroll
        for (int kk = 0; kk < BN / 8; ++kk) {
            const float a[4] = {s_acc[4 * kk], s_acc[4 * kk + 2], s_acc[4 * kk + 1], s_acc[4 * kk + 3]};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (SPLIT) split_tf32(a[e], p_big[4 * kk + e], p_small[4 * kk + e]);
                else p_big[4 * kk + e] = tf32_rn(a[e]);
            }
        }
    };
    // The first key tile of work tile wt, whose S has completed: fresh O, m, l, then its softmax
    auto start_tile = [&]() {
        reset_rows<NO>(o_acc, m_run, l_run);
        softmax_scores(key0(0));
        pack_p();
    };
    // ---- final O / l and lse of work tile wt (rows past s_q are not stored): float32 out
    auto store_tile = [&]() {
        store_rows<E, NO, false>(p, wt, o_acc, m_run, l_run, sl2, wt.m0 + cw * WG_ROWS + row_in_wg,
                                 col_in_8, t % 4 == 0);
    };
    // Turn-taking on the tensor cores (NC = 2: named barrier TURN_BAR + c is consumer c's turn;
    // one consumer alone needs none)
    auto turn_begin = [&]() { if constexpr (NC > 1) named_bar_sync(TURN_BAR + cw, 256); };
    auto turn_end = [&]() { if constexpr (NC > 1) named_bar_arrive(next_turn, 256); };
    // A turn with the S of the current tile's first key tile alone (no O += P V in flight)
    auto first_turn = [&]() {
        turn_begin();
        issue_s(kv_it);
        turn_end();
        wgmma_wait<0>();
        s_done(kv_it, wt.n_tiles == 1);
        start_tile();
    };
    // A turn with the last O += P V of the current tile alone
    auto last_turn = [&]() {
        turn_begin();
        issue_pv(kv_it, 0);
        turn_end();
        pv_next(kv_it);
        pv_done(kv_it);
        ++kv_it;
    };

    // Pingpong (NC = 2), as hopper/fwd.cu: consumer 0 takes the very first turn (its own arrival
    // here plus its first sync complete barrier TURN_BAR); every consumer walks the same work
    // tiles and takes the same n_tiles + 1 turns per tile, so the order holds across tiles.
    if constexpr (NC > 1) {
        if (cw == 0) named_bar_arrive(TURN_BAR, 256);
    }

    if (fetch_tile()) {
        first_turn();
        for (;;) {
            // ---- every key tile but the last: in our turn S of key tile it + 1, then O += P V
            //      of key tile it; the softmax of S(it + 1) runs while O += P V is on the tensor
            //      cores (unconditional waits, the last O += P V peeled off: hopper/fwd.cu)
            const int last = wt.n_tiles - 1;
            for (int it = 0; it < last; ++it, ++kv_it) {
                turn_begin();
                issue_s(kv_it + 1);
                issue_pv(kv_it, 0);
                turn_end();
                wgmma_wait<1>();                         // S done (O += P V may still run)
                s_done(kv_it + 1, it + 1 == last);
                pv_next(kv_it);                          // PV_PARTS = 2: part 1 issued
                softmax_scores(key0(it + 1));            // (under the last part)
                pv_done(kv_it);                          // O += P V done (every part)
                pack_p();
            }
            // ---- the tile's last key tile, the epilogue, then the next tile
            last_turn();
            store_tile();
            ++tile_i;
            if (!fetch_tile()) break;
            first_turn();
        }
    }
}

}  // namespace sm90
