// cupyflash: flash_bwd_sm90's consumer warpgroups at head dim 256 (Layout::SPLIT_D; hopper/bwd.cu
// wires them). dK and dV [64 keys, 256] do not fit one warpgroup's registers (256 per lane), so
// both consumers take the same 64 keys (BN = 64) and half of the head dim each: consumer c keeps
// dK, dV [64 keys, 128 columns from 128·c] (128 registers per lane). The step's two
// full-width products are shared out, c0: Sᵀ = K Qᵀ, c1: dPᵀ = V dOᵀ [64 keys, BM]; Pᵀ and dSᵀ
// go from one to the other through shared memory:
//   c0: Sᵀ -> Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e) (masked) -> pT_smem      [pt_full]
//   c1: dPᵀ; Pᵀ read back -> dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale -> dsT_smem           [SPLIT_DS_FULL]
//   both: dV_c += Pᵀ dO[:, half c] (Pᵀ from registers), dK_c += dSᵀ Q[:, half c] (dSᵀ from
//         dsT_smem, K-major), dQ[BM, half c] = dS K[:, half c] (dsT_smem and K MN-major), the
//         dQ slice added to the float32 accumulator from registers (red.global.add.v2: a dQ tile
//         [BM, 256] in shared memory would take 64 KB more than the block has).
// Pᵀ reaches c1 as E (its dSᵀ is computed from the rounded Pᵀ, which its dV product uses too).
// DET (deterministic=True): each consumer adds its half of a dQ tile after the key tiles before
// its own (dq_rank, the 16-bit backward's order), on its own semaphore per (tile, half): thread 0
// waits (acquire), the warpgroup adds, fences, and thread 0 releases rank + 1.
// Handoffs (docs/reliability.md's rule: the thread that accesses a handed-over value releases
// it): c1 reads Pᵀ with its own loads, so Pᵀ goes through two mbarriers with one arrival per
// thread (pt_full: c0's 128 writers; pt_empty: c1's 128 readers; pt_empty's order is also implied
// by SPLIT_DS_FULL, kept so that racecheck sees it); dSᵀ is read only by wgmma, so it goes through
// the named barriers SPLIT_DS_FULL (both sync, c1 after its stores: c1's own products read every
// c1 warp's rows) and SPLIT_DS_EMPTY (c0 arrives once its products that read dSᵀ have completed,
// c1 syncs before its next stores; and once more after its last step, so no generation is left
// open). tests/models/test_sm90_bwd_split_protocol.py models it.
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

