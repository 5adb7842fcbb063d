// cupyflash: the float32 Hopper backward's producer warpgroup (hopper/bwd_f32.cu): the TMA thread
// (bwd_f32_load: work tiles drawn from the scheduler, K, V per tile and Q, dO per step loaded into
// shared memory) and the 96 converters (bwd_f32_convert: the TF32 big / small parts of K, Q, dO,
// the transposed Qᵀ, dOᵀ parts of design S, and the lse·log2 e and D rows of each step).
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_f32_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90bf {

// The TMA thread (producer warpgroup, thread 0): draws the block's work tiles into the tile ring
// and loads each tile's K, V and its steps' Q, dO, in consumption order. num_n: key tiles per
// (kv head, batch).
template <int D, bool WINDOW>
__device__ __forceinline__ void bwd_f32_load(const Params& p, const BwdF32Smem<D>& sm, int num_n, int num_work) {
    using L = typename LayoutOf<D>::type;
    constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    const u32 smem = sm.smem;
    volatile int* tile_smem = sm.tile_smem;
    const u32 tile_full = sm.tile_full, tile_empty = sm.tile_empty, kv_raw = sm.kv_raw;
    const u32 kv_empty = sm.kv_empty, raw_full = sm.raw_full, raw_empty = sm.raw_empty;
    const u32 nat_empty = sm.nat_empty, r_full = sm.r_full, r_empty = sm.r_empty;
    // ---- TMA thread: work tiles, K / V per tile, Q / dO per step
    tma_prefetch_desc(&p.tma_q);
    tma_prefetch_desc(&p.tma_k);
    tma_prefetch_desc(&p.tma_v);
    tma_prefetch_desc(&p.tma_do);
    // (tile_i declared first, q_it before kv_it: in this order the role compiles to the SASS it
    // had written inside the kernel)
    int tile_i = 0;
    int q_it = 0, kv_it = 0, drawn = 0;
    for (;; ++tile_i) {
        const int ts = tile_i % TILE_RING;
        // every reader has taken the slot's previous index
        if (tile_i >= TILE_RING) mbar_wait(tile_empty + 8 * ts, ((tile_i / TILE_RING) - 1) & 1);
        int w = sched_draw(p.sched, drawn);
        // causal / window: the grid's tail longest first (key tile 0 of a (kv head, batch)
        // pair sees the most query rows under a causal mask)
        if (WINDOW && w < num_work) w = longest_first_tail(w, num_n, p.h_k * p.b, gridDim.x);
        tile_smem[ts] = w < num_work ? w : -1;
        mbar_arrive(tile_full + 8 * ts);           // publishes tile_smem[ts] (release)
        if (w >= num_work) break;
        const WorkTile wt = work_tile<D, WINDOW>(p, w);
        int head = wt.kv_head * p.h_per_hk, mi = 0;
        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int m0 = (wt.m_first + mi) * BM;
            if (++mi == wt.m_count) mi = 0;
            // Q, dO [BM, D] of the step (D / 32 panels each) to q_dst, do_dst, counted on `full`
            auto load_q_do = [&](u32 full, u32 q_dst, u32 do_dst) {
                mbar_arrive_expect_tx(full, 2 * BM * D * 4);
#pragma unroll
                for (int c = 0; c < D / PANEL; ++c) {
                    tma_load_4d(q_dst + c * L::Q_PANEL, &p.tma_q, full, c * PANEL, m0, head, wt.batch);
                    tma_load_4d(do_dst + c * L::Q_PANEL, &p.tma_do, full, c * PANEL, m0, head,
                                wt.batch);
                }
            };
            if constexpr (Shape<D>::T) {
                // into the big halves of the parts (raw_full: landed), once every consumer
                // warp's Sᵀ / dPᵀ of the last step has read them (nat_empty)
                if (q_it > 0) mbar_wait(nat_empty, (q_it - 1) & 1);
                load_q_do(raw_full, smem + L::QB, smem + L::DOB);
                // the raw copies (r_full: landed), once every consumer warp has loaded the
                // last step's dKᵀ / dVᵀ fragments from them (r_empty)
                if (q_it > 0) mbar_wait(r_empty, (q_it - 1) & 1);
                load_q_do(r_full, smem + L::RQ, smem + L::RDO);
            } else {
                // into landing stage q_it % RAW_STAGES, once the converters are done with
                // the step that used it before
                const int rs = q_it % RAW_STAGES;
                const u32 raw = smem + L::RAWQ + rs * L::RAW_STAGE;
                if (q_it >= RAW_STAGES) mbar_wait(raw_empty + 8 * rs, (q_it / RAW_STAGES - 1) & 1);
                load_q_do(raw_full + 8 * rs, raw, raw + L::QT);
            }
            if (mi == 0) ++head;
            if (st == 0) {
                // K, V [BN, D] of the tile, behind its first step's Q / dO, once both
                // consumers are done with the previous tile's
                if (kv_it > 0) mbar_wait(kv_empty, (kv_it - 1) & 1);
                mbar_arrive_expect_tx(kv_raw, 2 * BN * D * 4);
#pragma unroll
                for (int c = 0; c < D / PANEL; ++c) {
                    tma_load_4d(smem + L::K_LAND + c * L::KV_PANEL, &p.tma_k, kv_raw, c * PANEL,
                                wt.n0, wt.kv_head, wt.batch);
                    tma_load_4d(smem + L::V_LAND + c * L::KV_PANEL, &p.tma_v, kv_raw, c * PANEL,
                                wt.n0, wt.kv_head, wt.batch);
                }
                ++kv_it;
            }
        }
    }
    if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
}

