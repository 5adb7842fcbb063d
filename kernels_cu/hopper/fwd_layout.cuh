// cupyflash: the Hopper forwards' constants, register split and shared-memory layout (namespace
// sm90; hopper/fwd.cu, and hopper/fwd_f32.cu for the constants it shares): Layout and FwdSmem,
// the tiles' and mbarriers' addresses both roles of the 16-bit forward use.
#pragma once

#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90 {

constexpr int WG_ROWS = 64;          // query rows per consumer warpgroup
constexpr int TURN_BAR = 1;          // named barriers 1 .. NC: consumer c's turn on the tensor cores
constexpr int WG_BAR = 4;            // named barriers 4 .. 3 + NC: the 128 threads of consumer c
constexpr int PANEL_COLS = 64;       // 64 16-bit columns = one 128-byte swizzle row

// Registers per thread after setmaxnreg, per (NC, blocks per SM): producer·128 +
// consumer·128·NC must not exceed the block's launch pool (setmaxnreg.inc only takes what the
// block's own warps gave back): 168 x 384 with one block per SM, 128 x 256 with two, 80 x 256
// with three (NC = 1: each block runs one consumer on its own tiles, so one block's tile
// boundary runs beside the others' key-tile loops; tests/test_compile_sm90.py checks the pools).
template <int NC, int BLOCKS = 1> struct Regs;
template <> struct Regs<1, 2> { static constexpr int PRODUCER = 40, CONSUMER = 216; };
template <> struct Regs<1, 3> { static constexpr int PRODUCER = 32, CONSUMER = 128; };
template <> struct Regs<2> { static constexpr int PRODUCER = 40, CONSUMER = 232; };
template <> struct Regs<3> { static constexpr int PRODUCER = 32, CONSUMER = 160; };

constexpr int SMEM_MAX = 227 * 1024;  // dynamic shared memory per block on sm_90 (opt-in)
constexpr int SMEM_PER_SM = 228 * 1024;   // shared memory of one SM (each resident block reserves 1 KB)

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_fwd_sm90.py: sm90_smem_bytes. O_SMEM: the epilogue stages each consumer's O rows in
// o_smem for a TMA store, where that fits beside the ring (not VARLEN: a box of 64 rows could
// reach into the next sequence's rows).
template <int D, int BN, int STAGES, int NC, bool VARLEN>
struct Layout {
    static constexpr int BM = WG_ROWS * NC;                  // query rows per work tile
    static constexpr int PANELS = D / PANEL_COLS;
    static constexpr int Q_PANEL = BM * 128;                 // bytes of q_smem [BM, 64]
    static constexpr int KV_PANEL = BN * 128;                // bytes of k_smem / v_smem [BN, 64]
    static constexpr int KV_TILE = PANELS * KV_PANEL;        // one stage of K (or V)
    static constexpr int O_PANEL = WG_ROWS * 128;            // bytes of one consumer's o_smem [64, 64]
    static constexpr int O_WG = PANELS * O_PANEL;            // one consumer's o_smem [PANELS][64][64]
    static constexpr int Q = 0;                              // q_smem [PANELS][BM][64]
    static constexpr int K = Q + PANELS * Q_PANEL;           // k_smem [STAGES][PANELS][BN][64]
    static constexpr int V = K + STAGES * KV_TILE;           // v_smem [STAGES][PANELS][BN][64]
    static constexpr int O = V + STAGES * KV_TILE;           // o_smem [NC][PANELS][64][64] (O_SMEM)
    static constexpr int RING_BYTES = O + 8 * (2 + 5 * STAGES) + 8;
    static constexpr bool O_SMEM = !VARLEN && RING_BYTES + NC * O_WG + 1024 <= SMEM_MAX;
    static constexpr int BARS = O + (O_SMEM ? NC * O_WG : 0);  // q_full, q_empty, k/v_full[S], k/v_empty[S], k_full2[S]
    static constexpr int TILE = BARS + 8 * (2 + 5 * STAGES);  // work-tile index, producer -> consumers
    static constexpr int BYTES = TILE + 8;
};

// The 16-bit forward's shared memory (addresses in the shared window): tiles, mbarriers and the
// work-tile slot, from the Layout of the kernel's template arguments
template <int D, int BN, int STAGES, int NC, bool VARLEN>
struct FwdSmem {
    using L = Layout<D, BN, STAGES, NC, VARLEN>;
    u32 smem;                  // 1024-aligned start
    u32 q_smem, k_smem, v_smem;
    u32 q_full;                // Q tile (and its work-tile index) landed
    u32 q_empty;               // every consumer is done with the Q tile
    u32 k_full;                // [STAGES]: K tile of the stage landed
    u32 v_full;                // [STAGES]: V tile landed
    u32 k_empty;               // [STAGES]: every consumer is done with the K tile
    u32 v_empty;               // [STAGES]: every consumer is done with the V tile
    // KSPLIT (D >= 128): k_full counts the K tile's first half of panels, k_full2 [STAGES] the
    // second, so that S = Q Kᵀ starts on the first half while the second lands
    u32 k_full2;
    volatile int* tile_smem;   // work-tile index, producer -> consumers
    __device__ __forceinline__ FwdSmem(unsigned char* smem_raw) {
        // 128-byte swizzled tiles need 1024-byte aligned panels (the swizzle pattern repeats every 8 rows)
        smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
        q_smem = smem + L::Q, k_smem = smem + L::K, v_smem = smem + L::V;
        q_full = smem + L::BARS;
        q_empty = q_full + 8;
        k_full = q_empty + 8;
        v_full = k_full + 8 * STAGES;
        k_empty = v_full + 8 * STAGES;
        v_empty = k_empty + 8 * STAGES;
        k_full2 = v_empty + 8 * STAGES;
        tile_smem = (volatile int*)(smem_raw + (smem - smem_addr(smem_raw)) + L::TILE);
    }
};

}  // namespace sm90

// Resident blocks per SM: one; with one consumer two, three with 64-key tiles, as many as fit in
// an SM's 228 KB of shared memory (1 KB reserved per block; mirrored by
// _plan.Sm90Variant.blocks_per_sm)
template <int D, int BN, int STAGES, int NC, bool VARLEN>
struct BlocksPerSm {
    static constexpr int WANT = NC == 1 ? (BN <= 64 ? 3 : 2) : 1;
    static constexpr int FIT = sm90::SMEM_PER_SM / (sm90::Layout<D, BN, STAGES, NC, VARLEN>::BYTES + 2048);
    static constexpr int VALUE = WANT < FIT ? WANT : (FIT > 0 ? FIT : 1);
};
