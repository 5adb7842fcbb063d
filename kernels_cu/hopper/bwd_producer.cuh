// cupyflash: flash_bwd_sm90's producer roles (warpgroup 0; hopper/bwd.cu wires them): the TMA
// thread (bwd_load: work tiles, K / V and Q / dO (bias) loads) and ROWS_WARP (stage_rows:
// lse·log2 e and D per step); DQ_WARP's bulk reduce-add is in hopper/bwd_epilogue.cuh.
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90b {

// The TMA thread (warpgroup 0, thread 0): draws the block's work tiles (from the global counter
// p.sched, or i, i + gridDim.x, ... without one), publishes each index in the tile_smem ring and
// loads the tile's K, V (KVBUF buffers) and each step's Q, dO (and BIAS_TMA: bias) tiles into the
// NBUF-deep ring; the ring positions and barrier phases run on across work tiles. num_work: the
// work tiles of the launch. (It reads the addresses from the Smem record into locals first, and
// load_kv stays a lambda: so it compiles to the SASS it had written inside the kernel.)
template <int D, bool WINDOW, int KVBUF, bool VARLEN, int BIAS, bool DET>
__device__ __forceinline__ void bwd_load(const Params& p, const Smem& sm, int num_work) {
    using L = Layout<D, KVBUF, BIAS == BIAS_TMA, DET>;
    constexpr int BN = L::BN;   // keys per work tile
    const u32 smem = sm.smem, k_smem = sm.k_smem, v_smem = sm.v_smem, q_smem = sm.q_smem;
    const u32 do_smem = sm.do_smem;
    volatile int* tile_smem = sm.tile_smem;
    const u32 kv_full = sm.kv_full, kv_empty = sm.kv_empty, qdo_full = sm.qdo_full, qdo_empty = sm.qdo_empty;
    const u32 tile_full = sm.tile_full, tile_empty = sm.tile_empty;
    // DET needs the counter's draws: tile w is drawn only after every earlier one, by a
    // running block (a static draw may wait on a block that is not resident)
    if (DET && !p.sched) __trap();
    tma_prefetch_desc(&p.tma_q);
    tma_prefetch_desc(&p.tma_k);
    tma_prefetch_desc(&p.tma_v);
    tma_prefetch_desc(&p.tma_do);
    if (BIAS == BIAS_TMA) tma_prefetch_desc(&p.tma_bias);
    int kv_it = 0, q_it = 0;   // K/V tiles and Q/dO steps issued so far (ring positions)
    int drawn = 0;             // work-tile indices drawn so far (without a counter: i + k·grid)
    for (int tile_i = 0;; ++tile_i) {   // tile_i: work tiles handed to the readers so far
        const int ts = tile_i % TILE_RING;
        // every reader has taken the slot's previous index
        if (tile_i >= TILE_RING) mbar_wait(tile_empty + 8 * ts, ((tile_i / TILE_RING) - 1) & 1);
        int w;
        KeyTile wt;
        do {   // varlen: tiles whose keys start past their sequence's end are skipped here,
               // so the readers (consumers, ROWS_WARP) never see them
            w = sched_draw(p.sched, drawn);
            if (w < num_work) wt = key_tile<BN, BM, WINDOW, VARLEN, BIAS, DET>(p, w);
        } while (VARLEN && w < num_work && !wt.keys);
        tile_smem[ts] = w < num_work ? w : -1;
        mbar_arrive(tile_full + 8 * ts);     // publishes tile_smem[ts] (release)
        if (w >= num_work) break;            // no work left: the readers stop on -1
        // K, V [BN, D] of the tile into buffer kv_it % KVBUF (none for a tile without steps)
        auto load_kv = [&]() {
            const int kb = kv_it % KVBUF;
            if (kv_it >= KVBUF) mbar_wait(kv_empty + 8 * kb, ((kv_it / KVBUF) - 1) & 1);
            mbar_arrive_expect_tx(kv_full + 8 * kb, 2 * BN * D * 2);
#pragma unroll
            for (int c = 0; c < L::PANELS; ++c) {
                tma_load_4d(k_smem + kb * L::KV_TILE + c * L::KV_PANEL, &p.tma_k, kv_full + 8 * kb,
                            c * PANEL_COLS, wt.k_row + wt.n0, wt.kv_head, wt.tma_b);
                tma_load_4d(v_smem + kb * L::KV_TILE + c * L::KV_PANEL, &p.tma_v, kv_full + 8 * kb,
                            c * PANEL_COLS, wt.k_row + wt.n0, wt.kv_head, wt.tma_b);
            }
            ++kv_it;
        };
        // KVBUF = 1: the buffer frees only after the current tile's last dQ product, so the
        // tile's first NBUF Q/dO steps (whose ring slots free earlier) go first
        const int kv_at = KVBUF == 1 ? min(NBUF, wt.steps) : 0;
        // step st = (query head of the group) x m_count + query tile mi (DET: st = mi x
        // group + the group's head hi, query tile mi from the first or the last:
        // sched.cuh step_head, step_m0): counted, not divided
        const int head0 = wt.kv_head * p.h_per_hk;
        int head = head0, mi = 0;
        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            if (st == kv_at) load_kv();
            // Q, dO [BM, D] (and BIAS_TMA: the bias [BM, BN]) of the step into ring slot
            // q_it % NBUF
            const int mq = !DET || (p.det_sched & 1) ? mi : wt.m_count - 1 - mi;
            const int m0 = (wt.m_first + mq) * BM;
            if (!DET && ++mi == wt.m_count) mi = 0;
            const int s = q_it % NBUF;
            if (q_it >= NBUF) mbar_wait(qdo_empty + 8 * s, ((q_it / NBUF) - 1) & 1);
            mbar_arrive_expect_tx(qdo_full + 8 * s, 2 * BM * D * 2 + (BIAS == BIAS_TMA ? BM * BN * 2 : 0));
#pragma unroll
            for (int c = 0; c < L::PANELS; ++c) {
                tma_load_4d(q_smem + s * L::Q_TILE + c * L::Q_PANEL, &p.tma_q, qdo_full + 8 * s,
                            c * PANEL_COLS, wt.q_row + m0, head, wt.tma_b);
                tma_load_4d(do_smem + s * L::Q_TILE + c * L::Q_PANEL, &p.tma_do, qdo_full + 8 * s,
                            c * PANEL_COLS, wt.q_row + m0, head, wt.tma_b);
            }
            if constexpr (BIAS == BIAS_TMA) {
                // bias [m0 .., n0 ..] of (batch, head) as BN / 64 panels [BM, 64] (zeros
                // past s_q / s_k); a broadcast dimension is one row of the tensor map
                const int bh = p.bias_stride_h ? head : 0, bb = p.bias_stride_b ? wt.batch : 0;
#pragma unroll
                for (int c = 0; c < BN / PANEL_COLS; ++c)
                    tma_load_4d(smem + L::BIAS + s * L::BIAS_TILE + c * L::BIAS_PANEL, &p.tma_bias,
                                qdo_full + 8 * s, wt.n0 + c * PANEL_COLS, m0, bh, bb);
            }
            if constexpr (DET) {
                if (++head == head0 + p.h_per_hk) {
                    head = head0;
                    ++mi;
                }
            } else if (mi == 0) {
                ++head;
            }
        }
        if (wt.steps > 0 && kv_at == wt.steps) load_kv();
    }
    if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
}