// The converters (producer warps 1..3, t = 32 .. 127: their lane in the warpgroup): per tile K
// split (design S), per step Q, dO split, the rows written and (design S) Qᵀ, dOᵀ parts.
template <int D, bool WINDOW>
__device__ __forceinline__ void bwd_f32_convert(const Params& p, const BwdF32Smem<D>& sm, int t) {
    using L = typename LayoutOf<D>::type;
    constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    const u32 smem = sm.smem;
    float* rows_smem = sm.rows_smem;
    volatile int* tile_smem = sm.tile_smem;
    const u32 tile_full = sm.tile_full, tile_empty = sm.tile_empty, kv_raw = sm.kv_raw;
    const u32 kv_full = sm.kv_full, raw_full = sm.raw_full, raw_empty = sm.raw_empty;
    const u32 nat_full = sm.nat_full, nat_empty = sm.nat_empty, t_full = sm.t_full;
    const u32 t_empty = sm.t_empty;
    const int cu = t - 32;
    // Hand converted data on: each thread's shared writes fenced for the async proxy, all
    // 96 done (barrier), one arrival on each barrier given
    auto release = [&](u32 bar, u32 bar2) {
        fence_proxy_async();
        named_bar_sync(CONV_BAR, CONV_THREADS);
        if (cu == 0) {
            mbar_arrive(bar);
            if (bar2) mbar_arrive(bar2);
        }
    };
    // Chunks [0, hi) of a run of 16-byte chunks -> big / small parts (elementwise, so the
    // swizzled layout is kept). Chunk i reads src + 16·i and writes big + 16·i, small + 16·i,
    // each shifted by `jump` bytes for i >= hi / 2 when `jump` is set (Q, dO in one run: their
    // big / small parts interleave as q_big, q_small, do_big, do_small). U chunks per
    // iteration, their loads issued together (one shared-memory latency per U chunks)
    auto split_run = [&](u32 src, u32 big, u32 small, int hi, int jump) {
        constexpr int U = 4;
        for (int i0 = cu; i0 < hi; i0 += U * CONV_THREADS) {
            float x[U][4];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (i0 + u * CONV_THREADS < hi) lds128(src + 16 * (i0 + u * CONV_THREADS), x[u]);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = i0 + u * CONV_THREADS;
                if (i >= hi) break;
                u32 b[4], s4[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) split_tf32(x[u][e], b[e], s4[e]);
                const u32 off = 16 * i + (jump && 2 * i >= hi ? jump : 0);
                sts128(big + off, b);
                sts128(small + off, s4);
            }
        }
    };
    int kv_it = 0, q_it = 0;
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const WorkTile wt = work_tile<D, WINDOW>(p, w);
        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int head = step_head(p, wt, st), m0 = step_m0(wt, st);
            // ---- lse·log2 e and D of the step's rows, loaded first so the global-memory
            //      latency passes under the waits and the split: rows past s_q and rows that
            //      saw no key in the forward (lse = -inf) get +inf, so their P is 0
            const i64 bh_row = ((i64)wt.batch * p.h + head) * p.s_q;
            const int row = m0 + cu;                  // threads cu < BM: one row each
            float lse_row = CF_INF, dsum_row = 0.f;
            if (cu < BM && row < p.s_q) {
                lse_row = p.lse[bh_row + row];
                dsum_row = p.dsum[bh_row + row];
            }
            if constexpr (Shape<D>::T) {
                // ---- Q, dO landed raw in their big halves: split in place (B of Sᵀ, dPᵀ);
                //      the TMA thread waited for the last step's readers (nat_empty). Rows
                //      in buffer q_it % 2 (the last step's D is read until c1's dSᵀ)
                mbar_wait(raw_full, q_it & 1);
                split_run(smem + L::QB, smem + L::QB, smem + L::QS, BM * D / 4, 0);
                split_run(smem + L::DOB, smem + L::DOB, smem + L::DOS, BM * D / 4, 0);
                // the rows of two steps back in this buffer are read (their readers arrived
                // on nat_empty a step later; the TMA thread's wait already saw it)
                if (q_it > 0) mbar_wait(nat_empty, (q_it - 1) & 1);
                if (cu < BM) {
                    float* rows_step = rows_smem + (q_it & 1) * 2 * BM;   // [2][BM]
                    rows_step[cu] = lse_row == -CF_INF ? CF_INF : lse_row * CF_LOG2E;
                    rows_step[BM + cu] = dsum_row;
                    mbar_arrive(nat_full);             // this thread's rows written
                }
                release(nat_full, 0);
            } else {
                const int rs = q_it % RAW_STAGES;
                const u32 raw = smem + L::RAWQ + rs * L::RAW_STAGE;   // the step's Q, dO raw
                mbar_wait(raw_full + 8 * rs, (q_it / RAW_STAGES) & 1);   // Q, dO of the step landed
                if (q_it > 0) mbar_wait(nat_empty, (q_it - 1) & 1);   // the last step's Sᵀ, dPᵀ, rows done
                // ---- Q, dO: big / small as stored (B of Sᵀ, dPᵀ), one run over both
                static_assert(L::RAWDO == L::RAWQ + L::QT && L::DOB == L::QS + L::QT &&
                              L::QS == L::QB + L::QT, "Q, dO landing buffers and parts adjacent");
                split_run(raw, smem + L::QB, smem + L::QS, 2 * BM * D / 4, L::QT);
                if (cu < BM) {
                    rows_smem[cu] = lse_row == -CF_INF ? CF_INF : lse_row * CF_LOG2E;
                    rows_smem[BM + cu] = dsum_row;
                    mbar_arrive(nat_full);             // this thread's rows written
                }
                release(nat_full, 0);
                if (st == 0) {
                    // ---- K of the tile: big in place, small (A of Sᵀ; Kᵀ fragments of dQᵀ)
                    mbar_wait(kv_raw, kv_it & 1);
                    split_run(smem + L::KB, smem + L::KB, smem + L::KS, BN * D / 4, 0);
                    release(kv_full, 0);
                    ++kv_it;
                }
                // Xᵀ big / small of the raw Q and dO of a step ([BM, D] tiles, query rows, swizzled
                // [D/32][BM][32], QT bytes apart) -> qT_big, qT_small, doT_big, doT_small, each
                // [BM/32][D][32] (row = column d, queries permuted inside each 8-query k-step: query
                // 2c -> slot c, 2c + 1 -> slot c + 4, matching the P / dS A fragments), split as they
                // are written. Item i of tile i / ITEMS (Q, dO) = 4 queries x 4 columns: hopper/sm90.cuh's
                // TransposeItem, as hopper/fwd_f32.cu's transpose_v with BN := BM (bank-conflict-free
                // phases, checked by tests/test_sm90_f32_bwd_layout.py)
                auto transpose_split = [&](u32 src0) {
                    constexpr int ITEMS = BM * D / 16, ALL = 2 * ITEMS;
                    for (int ia = cu; ia < ALL; ia += CONV_THREADS) {
                        const int part = ia / ITEMS;
                        const TransposeItem<BM, D> it(ia % ITEMS);
                        const u32 src = src0 + part * L::QT;
                        const u32 dst_big = smem + L::QTB + part * 2 * L::QT;
                        it.template move<true>(src, dst_big, dst_big + L::QT);
                    }
                };
                // ---- Qᵀ, dOᵀ big / small (B of dK, dV) from the raw Q, dO, once the last
                //      step's dV, dK are done; then the landing stage may take step q_it + 2
                if (q_it > 0) mbar_wait(t_empty, (q_it - 1) & 1);
                static_assert(L::QTS == L::QTB + L::QT && L::DOTB == L::QTS + L::QT &&
                              L::DOTS == L::DOTB + L::QT, "transposed parts adjacent");
                transpose_split(raw);
                release(t_full, raw_empty + 8 * rs);
            }
        }
    }
}

}  // namespace sm90bf
