// cupyflash: the float32 Hopper forward's constants, register split and shared-memory layout
// (namespace sm90f32; hopper/fwd_f32.cu): Layout and FwdF32Smem, the tiles' and mbarriers'
// addresses its roles use. (Apart from hopper/fwd_layout.cuh so that the 16-bit forward's program
// does not carry these namespace constants.)
#pragma once

#include "hopper/sm90.cuh"

namespace sm90f32 {

constexpr int F32_PANEL_COLS = 32;   // 32 floats = one 128-byte swizzle row
constexpr int CONV_THREADS = 96;     // producer warps 1..3: the converters
constexpr int CONV_BAR = 8;          // named barrier of the 96 converter threads
// (the 16-bit forward's named barriers 1 .. NC and 4 .. 3 + NC are the consumers')

// Registers per thread after setmaxnreg, NC = 2: producer·128 + consumer·256 = the block's
// 168·384 (the total may not grow: setmaxnreg.inc only takes what the block's warps gave back).
// 56 / 224 by default; WIDE (hd 128 with O_RN and the window masks, which spill 56 B at 224):
// 40 / 232 (the TMA thread and converters fit 40 without spills, but hd 64 timed -3 to +2 % with
// it against 56 / 224 on the H200). NC = 1 keeps the launch
// allocation: 256 threads x 255 registers fit as they are.
template <int NC, bool WIDE> struct Regs;
template <bool WIDE> struct Regs<2, WIDE> {
    static constexpr int CONSUMER = WIDE ? 232 : 224, PRODUCER = (168 * 384 - 256 * CONSUMER) / 128;
};

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_fwd_sm90.py: sm90_f32_smem_bytes (hopper/fwd_f32.cu traps on a mismatch). QREG: no q_small tile (the consumers keep it in
// registers).
template <int D, int BN, int STAGES, int NC, bool QREG>
struct Layout {
    static constexpr int BM = 64 * NC;                       // query rows per work tile
    static constexpr int Q_PANEL = BM * 128;                 // bytes of one Q panel [BM, 32]
    static constexpr int KV_PANEL = BN * 128;                // one K / raw V panel [BN, 32]
    static constexpr int VT_PANEL = D * 128;                 // one Vᵀ panel [D, 32 keys]
    static constexpr int QT = BM * D * 4;                    // bytes of one Q tile
    static constexpr int KVT = BN * D * 4;                   // bytes of one K / V / Vᵀ tile
    static constexpr int Q = 0;                              // q_smem [D/32][BM][32]: raw, then big
    static constexpr int QS = Q + QT;                        // q_small [D/32][BM][32] (!QREG)
    static constexpr int KB = QS + (QREG ? 0 : QT);          // k_big [STAGES][D/32][BN][32] (TMA, then big)
    static constexpr int KS = KB + STAGES * KVT;             // k_small [STAGES][D/32][BN][32]
    static constexpr int VTB = KS + STAGES * KVT;            // vt_big [STAGES][BN/32][D][32]
    static constexpr int VTS = VTB + STAGES * KVT;           // vt_small [STAGES][BN/32][D][32]
    static constexpr int VRAW = VTS + STAGES * KVT;          // v_raw [STAGES][D/32][BN][32] (TMA)
    static constexpr int BARS = VRAW + STAGES * KVT;         // 3 + 7·STAGES mbarriers
    static constexpr int TILE = BARS + 8 * (3 + 7 * STAGES); // work-tile index, producer -> all
    static constexpr int BYTES = TILE + 8;
};


// The float32 forward's shared memory (addresses in the shared window): tiles, mbarriers and the
// work-tile slot, from its Layout
template <int D, int BN, int STAGES, int NC, bool QREG>
struct FwdF32Smem {
    using L = Layout<D, BN, STAGES, NC, QREG>;
    u32 q_smem, q_small, k_big, k_small, vt_big, vt_small, v_raw;
    u32 q_raw;                 // Q tile (and its work-tile index) landed
    u32 q_full;                // Q split: consumers may read the tile (!QREG)
    u32 q_empty;               // every consumer is done with the Q tile
                               // (QREG: and the converters with its index)
    u32 k_raw;                 // [STAGES]: K tile landed (TMA)
    u32 v_rawb;                // [STAGES]: V tile landed (TMA)
    u32 k_full;                // [STAGES]: K split: S may read it
    u32 v_full;                // [STAGES]: Vᵀ written: O += P V may read it
    u32 k_empty;               // [STAGES]: every consumer's S is done with K
    u32 v_empty;               // [STAGES]: every consumer's P V is done with Vᵀ
    u32 vraw_empty;            // [STAGES]: the converters have read raw V
    volatile int* tile_smem;   // work-tile index, producer -> all
    __device__ __forceinline__ FwdF32Smem(unsigned char* smem_raw) {
        // 128-byte swizzled panels need 1024-byte alignment (the swizzle pattern repeats every 8 rows)
        const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
        q_smem = smem + L::Q, q_small = smem + L::QS;
        k_big = smem + L::KB, k_small = smem + L::KS;
        vt_big = smem + L::VTB, vt_small = smem + L::VTS, v_raw = smem + L::VRAW;
        q_raw = smem + L::BARS;
        q_full = q_raw + 8;
        q_empty = q_full + 8;
        k_raw = q_empty + 8;
        v_rawb = k_raw + 8 * STAGES;
        k_full = v_rawb + 8 * STAGES;
        v_full = k_full + 8 * STAGES;
        k_empty = v_full + 8 * STAGES;
        v_empty = k_empty + 8 * STAGES;
        vraw_empty = v_empty + 8 * STAGES;
        tile_smem = (volatile int*)(smem_raw + (smem - smem_addr(smem_raw)) + L::TILE);
    }
};

}  // namespace sm90f32