namespace sm90b {

// Byte address of accumulator pair i (registers i, i + 1; i even) of lane t in a [64 keys, BM]
// 16-bit tile (row = key, 128 bytes = BM queries, 16-byte chunks XOR row mod 8: the 128-byte
// swizzle of a K-major wgmma operand): key row_in_wg (+ 8 for i % 4 >= 2), queries
// 8·(i / 4) + 2·(t % 4), + 1
__device__ __forceinline__ u32 frag_pair_addr(u32 tile, int row_in_wg, int t, int i) {
    const int r = row_in_wg + ((i % 4) >= 2 ? 8 : 0);
    return tile + r * 128 + (((i / 4) ^ (r & 7)) << 4) + 4 * (t % 4);
}

// One consumer warpgroup (wg = 1: c0, 2: c1; thread t of its 128) of the d = 256 kernel, until
// the TMA thread hands on no more work tiles.
template <typename E, int D, bool WINDOW, bool VARLEN, bool DET>
__device__ __forceinline__ void bwd_split_consumer(const Params& p, const Smem& sm, int wg, int t) {
    using L = Layout<D, 1, false, DET>;
    static_assert(L::SPLIT_D && BM == 64, "d = 256: 64 keys per tile, 64 query rows per step");
    typedef typename Elem<E>::storage S;
    constexpr int BN = L::BN;
    constexpr int DH = D / 2;            // head-dim columns per consumer
    constexpr int NS = BM / 2;           // Sᵀ / dPᵀ accumulator registers per lane: [64, BM]
    constexpr int NKV = DH / 2;          // dK / dV accumulator registers per lane: [64, DH]
    constexpr int NQ = DH / 2;           // dQ slice registers per lane: [BM, DH]
    const u32 k_smem = sm.k_smem, v_smem = sm.v_smem, q_smem = sm.q_smem, do_smem = sm.do_smem;
    const u32 ds_tile = sm.ds_smem, pt_tile = sm.smem + L::PT;     // [BN keys, BM queries] each
    const u32 pt_full = sm.tile_empty + 8 * TILE_RING, pt_empty = pt_full + 8;
    // consumer 0 or 1 (warp-uniform: descriptors derived from it stay uniform)
    const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
    const int half = cw * (DH / PANEL_COLS);   // this consumer's first 64-column panel
    // wgmma descriptors (K-major: LBO 16; MN-major: LBO = bytes between 64-column panels)
    const u64 kv_desc = smem_desc(cw == 0 ? k_smem : v_smem, 16, 1024);          // Sᵀ / dPᵀ: A
    const u64 qd_desc = smem_desc(cw == 0 ? q_smem : do_smem, 16, 1024);         // Sᵀ / dPᵀ: B
    const u64 q_desc_mn = smem_desc(q_smem, L::Q_PANEL, 1024), do_desc_mn = smem_desc(do_smem, L::Q_PANEL, 1024);
    const u64 k_desc_mn = smem_desc(k_smem, L::KV_PANEL, 1024);
    const u64 dst_desc = smem_desc(ds_tile, 16, 1024);           // dSᵀ as A of dK (K-major)
    const u64 ds_desc_mn = smem_desc(ds_tile, L::DS_TILE, 1024); // dS as A of dQ (MN-major)
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (t % 4);                      // accumulator columns col_in_8, +1 (of 8)

    float dk_acc[NKV], dv_acc[NKV];   // dK, dV [64 keys, DH columns from DH·cw], fp32
    int q_it = 0, kv_it = 0;          // Q / dO steps and K / V tiles consumed (ring positions)
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(sm.tile_smem, sm.tile_full, sm.tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const KeyTile wt = key_tile<BN, BM, WINDOW, VARLEN, BIAS_NONE, DET>(p, w);
        const int n0 = wt.n0;
        const int key0 = n0 + row_in_wg;                   // this lane's keys: key0, key0 + 8
#pragma unroll
        for (int i = 0; i < NKV; ++i) dk_acc[i] = dv_acc[i] = 0.f;
        if (wt.steps > 0) mbar_wait(sm.kv_full, kv_it & 1);   // K, V of the tile landed

        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int m0 = step_m0<BM, DET>(p, wt, st);
            const int head = step_head<DET>(p, wt, st);
            const int s = q_it % NBUF;
            const float* lse_smem = sm.rows_smem + s * 2 * BM;   // [BM] lse·log2 e of the step
            const float* dsum_smem = lse_smem + BM;              // [BM] D of the step

            // ---- c0: Sᵀ = K Qᵀ, c1: dPᵀ = V dOᵀ  [64 keys, BM], fp32, over the full head dim
            float x_acc[NS];
            mbar_wait(sm.qdo_full + 8 * s, (q_it / NBUF) & 1);   // Q, dO, lse, D of the step landed
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;   // K / V: panel, 16 columns
                const u32 qoff = s * L::Q_TILE + (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
                wgmma_ss<E, BM>(x_acc, desc_add(kv_desc, off), desc_add(qd_desc, qoff), kk > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs<NS>(x_acc);

            u32 p_frag[NS / 2];   // Pᵀ as E pairs: the A fragments of dV += Pᵀ dO
            if (cw == 0) {
                // ---- Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e), masked (keys past s_k, window)
                const int nk = wt.s_k - n0, nrel = n0 - wt.diag;   // keys of the tile; key − diag(row) = nrel + (key − n0) − row
                bool need_mask = nk < BN;
                if (WINDOW)
                    need_mask |= nrel + BN - 1 > m0 + p.window_right || nrel < m0 + BM - 1 - p.window_left;
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    const int col = (i / 4) * 8 + col_in_8 + (i % 2);   // query row m0 + col
                    const int kt = row_in_wg + ((i % 4) >= 2 ? 8 : 0);  // key n0 + kt
                    float pe = fast_exp2(x_acc[i] * p.scale_log2 - lse_smem[col]);
                    if (need_mask) {
                        const int rel = nrel + kt - m0 - col;
                        bool keep = kt < nk;
                        if (WINDOW) keep = keep & (rel <= p.window_right) & (rel >= -p.window_left);
                        if (!keep) pe = 0.f;
                    }
                    x_acc[i] = pe;
                }
#pragma unroll
                for (int i = 0; i < NS; i += 2) p_frag[i / 2] = pack2<E>(x_acc[i], x_acc[i + 1]);
                // ---- Pᵀ -> pT_smem for c1, once c1 has read the last one
                if (q_it > 0) mbar_wait(pt_empty, (q_it - 1) & 1);
#pragma unroll
                for (int i = 0; i < NS; i += 2)
                    asm volatile("st.shared.b32 [%0], %1;" :: "r"(frag_pair_addr(pt_tile, row_in_wg, t, i)),
                                 "r"(p_frag[i / 2]) : "memory");
                mbar_arrive(pt_full);   // this thread's Pᵀ pairs written (release)
            } else {
                // ---- c1: Pᵀ from c0 (its own pairs), dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale
                mbar_wait(pt_full, q_it & 1);
#pragma unroll
                for (int i = 0; i < NS; i += 2)
                    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(p_frag[i / 2])
                                 : "r"(frag_pair_addr(pt_tile, row_in_wg, t, i)) : "memory");
                mbar_arrive(pt_empty);  // this thread's reads done
                u32 ds_pair[NS / 2];
#pragma unroll
                for (int i = 0; i < NS; i += 2) {
                    const int col = (i / 4) * 8 + col_in_8;
                    const float p0 = to_float<E>((S)(p_frag[i / 2] & 0xffffu));
                    const float p1 = to_float<E>((S)(p_frag[i / 2] >> 16));
                    ds_pair[i / 2] = pack2<E>(p0 * (x_acc[i] - dsum_smem[col]) * p.scale,
                                              p1 * (x_acc[i + 1] - dsum_smem[col + 1]) * p.scale);
                }
                // ---- dSᵀ -> dsT_smem, once c0's products have read the last one
                if (q_it > 0) named_bar_sync(SPLIT_DS_EMPTY, 256);
#pragma unroll
                for (int i = 0; i < NS; i += 2)
                    asm volatile("st.shared.b32 [%0], %1;" :: "r"(frag_pair_addr(ds_tile, row_in_wg, t, i)),
                                 "r"(ds_pair[i / 2]) : "memory");
                fence_proxy_async();    // generic stores -> visible to the wgmma reads below
            }

            // ---- dV_c += Pᵀ dO[:, half c]  [64 keys, DH]: Pᵀ from registers, dO MN-major
            fence_regs<NKV>(dv_acc);
            fence_regs<NKV>(dk_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_rs<E, DH>(dv_acc, p_frag + 4 * kk,
                                desc_add(do_desc_mn, s * L::Q_TILE + half * L::Q_PANEL + kk * 2048));
            wgmma_commit();
            // every c1 warp's dSᵀ rows written and fenced (a sync for c1 too: its own products
            // below read the rows of all four of its warps)
            named_bar_sync(SPLIT_DS_FULL, 256);
            // ---- dK_c += dSᵀ Q[:, half c]  [64 keys, DH]: dSᵀ K-major (16 queries = 32 bytes
            //      per k-step), Q MN-major
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_ss_tb<E, DH>(dk_acc, desc_add(dst_desc, kk * 32),
                                   desc_add(q_desc_mn, s * L::Q_TILE + half * L::Q_PANEL + kk * 2048), 1);
            wgmma_commit();
            wgmma_wait<0>();                      // dV, dK done: Q, dO (and lse, D) of stage s read
            fence_regs<NKV>(dv_acc);
            fence_regs<NKV>(dk_acc);
            fence_regs<NS / 2>(p_frag);
            mbar_arrive(sm.qdo_empty + 8 * s);    // each thread after its own reads of the stage
            // ---- dQ[BM, half c] = dS K[:, half c] over the tile's 64 keys; both MN-major (issued
            //      once dV is done: with Pᵀ's fragments still held, ptxas serializes the wgmmas)
            float dq_acc[NQ];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_ss_tt<E, DH>(dq_acc, desc_add(ds_desc_mn, kk * 2048),
                                   desc_add(k_desc_mn, half * L::KV_PANEL + kk * 2048), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();                      // dQ done: dsT_smem and K read
            fence_regs<NQ>(dq_acc);
            if (cw == 0) named_bar_arrive(SPLIT_DS_EMPTY, 256);

            // ---- dQ slice (rows row_in_wg, +8; chunk-swizzled columns) += into the accumulator
            int s_q;
            float* dq_bh = dq_rows<VARLEN, D>(p, wt, head, &s_q);
            const int sw = VARLEN ? ld_seq(p.cu_seqlens_q + wt.batch) & 7 : 0;   // varlen rows' swizzle offset
            const int r0 = m0 + row_in_wg;
            int* sem = nullptr;   // DET: this half's semaphore of the dQ tile, and our key tile's rank
            int rank = 0;
            if constexpr (DET) {   // after the earlier key tiles' additions to this half (bwd_parts.cuh)
                sem = dq_sem<VARLEN, BM, 2>(p, wt, head, m0, cw);
                rank = dq_rank<WINDOW, BM, BN>(p, n0, s_q, wt.s_k, wt.diag, m0);
                if (t == 0) sem_wait_eq(sem, rank);          // acquire
                named_bar_sync(SPLIT_WG_BAR + cw, 128);      // the warpgroup's adds after it
            }
            red_dq_slice<DH, D>(dq_bh, r0, s_q, sw, cw * DH, col_in_8, dq_acc);
            if constexpr (DET) {
                __threadfence();                             // this thread's adds, then the release
                named_bar_sync(SPLIT_WG_BAR + cw, 128);      // every thread's adds fenced
                if (t == 0) sem_release(sem, rank + 1);      // the next key tile's may start
            }
        }
        if (wt.steps > 0) {
            // this consumer's last reads of K (dQ product, Sᵀ) and V (dPᵀ) have completed
            if (t == 0) mbar_arrive(sm.kv_empty);
            ++kv_it;
        }

        // ---- dK, dV of the tile's 64 keys, this consumer's columns (GQA: summed over the
        //      group's query heads; zeros for a tile that no query sees). Varlen offsets are read
        //      again where used (L1 hits) rather than held across the steps: see bwd_parts.cuh ld_seq
        const int k_row = VARLEN ? ld_seq(p.cu_seqlens_k + wt.batch) : 0;   // packed row of key 0
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 8 * r;
            if (key < wt.s_k) {   // varlen: never a row of the next sequence
                const i64 row = k_row + key;
                S* dk_row = (S*)p.dk + wt.tma_b * p.dk_stride_b + row * p.dk_stride_s + wt.kv_head * p.dk_stride_h;
                S* dv_row = (S*)p.dv + wt.tma_b * p.dv_stride_b + row * p.dv_stride_s + wt.kv_head * p.dv_stride_h;
#pragma unroll
                for (int i = 0; i < NKV; i += 4) {
                    const int col = cw * DH + (i / 4) * 8 + col_in_8;
                    *(u32*)(dk_row + col) = pack2<E>(dk_acc[i + 2 * r], dk_acc[i + 2 * r + 1]);
                    *(u32*)(dv_row + col) = pack2<E>(dv_acc[i + 2 * r], dv_acc[i + 2 * r + 1]);
                }
            }
        }
    }
    // c0's last SPLIT_DS_EMPTY arrival: taken here, so the barrier has no open generation
    if (cw == 1 && q_it > 0) named_bar_sync(SPLIT_DS_EMPTY, 256);
}

}  // namespace sm90b
