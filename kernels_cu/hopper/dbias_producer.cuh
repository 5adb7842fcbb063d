// cupyflash: the Hopper dbias kernel's producer role (hopper/dbias.cu wires it): dbias_load, the TMA
// thread.
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/dbias_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90d {

// The TMA thread (warpgroup 0, thread 0): draws the block's work tiles (from the global counter
// p.sched, or i, i + gridDim.x, ... without one), publishes each index in the tile_smem ring and
// loads, per pair of the tile, the half stages A = (Q, K) and B = (dO, V) into the STAGES-deep
// ring, and after the first pair's halves the tile's bias into one of BIASBUF buffers. num_work:
// the work tiles of the launch. (It reads the addresses from the DbiasSmem record into locals
// first, and load_half stays a lambda: so it compiles to the SASS it had written inside the
// kernel.)
template <int D, bool BIAS_F32, int STAGES, int BIASBUF, bool WINDOW>
__device__ __forceinline__ void dbias_load(const Params& p, const DbiasSmem& sm, int num_work) {
    using L = Layout<D, BIAS_F32, STAGES, BIASBUF>;
    const u32 ring_smem = sm.ring_smem, bias_smem = sm.bias_smem;
    volatile int* tile_smem = sm.tile_smem;
    const u32 ring_full = sm.ring_full, ring_empty = sm.ring_empty, bias_full = sm.bias_full;
    const u32 bias_empty = sm.bias_empty, tile_full = sm.tile_full, tile_empty = sm.tile_empty;
    tma_prefetch_desc(&p.tma_q);
    tma_prefetch_desc(&p.tma_k);
    tma_prefetch_desc(&p.tma_v);
    tma_prefetch_desc(&p.tma_do);
    tma_prefetch_desc(&p.tma_bias);
    int half_it = 0;   // half stages issued so far (ring position)
    int bias_it = 0;   // bias tiles issued so far
    int drawn = 0;     // work-tile indices drawn so far (without a counter: i + k·grid)
    // Half stage half_it: a [BM, D] tile of q_map (Q or dO) and a [BN, D] tile of k_map
    // (K or V) of one pair into ring slot half_it % STAGES, once both consumers are done
    // with the slot's previous half
    auto load_half = [&](const TmaDesc* q_map, const TmaDesc* k_map, int m0, int n0,
                         int head, int kv_head, int batch) {
        const int s = half_it % STAGES;
        const u32 full = ring_full + 8 * s, dst = ring_smem + s * L::HALF;
        if (half_it >= STAGES) mbar_wait(ring_empty + 8 * s, ((half_it / STAGES) - 1) & 1);
        mbar_arrive_expect_tx(full, L::HALF);
#pragma unroll
        for (int c = 0; c < L::PANELS; ++c) {
            tma_load_4d(dst + c * L::Q_PANEL, q_map, full, c * PANEL_COLS, m0, head, batch);
            tma_load_4d(dst + L::Q_TILE + c * L::K_PANEL, k_map, full, c * PANEL_COLS, n0, kv_head, batch);
        }
        ++half_it;
    };
    for (int tile_i = 0;; ++tile_i) {   // tile_i: work tiles handed to the consumers
        const int ts = tile_i % TILE_RING;
        // every consumer warp has taken the slot's previous index
        if (tile_i >= TILE_RING) mbar_wait(tile_empty + 8 * ts, ((tile_i / TILE_RING) - 1) & 1);
        const int w = sched_draw(p.sched, drawn);
        tile_smem[ts] = w < num_work ? w : -1;
        mbar_arrive(tile_full + 8 * ts);     // publishes tile_smem[ts] (release)
        if (w >= num_work) break;            // no work left: the consumers stop on -1
        const DbiasTile wt = dbias_tile<BM, BN, WINDOW>(p, w);
        for (int it = 0; it < wt.pairs; ++it) {
            int batch, head;
            pair_of(p, wt, it, &batch, &head);
            const int kv_head = head / p.h_per_hk;
            load_half(&p.tma_q, &p.tma_k, wt.m0, wt.n0, head, kv_head, batch);    // A: S = Q Kᵀ
            load_half(&p.tma_do, &p.tma_v, wt.m0, wt.n0, head, kv_head, batch);   // B: dP = dO Vᵀ
            if (it == 0) {
                // the tile's bias [BM, BN] as BN / BIAS_KEYS panels (zeros past s_q / s_k),
                // after the first pair's halves (the consumers need it after S), once
                // every consumer warp has read the buffer's previous tile
                const int bb = bias_it % BIASBUF;
                if (bias_it >= BIASBUF) mbar_wait(bias_empty + 8 * bb, ((bias_it / BIASBUF) - 1) & 1);
                mbar_arrive_expect_tx(bias_full + 8 * bb, L::BIAS_TILE);
#pragma unroll
                for (int c = 0; c < BN / L::BIAS_KEYS; ++c)
                    tma_load_4d(bias_smem + bb * L::BIAS_TILE + c * L::BIAS_PANEL, &p.tma_bias,
                                bias_full + 8 * bb, wt.n0 + c * L::BIAS_KEYS, wt.m0, wt.ph, wt.pb);
                ++bias_it;
            }
        }
    }
    if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
}

}  // namespace sm90d
