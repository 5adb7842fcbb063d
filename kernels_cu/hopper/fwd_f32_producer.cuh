// cupyflash: the float32 Hopper forward's mainloop load, the producer warpgroup's roles: the TMA
// thread (fwd_f32_load: work tiles drawn from the scheduler, their raw float32 Q, K and V tiles
// loaded into shared memory) and the converters (fwd_f32_convert: TF32 parts of Q and K, Vᵀ
// parts, handed to the consumers).
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/fwd_f32_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90 {

// The float32 forward's TMA thread (producer warpgroup, thread 0): draws the block's work tiles,
// publishes each index and loads its Q tile and its key tiles' K and V (raw float32) into the
// ring, in consumption order. num_work: the grid's work tiles.
template <int D, int BN, int STAGES, int NC, bool WINDOW, bool QREG>
__device__ __forceinline__ void fwd_f32_load(const Params& p, const sm90f32::FwdF32Smem<D, BN, STAGES, NC, QREG>& sm,
                                             int num_work) {
    using namespace sm90f32;
    using L = sm90f32::Layout<D, BN, STAGES, NC, QREG>;
    constexpr int BM = L::BM;
    const u32 q_smem = sm.q_smem, q_small = sm.q_small, k_big = sm.k_big, k_small = sm.k_small;
    const u32 vt_big = sm.vt_big, vt_small = sm.vt_small, v_raw = sm.v_raw;
    const u32 q_raw = sm.q_raw, q_full = sm.q_full, q_empty = sm.q_empty, k_raw = sm.k_raw, v_rawb = sm.v_rawb;
    const u32 k_full = sm.k_full, v_full = sm.v_full, k_empty = sm.k_empty, v_empty = sm.v_empty;
    const u32 vraw_empty = sm.vraw_empty;
    volatile int* tile_smem = sm.tile_smem;
    // ---- TMA thread: Q, K, V tiles (raw float32) in consumption order
    tma_prefetch_desc(&p.tma_q);
    tma_prefetch_desc(&p.tma_k);
    tma_prefetch_desc(&p.tma_v);
    int kv_it = 0;     // K/V tiles issued so far (ring position)
    int drawn = 0;     // work-tile indices drawn so far (without a counter: i + k·grid)
    // K [BN, D] into k_big and V [BN, D] into v_raw of ring position kv_it: key tile `it`
    // of work tile wt, right to left through the band, STAGES buffers deep
    auto load_kv = [&](const FwdTile& wt, int it) {
        const int n0 = (wt.t_first + wt.n_tiles - 1 - it) * BN;
        const int s = kv_it % STAGES;
        const u32 prev = ((kv_it / STAGES) - 1) & 1;   // phase of the stage's last use
        // one [BN, D] tile of keys n0 .. in its D / 32 panels, landing on barrier `full`
        auto load_tile = [&](u32 dst_smem, const TmaDesc* desc, u32 full) {
            mbar_arrive_expect_tx(full, BN * D * 4);
#pragma unroll
            for (int c = 0; c < D / F32_PANEL_COLS; ++c)
                tma_load_4d(dst_smem + c * L::KV_PANEL, desc, full, c * F32_PANEL_COLS, n0,
                            wt.kv_head, wt.batch);
        };
        // K into k_big[s] once every consumer's S has read the stage's last K (and so
        // the converters are done with it: S waited for their k_full)
        if (kv_it >= STAGES) mbar_wait(k_empty + 8 * s, prev);
        load_tile(k_big + s * L::KVT, &p.tma_k, k_raw + 8 * s);
        // V into v_raw[s] once the converters have transposed the stage's last V
        if (kv_it >= STAGES) mbar_wait(vraw_empty + 8 * s, prev);
        load_tile(v_raw + s * L::KVT, &p.tma_v, v_rawb + 8 * s);
        ++kv_it;
    };
    // The next work tile w (-1: no work left), drawn before the Q tile of the current one is
    // released: its Q tile [BM, D] prefetched into L2 and its first key tile loaded into
    // the ring (`ahead` = 1) now, while the consumers still have up to STAGES key tiles of
    // the current tile to go. Then only Q's load, from L2, stands between the current
    // tile's last S and the next tile's first (no counter atomic, device-memory Q latency
    // or first K conversion there)
    int w, ahead;
    FwdTile wt;
    auto draw_next = [&]() {
        const int w_drawn = sched_draw(p.sched, drawn);
        ahead = 0;
        w = -1;
        if (w_drawn >= num_work) return;
        // causal / window: the grid's tail longest first
        w = WINDOW ? longest_first_tail(w_drawn, p.num_m_blocks, p.h * p.b, gridDim.x) : w_drawn;
        wt = fwd_work_tile<WINDOW, false, BM, BN>(p, w);
        if (wt.n_tiles == 0) return;              // rows that see no key: nothing to load
#pragma unroll
        for (int c = 0; c < D / F32_PANEL_COLS; ++c)
            tma_prefetch_l2_4d(&p.tma_q, c * F32_PANEL_COLS, wt.m0, wt.head, wt.batch);
        load_kv(wt, 0);
        ahead = 1;
    };
    draw_next();
    for (int tile_i = 0;; ++tile_i) {
        // the consumers are done with the previous tile's Q (big and small) and index
        if (tile_i > 0) mbar_wait(q_empty, (tile_i - 1) & 1);
        *tile_smem = w;                           // published by the q_raw arrival (release)
        if (w < 0) {                              // no work left: tell everyone, stop
            mbar_arrive(q_raw);
            break;
        }
        if (wt.n_tiles == 0) {
            mbar_arrive(q_raw);
        } else {
            // Q tile [BM, D]: D / 32 boxes of [BM, 32]
            mbar_arrive_expect_tx(q_raw, BM * D * 4);
#pragma unroll
            for (int c = 0; c < D / F32_PANEL_COLS; ++c)
                tma_load_4d(q_smem + c * L::Q_PANEL, &p.tma_q, q_raw, c * F32_PANEL_COLS,
                            wt.m0, wt.head, wt.batch);
            // the tile's other key tiles
            for (int it = ahead; it < wt.n_tiles; ++it) load_kv(wt, it);
        }
        draw_next();
    }
    if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
}

// The float32 forward's converters (producer warpgroup, warps 1..3: converter cu of 96): split
// each landed K tile (and, unless QREG, Q tile) into TF32 big / small parts and transpose V into
// Vᵀ parts, then hand each converted tile to the consumers.
template <typename E, int D, int BN, int STAGES, int NC, bool WINDOW, bool QREG>
__device__ __forceinline__ void fwd_f32_convert(const Params& p, const sm90f32::FwdF32Smem<D, BN, STAGES, NC, QREG>& sm,
                                                int cu) {
    using namespace sm90f32;
    using L = sm90f32::Layout<D, BN, STAGES, NC, QREG>;
    constexpr int BM = L::BM;
    constexpr bool SPLIT = Elem<E>::split;   // 3xTF32 (f32x3_t) or one TF32 product (tf32_t)
    const u32 q_smem = sm.q_smem, q_small = sm.q_small, k_big = sm.k_big, k_small = sm.k_small;
    const u32 vt_big = sm.vt_big, vt_small = sm.vt_small, v_raw = sm.v_raw;
    const u32 q_raw = sm.q_raw, q_full = sm.q_full, q_empty = sm.q_empty, k_raw = sm.k_raw, v_rawb = sm.v_rawb;
    const u32 k_full = sm.k_full, v_full = sm.v_full, k_empty = sm.k_empty, v_empty = sm.v_empty;
    const u32 vraw_empty = sm.vraw_empty;
    volatile int* tile_smem = sm.tile_smem;
    // ---- converters (96 threads): TF32 parts of Q and K, Vᵀ parts, tile by tile
    // Hand a converted tile on: each thread's shared writes fenced for the async proxy,
    // all 96 done (barrier), one arrival on `bar`
    auto release = [&](u32 bar) {
        fence_proxy_async();
        named_bar_sync(CONV_BAR, CONV_THREADS);   // every converter's part is written
        if (cu == 0) mbar_arrive(bar);
    };
    // [rows, D] tile at `big` (raw in, big out, in place) and its small part at `small`:
    // elementwise, so the swizzled layout is kept as it is (16-byte chunks)
    // (two chunks per pass: both loads are in flight before the first store)
    auto split_tile = [&](u32 big, u32 small, int chunks) {
#pragma unroll 1   // (unrolled, the hd 128 window variant's 40-register converters spill 8 B)
        for (int i = cu; i < chunks; i += 2 * CONV_THREADS) {
            const int j = i + CONV_THREADS;           // the pass's second chunk
            const bool two = j < chunks;
            float x[8] = {};
            u32 b[8], sp[8];
            lds128(big + 16 * i, x);
            if (two) lds128(big + 16 * j, x + 4);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (SPLIT) split_tf32(x[e], b[e], sp[e]);
                else b[e] = tf32_rn(x[e]);
            }
            sts128(big + 16 * i, b);
            if (SPLIT) sts128(small + 16 * i, sp);
            if (two) {
                sts128(big + 16 * j, b + 4);
                if (SPLIT) sts128(small + 16 * j, sp + 4);
            }
        }
    };
    // Vᵀ of stage s: v_raw [D/32][BN][32] (row = key, swizzled) -> vt_big / vt_small
    // [BN/32][D][32] (row = head-dim column d, keys permuted within each 8-key step), item
    // by item (4 keys x 4 columns: hopper/sm90.cuh's TransposeItem)
    auto transpose_v = [&](int s) {
        const u32 src = v_raw + s * L::KVT;
        const u32 dst_b = vt_big + s * L::KVT, dst_s = vt_small + s * L::KVT;
        constexpr int ITEMS = BN * D / 16;
        for (int i = cu; i < ITEMS; i += CONV_THREADS)
            TransposeItem<BN, D>(i).template move<SPLIT>(src, dst_b, dst_s);
    };
    int kv_it = 0;
    for (int tile_i = 0;; ++tile_i) {
        mbar_wait(q_raw, tile_i & 1);                 // Q landed, tile index published
        // each converter reads the index and releases it itself (q_empty: the producer
        // waits for the consumers' arrivals too, which come after this tile's Q
        // conversion); once per work tile, and fewer registers than a warp broadcast
        const int w = *tile_smem;
        mbar_arrive(q_empty);
        named_bar_sync(CONV_BAR, CONV_THREADS);       // the converters start the tile together
        if (w < 0) {                                  // no work left: tell the consumers
            if (!QREG && cu == 0) mbar_arrive(q_full);
            break;
        }
        const FwdTile wt = fwd_work_tile<WINDOW, false, BM, BN>(p, w);
        if (wt.n_tiles == 0) {                        // nothing loaded: pass the index on
            if (!QREG && cu == 0) mbar_arrive(q_full);
            continue;
        }
        if constexpr (!QREG) {
            split_tile(q_smem, q_small, BM * D / 4);
            release(q_full);
        }
        // the tile's ring positions, bounded by kv_end (with a second counter it = 0 ..
        // n_tiles, the hd 128 window variant's 40-register converters spilled 8 B)
        for (const int kv_end = kv_it + wt.n_tiles; kv_it < kv_end; ++kv_it) {
            const int s = kv_it % STAGES;
            const u32 ph = (kv_it / STAGES) & 1;
            mbar_wait(k_raw + 8 * s, ph);             // K landed (k_small[s] is free:
                                                      // the TMA thread saw k_empty)
            split_tile(k_big + s * L::KVT, k_small + s * L::KVT, BN * D / 4);
            release(k_full + 8 * s);
            mbar_wait(v_rawb + 8 * s, ph);            // V landed
            if (kv_it >= STAGES) mbar_wait(v_empty + 8 * s, ph ^ 1);   // Vᵀ[s] is free
            transpose_v(s);
            release(v_full + 8 * s);                  // (also: every converter has read
            if (cu == 0) mbar_arrive(vraw_empty + 8 * s);   // v_raw[s]: TMA may refill it)
        }
    }
}

}  // namespace sm90
