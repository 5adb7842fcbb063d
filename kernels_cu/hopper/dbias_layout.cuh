// cupyflash: the Hopper dbias kernel's (hopper/dbias.cu) constants, shared-memory Layout and the
// block's shared-memory addresses and mbarriers (DbiasSmem), namespace sm90d.
#pragma once

#include "common/types.cuh"
#include "hopper/sm90.cuh"

namespace sm90d {

constexpr int BM = 128;              // queries per work tile: two consumer warpgroups x 64
constexpr int BN = 128;              // keys per work tile
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;   // 40·128 + 232·256 <= 64K registers per SM
constexpr int PANEL_COLS = 64;       // 64 16-bit columns = one 128-byte swizzle row
constexpr int TILE_RING = 2;         // work-tile indices in flight (tile_smem ring)
constexpr int CONSUMER_WARPS = 8;    // arrivals that free a tile_smem slot or a bias buffer

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_dbias_sm90.py: smem_bytes.
template <int D, bool BIAS_F32, int STAGES, int BIASBUF>
struct Layout {
    static constexpr int PANELS = D / PANEL_COLS;            // 64-column panels of a [rows, D] tile
    static constexpr int Q_PANEL = BM * 128;                 // bytes of a [BM, 64] panel (Q, dO)
    static constexpr int K_PANEL = BN * 128;                 // bytes of a [BN, 64] panel (K, V)
    static constexpr int Q_TILE = PANELS * Q_PANEL;          // q / do tile [PANELS][BM][64]
    static constexpr int K_TILE = PANELS * K_PANEL;          // k / v tile [PANELS][BN][64]
    static constexpr int HALF = Q_TILE + K_TILE;             // one half stage: (Q, K) or (dO, V)
    static constexpr int BIAS_KEYS = BIAS_F32 ? 32 : 64;     // keys per 128-byte bias panel row
    static constexpr int BIAS_PANEL = BM * 128;              // bytes of a [BM, BIAS_KEYS] panel
    static constexpr int BIAS_TILE = (BN / BIAS_KEYS) * BIAS_PANEL;   // [BN / BIAS_KEYS][BM][BIAS_KEYS]
    static constexpr int RING = 0;                           // ring_smem [STAGES][HALF]
    static constexpr int BIAS = RING + STAGES * HALF;        // bias_smem [BIASBUF][BIAS_TILE]
    static constexpr int TILE = BIAS + BIASBUF * BIAS_TILE;  // tile_smem [TILE_RING] int (16 bytes)
    static constexpr int BARS = TILE + 16;                   // ring_full[STAGES], ring_empty[STAGES],
                                                             // bias_full[BIASBUF], bias_empty[BIASBUF],
                                                             // tile_full[TILE_RING], tile_empty[TILE_RING]
    static constexpr int BYTES = BARS + 8 * (2 * STAGES + 2 * BIASBUF + 2 * TILE_RING);
};

// dbias (and bias) element type: float32, or E's 16-bit storage
template <bool F32, typename S> struct BiasElem { typedef S type; };
template <typename S> struct BiasElem<true, S> { typedef float type; };

// flash_bwd_dbias_sm90's shared memory (Layout's regions from the 1024-aligned base smem) and its
// mbarriers, in this order (the kernel fills it); its role functions read it
struct DbiasSmem {
    u32 smem;                                   // the aligned base
    u32 ring_smem;                              // [STAGES][HALF]: (Q, K) or (dO, V) of a pair
    u32 bias_smem;                              // [BIASBUF][BIAS_TILE]: a work tile's bias
    volatile int* tile_smem;                    // [TILE_RING] work tile, -1: none left
    u32 ring_full, ring_empty;                  // [STAGES]: the half stage landed / both consumers read it
    u32 bias_full, bias_empty;                  // [BIASBUF]: the bias tile landed / every consumer warp read it
    u32 tile_full, tile_empty;                  // [TILE_RING]: tile_smem slot written / read by every consumer warp
};

}  // namespace sm90d
