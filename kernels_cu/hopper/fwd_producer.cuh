// cupyflash: the Hopper forwards' mainloop load, the producer warpgroup's role: work tiles drawn
// from the scheduler and their Q, K and V tiles loaded by TMA into shared memory (fwd_load, the
// 16-bit forward's TMA thread; the float32 forward's: hopper/fwd_f32_producer.cuh).
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/fwd_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90 {

// The 16-bit forward's producer (one thread: TMA): draws the block's work tiles (from the global
// counter p.sched, or i, i + gridDim.x, ... without one), publishes each index in tile_smem and
// loads its Q tile and then its K and V tiles, right to left through the band, into the
// STAGES-deep ring; the K/V ring position and the barrier phases run on across tiles. The next
// tile is drawn as soon as the current one's loads are issued (its Q prefetched into L2, its first
// K tile into the ring), so that the next Q and first K / V tiles are there when the consumers
// finish the current tile. num_work: work tiles, then (SPLIT) the pieces of those from
// split_first on.
template <int D, int BN, int STAGES, int NC, bool WINDOW, bool VARLEN, int BIAS, bool SPLIT>
__device__ __forceinline__ void fwd_load(const Params& p, const FwdSmem<D, BN, STAGES, NC, VARLEN>& sm,
                                         int num_work) {
    using L = Layout<D, BN, STAGES, NC, VARLEN>;
    constexpr int BM = L::BM;
    constexpr bool KSPLIT = L::PANELS >= 2;   // K in two halves (FwdSmem::k_full2)
    const u32 q_smem = sm.q_smem, k_smem = sm.k_smem, v_smem = sm.v_smem;
    const u32 q_full = sm.q_full, q_empty = sm.q_empty, k_full = sm.k_full, v_full = sm.v_full;
    const u32 k_empty = sm.k_empty, v_empty = sm.v_empty, k_full2 = sm.k_full2;
    volatile int* tile_smem = sm.tile_smem;
    // Whether a work tile can have rows that see no key, and whether wt's rows see any key (so
    // that it has key tiles to load): FwdConsumer::SOME_EMPTY. (A lambda, as there: the same
    // test as a function, inlined earlier, changed the SASS.)
    constexpr bool SOME_EMPTY = WINDOW || VARLEN;
    auto sees_keys = [](const FwdTile& wt) { return !SOME_EMPTY || wt.n_tiles > 0; };
    tma_prefetch_desc(&p.tma_q);
    tma_prefetch_desc(&p.tma_k);
    tma_prefetch_desc(&p.tma_v);
    int kv_it = 0;     // K/V tiles issued so far (ring position)
    int drawn = 0;     // work-tile indices drawn so far (without a counter: i + k·grid)
    // The next work tile: its index w (num_work or more when no work is left) and wt
    auto draw = [&](FwdTile& wt) -> int {
        int w;
        do {   // varlen: tiles past their sequence's end have no rows; skip them here
            w = sched_draw(p.sched, drawn);
            // dense causal / window: the grid's tail longest first
            if (WINDOW && !VARLEN && w < num_work)
                w = longest_first_tail(w, p.num_m_blocks, p.h * p.b, gridDim.x);
            if (w < num_work) wt = fwd_work_tile<WINDOW, VARLEN, BM, BN, BIAS != 0, SPLIT>(p, w);
        } while (VARLEN && w < num_work && !wt.rows);
        return w;
    };
    // K (or V) tile `it` of work tile wt [BN, D] into ring stage kv_it % STAGES, once every
    // consumer has released the stage's previous one; its panels in `parts` parts (a constant
    // at each call), the first counted on barrier array `full`, the second on `full2` (K
    // with KSPLIT: two halves, k_full and k_full2)
    auto load = [&](const FwdTile& wt, int it, u32 dst_smem, const TmaDesc* desc, int parts,
                    u32 full, u32 full2, u32 empty) {
        const int n0 = wt.k_row + (wt.t_first + wt.n_tiles - 1 - it) * BN;   // packed row, right to left
        const int s = kv_it % STAGES;
        if (kv_it >= STAGES) mbar_wait(empty + 8 * s, ((kv_it / STAGES) - 1) & 1);
#pragma unroll
        for (int h = 0; h < parts; ++h) {
            const int c0 = h * L::PANELS / parts, c1 = (h + 1) * L::PANELS / parts;   // its panels
            const u32 bar = (h ? full2 : full) + 8 * s;
            mbar_arrive_expect_tx(bar, (c1 - c0) * L::KV_PANEL);
#pragma unroll
            for (int c = c0; c < c1; ++c)
                tma_load_4d(dst_smem + s * L::KV_TILE + c * L::KV_PANEL, desc, bar,
                            c * PANEL_COLS, n0, wt.kv_head, wt.tma_b);
        }
    };
    auto load_k = [&](const FwdTile& wt, int it) {
        load(wt, it, k_smem, &p.tma_k, KSPLIT ? 2 : 1, k_full, k_full2, k_empty);
    };
    auto load_v = [&](const FwdTile& wt, int it) { load(wt, it, v_smem, &p.tma_v, 1, v_full, v_full, v_empty); };
    FwdTile wt;
    int w = draw(wt);
    bool k0_loaded = false;   // the tile's first K tile was issued ahead (below)
    for (int tile_i = 0;; ++tile_i) {   // tile_i: work tiles handed to the consumers
        // the consumers are done with the previous tile's Q (and have read its index)
        if (tile_i > 0) mbar_wait(q_empty, (tile_i - 1) & 1);
        if (w >= num_work) {                  // no work left: tell the consumers, stop
            *tile_smem = -1;
            mbar_arrive(q_full);
            break;
        }
        *tile_smem = w;                    // published by the q_full arrival (release)
        if (!sees_keys(wt)) {                 // rows that see no key: nothing to load
            mbar_arrive(q_full);
        } else {
            // Q tile [BM, D]
            mbar_arrive_expect_tx(q_full, BM * D * 2);
#pragma unroll
            for (int c = 0; c < L::PANELS; ++c)
                tma_load_4d(q_smem + c * L::Q_PANEL, &p.tma_q, q_full, c * PANEL_COLS,
                            wt.q_row + wt.m0, wt.head, wt.tma_b);
            // K, V tiles [BN, D], right to left through the band, STAGES buffers deep
            for (int it = 0; it < wt.n_tiles; ++it, ++kv_it) {
                if (it > 0 || !k0_loaded) load_k(wt, it);
                load_v(wt, it);
            }
        }
        // Draw ahead, while the consumers still work on this tile: the next tile's index
        // (the counter's atomic takes ~1600 cycles), its Q into L2 and its first K tile into
        // the ring, so that neither waits on the consumers' tile-to-tile path. (Its Q tile
        // itself loads once the consumers release q_smem; its first V stage is released
        // only after that, so it loads after Q.)
        FwdTile next;
        w = draw(next);
        k0_loaded = w < num_work && sees_keys(next);
        if (k0_loaded) {
#pragma unroll
            for (int c = 0; c < L::PANELS; ++c)
                tma_prefetch_l2_4d(&p.tma_q, c * PANEL_COLS, next.q_row + next.m0, next.head, next.tma_b);
            load_k(next, 0);
        }
        wt = next;
    }
    if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
}

}  // namespace sm90