// ROWS_WARP: lse·log2 e and D [BM] per step into the stage's rows_smem (two rows per lane); rows
// past s_q and rows that saw no key in the forward (lse = -inf) get +inf: P is then 0
template <int BN, bool WINDOW, bool VARLEN, int BIAS, bool DET>
__device__ __forceinline__ void stage_rows(const Params& p, const Smem& sm, int lane) {
    int q_it = 0;
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(sm.tile_smem, sm.tile_full, sm.tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const KeyTile wt = key_tile<BN, BM, WINDOW, VARLEN, BIAS, DET>(p, w);
        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int head = step_head<DET>(p, wt, st), m0 = step_m0<BM, DET>(p, wt, st);
            const int s = q_it % NBUF;
            const i64 bh_row = head_rows<VARLEN>(p, wt, head);   // row 0 of the sequence's head
            if (q_it >= NBUF) mbar_wait(sm.qdo_empty + 8 * s, ((q_it / NBUF) - 1) & 1);
            float* lse_stage = sm.rows_smem + s * 2 * BM;   // [BM]
            float* dsum_stage = lse_stage + BM;             // [BM]
#pragma unroll
            for (int r = lane; r < BM; r += 32) {
                const int i = m0 + r;
                const float lse = i < wt.s_q ? p.lse[bh_row + i] : CF_INF;
                lse_stage[r] = lse == -CF_INF ? CF_INF : lse * CF_LOG2E;
                dsum_stage[r] = i < wt.s_q ? p.dsum[bh_row + i] : 0.f;
            }
            mbar_arrive(sm.qdo_full + 8 * s);   // release: the stores above are seen after the wait
        }
    }
}

}  // namespace sm90b
