// cupyflash: the Hopper dbias kernel's consumer role (hopper/dbias.cu wires it): dbias_consumer,
// per pair S = Q Kᵀ and dP = dO Vᵀ on wgmma, P with the staged bias (and the window mask),
// acc += P ∘ (dP − D), and each work tile's dbias store.
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/dbias_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

namespace sm90d {

// One consumer warpgroup of flash_bwd_dbias_sm90 (its template arguments), wg = 1 or 2, thread t
// (lane t % 32) of its 128: 64 query rows of each work tile the TMA thread hands on, until none
// is left; its registers hold the tile's Σ dS [64, BN]. (It reads the addresses from the
// DbiasSmem record into locals first: so it compiles to the SASS it had written inside the
// kernel.)
template <typename E, int D, bool BIAS_F32, int STAGES, int BIASBUF, bool WINDOW>
__device__ __forceinline__ void dbias_consumer(const Params& p, const DbiasSmem& sm, int wg, int t, int lane) {
    using L = Layout<D, BIAS_F32, STAGES, BIASBUF>;
    typedef typename Elem<E>::storage S;
    constexpr int NS = BN / 2;       // S / dP / acc accumulator registers per lane: [64, BN]
    const u32 ring_smem = sm.ring_smem, bias_smem = sm.bias_smem;
    volatile int* tile_smem = sm.tile_smem;
    const u32 ring_full = sm.ring_full, ring_empty = sm.ring_empty, bias_full = sm.bias_full;
    const u32 bias_empty = sm.bias_empty, tile_full = sm.tile_full, tile_empty = sm.tile_empty;
    const int cw = wg - 1;                                 // consumer 0 or 1: rows m0 + 64·cw ..
    const int row_in_wg = (t / 32) * 16 + lane / 4;       // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (lane % 4);                   // accumulator columns col_in_8, +1 (of 8)
    // Accumulator [64, BN] layout (wgmma m64nN fp32): x[i] is row row_in_wg + 8·((i % 4) >= 2),
    // column 8·(i / 4) + col_in_8 + (i % 2).
    float acc[NS];                    // Σ dS over the pairs, fp32

    // ring positions consumed so far (as the producer's); declared in this order: it decides the
    // order of their copies at the tile loop's entry, and so the registers (as in the kernel)
    int bias_it = 0, half_it = 0;
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const DbiasTile wt = dbias_tile<BM, BN, WINDOW>(p, w);
        const int row0 = wt.m0 + cw * 64 + row_in_wg;     // this lane's rows: row0, row0 + 8
        const int bb = bias_it % BIASBUF;
        const u32 bias_tile = bias_smem + bb * L::BIAS_TILE;   // [BN / BIAS_KEYS][BM][BIAS_KEYS]
#pragma unroll
        for (int i = 0; i < NS; ++i) acc[i] = 0.f;

        for (int it = 0; it < wt.pairs; ++it, half_it += 2) {
            int batch, head;
            pair_of(p, wt, it, &batch, &head);
            // lse·log2 e and D of rows row0, row0 + 8 (past s_q, or lse = −inf: +inf and 0, P = 0)
            float lse2[2], dsum[2];
            const i64 rows = ((i64)batch * p.h + head) * p.s_q;   // [b, h, s_q] index of row 0
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + 8 * r;
                const float l = row < p.s_q ? p.lse[rows + row] : -CF_INF;
                lse2[r] = l == -CF_INF ? CF_INF : l * CF_LOG2E;
                dsum[r] = row < p.s_q ? p.dsum[rows + row] : 0.f;
            }

            // ---- S = Q Kᵀ  [64, BN] (half A) and dP = dO Vᵀ  [64, BN] (half B), fp32: two
            //      groups, so P can start as soon as S is done; k-steps of 16 columns (32 bytes)
            //      within the D / 64 panels
            float s_acc[NS], dp_acc[NS];
            const int sa = half_it % STAGES, sb = (half_it + 1) % STAGES;
            const u32 q_wg = ring_smem + sa * L::HALF + cw * 64 * 128;    // this consumer's 64 Q rows
            const u32 k_tile = ring_smem + sa * L::HALF + L::Q_TILE;      // [BN, D]
            const u32 do_wg = ring_smem + sb * L::HALF + cw * 64 * 128;   // its 64 dO rows
            const u32 v_tile = ring_smem + sb * L::HALF + L::Q_TILE;      // [BN, D]
            mbar_wait(ring_full + 8 * sa, (half_it / STAGES) & 1);        // Q, K of the pair landed
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32, koff = (kk / 4) * L::K_PANEL + (kk % 4) * 32;
                wgmma_ss<E, BN>(s_acc, smem_desc(q_wg + off, 16, 1024), smem_desc(k_tile + koff, 16, 1024), kk > 0);
            }
            wgmma_commit();
            mbar_wait(ring_full + 8 * sb, ((half_it + 1) / STAGES) & 1);  // dO, V of the pair landed
            wgmma_fence();   // a group of its own: S may be waited for alone
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32, koff = (kk / 4) * L::K_PANEL + (kk % 4) * 32;
                wgmma_ss<E, BN>(dp_acc, smem_desc(do_wg + off, 16, 1024), smem_desc(v_tile + koff, 16, 1024), kk > 0);
            }
            wgmma_commit();
            if (it == 0) mbar_wait(bias_full + 8 * bb, (bias_it / BIASBUF) & 1);   // the tile's bias landed
            wgmma_wait<1>();                         // S done (dP may still run)
            fence_regs<NS>(s_acc);
            if (t == 0) mbar_arrive(ring_empty + 8 * sa);   // Q, K no longer read by this consumer

            // ---- P = exp2(S·scale·log2 e + bias·log2 e − lse·log2 e), in place in s_acc; 16 keys
            //      (s_acc[8kb .. 8kb + 7]) per step kb
#pragma unroll
            for (int kb = 0; kb < BN / 16; ++kb) {
                float bias[8];   // bias of s_acc[8kb + e]
                if constexpr (!BIAS_F32) {
                    // One ldmatrix.x4 from the [BM, 64]-key panel kb / 4: matrix mt = lane / 8 is
                    // rows 8·(mt % 2) .. + 7 of the warp's 16 and keys 8·(mt / 2) .. + 7 of the 16
                    // (a 16-byte chunk, swizzled: chunk XOR row mod 8; rows: lane % 8 gives their
                    // addresses); lane l receives row l / 4, keys 2(l % 4), + 1 of each matrix:
                    // register j holds s_acc[8kb + 2j], [8kb + 2j + 1]'s pair (low half first)
                    const int mt = lane / 8;
                    const int row = cw * 64 + (t / 32) * 16 + (mt % 2) * 8 + lane % 8;   // tile row
                    const int chunk = (kb % 4) * 2 + mt / 2;
                    u32 pairs[4];
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(pairs[0]), "=r"(pairs[1]), "=r"(pairs[2]), "=r"(pairs[3])
                                 : "r"(bias_tile + (kb / 4) * L::BIAS_PANEL + row * 128 + ((chunk ^ (lane % 8)) << 4)));
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        bias[2 * j] = to_float<E>((S)(pairs[j] & 0xffffu));
                        bias[2 * j + 1] = to_float<E>((S)(pairs[j] >> 16));
                    }
                } else {
                    // float32 panels [BM, 32 keys]: s_acc[8kb + 4h + 2r + e] is row row_in_wg + 8r,
                    // key 16kb + 8h + col_in_8 + e: one 8-byte pair per (h, r), chunk (key % 32) / 4
                    // XOR row mod 8 (= lane / 4)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int row = cw * 64 + row_in_wg + 8 * r, key = 16 * kb + 8 * hh + col_in_8;
                            const u32 addr = bias_tile + (key / 32) * L::BIAS_PANEL + row * 128 +
                                             ((((key % 32) / 4) ^ (row % 8)) << 4) + (key % 4) * 4;
                            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                                         : "=f"(bias[4 * hh + 2 * r]), "=f"(bias[4 * hh + 2 * r + 1]) : "r"(addr));
                        }
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const int i = 8 * kb + e, r = (i % 4) / 2;
                    float pe = fast_exp2(fmaf(s_acc[i], p.scale_log2, fmaf(bias[e], CF_LOG2E, -lse2[r])));
                    if (WINDOW && wt.need_mask) {   // key j kept when diag(i) − left <= j <= diag(i) + right
                        const int key = wt.n0 + 8 * (i / 4) + col_in_8 + (i % 2);
                        const int diag = row0 + 8 * r + p.diag_offset;
                        if (key > diag + p.window_right || key < diag - p.window_left) pe = 0.f;
                    }
                    s_acc[i] = pe;
                }
            }
            if (it == wt.pairs - 1) {   // the tile's last read of its bias: this warp frees the buffer
                __syncwarp();
                if (lane == 0) mbar_arrive(bias_empty + 8 * bb);
            }

            // ---- acc += P ∘ (dP − D)
            wgmma_wait<0>();                         // dP done
            fence_regs<NS>(dp_acc);
            if (t == 0) mbar_arrive(ring_empty + 8 * sb);   // dO, V no longer read by this consumer
#pragma unroll
            for (int i = 0; i < NS; ++i) acc[i] = fmaf(s_acc[i], dp_acc[i] - dsum[(i % 4) / 2], acc[i]);
        }
        if (wt.pairs > 0) ++bias_it;

        // ---- the dbias tile of plane (pb, ph) in the bias's type (zeros for a tile outside the
        //      window), rows row0, row0 + 8; a lane's keys col, col + 1 as one store where dbias
        //      rows are contiguous with an even s_k (pairs aligned: the launcher's dbias is
        //      contiguous, so every row starts at an even element)
        typedef typename BiasElem<BIAS_F32, S>::type BT;
        BT* plane = (BT*)p.dbias + wt.pb * p.dbias_stride_b + wt.ph * p.dbias_stride_h;   // [s_q, s_k] (strided)
        const bool pairs_ok = p.dbias_stride_k == 1 && p.s_k % 2 == 0;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 8 * r;
            if (row >= p.s_q) continue;
            BT* row_gmem = plane + (i64)row * p.dbias_stride_q;   // [s_k] (strided)
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                const int key = wt.n0 + 8 * n + col_in_8;         // even
                const float v0 = acc[4 * n + 2 * r], v1 = acc[4 * n + 2 * r + 1];
                if (pairs_ok) {
                    if (key < p.s_k) {
                        if constexpr (BIAS_F32) *(float2*)(row_gmem + key) = make_float2(v0, v1);
                        else *(u32*)(row_gmem + key) = pack2<E>(v0, v1);
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < 2; ++c)
                        if (key + c < p.s_k) {
                            if constexpr (BIAS_F32) row_gmem[(i64)(key + c) * p.dbias_stride_k] = c ? v1 : v0;
                            else row_gmem[(i64)(key + c) * p.dbias_stride_k] = from_float<E>(c ? v1 : v0);
                        }
                }
            }
        }
    }
}

}  // namespace sm90d
