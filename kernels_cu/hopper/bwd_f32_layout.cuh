// cupyflash: the float32 Hopper backward's constants, tile shapes and shared-memory layout
// (namespace sm90bf; hopper/bwd_f32.cu): Shape, Layout (hd 64, design S), LayoutT (hd 128, design
// T), the work tiles and their steps, the swizzle and slot orders both roles use, and BwdF32Smem,
// the tiles' and mbarriers' addresses. (Apart from the 16-bit backward's hopper/bwd_parts.cuh so
// that its program does not carry these namespace constants.)
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/sm90.cuh"

namespace sm90bf {

// Per head-dim bucket: hd 64 (design S above), hd 128 (design T, below the hd 64 notes)
template <int D>
struct Shape {
    static constexpr bool T = D == 128;           // design T: consumers own d halves
    static constexpr int BN = T ? 64 : 128;       // keys per work tile (hd 64: two consumers x 64)
    static constexpr int RAW_STAGES = T ? 1 : 2;  // Q, dO landing buffers (hd 64: step j + 1 lands
                                                  // while step j's transposes still read step j's)
};
constexpr int BM = 32;               // query rows per step
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = 224;   // 56·128 + 224·256 = 168·384: the block's own registers
                                     // (setmaxnreg.inc takes only what the block's warps released)
constexpr int PANEL = 32;            // 32 floats = one 128-byte swizzle row
constexpr int CONV_THREADS = 96;     // producer warps 1..3
constexpr int CONV_BAR = 3;          // named barrier of the converters
constexpr int WG_BAR = 4;            // named barriers 4, 5: the 128 threads of consumer 0, 1
// Design T's dSᵀ / dS handoff between its consumers (256 threads: one side arrives, the other
// syncs); its Pᵀ handoff goes through the mbarriers pt_full, pt_empty (in the kernel)
constexpr int DS_FULL = 6;           // c1 wrote the step's dSᵀ, dS (c0 waits)
constexpr int DS_EMPTY = 7;          // c0 is done with the last dSᵀ, dS (c1 waits before the next)
constexpr int TILE_RING = 2;
constexpr int TILE_READERS = 2 * 4 + 3;   // consumer warps + converter warps
constexpr int CONSUMER_WARPS = 2 * 4;

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_bwd_sm90_f32.py: smem_bytes.
template <int D>
struct Layout {
    static constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    static constexpr int KV_PANEL = BN * 128;                // [BN, 32] panel of K / V
    static constexpr int KVT = BN * D * 4;                   // one K / V tile part
    static constexpr int Q_PANEL = BM * 128;                 // [BM, 32] panel of Q / dO
    static constexpr int QT = BM * D * 4;                    // one Q / dO tile part
    static constexpr int T_PANEL = D * 128;                  // [D, 32 queries] panel of Qᵀ / dOᵀ
    static constexpr int DS_PANEL = BM * 128;                // [BM, 32 keys] panel of dS
    static constexpr int DS_PART = 2 * DS_PANEL;             // [BM, 64 keys]: one consumer's part
    static constexpr int KB = 0;                             // k_big [D/32][BN][32] (TMA, then big)
    static constexpr int KS = KB + KVT;                      // k_small [D/32][BN][32]
    static constexpr int VB = KS + KVT;                      // v_big [D/32][BN][32] (TMA, then big)
    static constexpr int QB = VB + KVT;                      // q_big [D/32][BM][32]
    static constexpr int QS = QB + QT;                       // q_small
    static constexpr int DOB = QS + QT;                      // do_big
    static constexpr int DOS = DOB + QT;                     // do_small
    static constexpr int QTB = DOS + QT;                     // qT_big [BM/32][D][32] (queries permuted)
    static constexpr int QTS = QTB + QT;                     // qT_small
    static constexpr int DOTB = QTS + QT;                    // doT_big
    static constexpr int DOTS = DOTB + QT;                   // doT_small
    static constexpr int RAW_STAGE = 2 * QT;                 // one landing stage: q raw, dO raw
    static constexpr int RAWQ = DOTS + QT;                   // [RAW_STAGES] x (q raw [D/32][BM][32],
    static constexpr int RAWDO = RAWQ + QT;                  //   then dO raw) (TMA landing)
    static constexpr int DS = RAWQ + RAW_STAGES * RAW_STAGE; // ds [2 consumers][big, small][2][BM][32]
    static constexpr int ROWS = DS + 2 * 2 * DS_PART;        // [lse·log2 e, D][BM] of the step
    static constexpr int TILE = ROWS + 2 * BM * 4;           // tile_smem [TILE_RING] int (+ pad)
    static constexpr int BARS = TILE + 16;                   // 15 mbarriers (see the kernel)
    static constexpr int BYTES = BARS + 8 * 15;
    static constexpr int K_LAND = KB, V_LAND = VB;           // where TMA lands K, V
};

// Design T (hd 128): byte offsets as Layout's, mirrored by gpu/plan_bwd_sm90_f32.py: smem_bytes.
// K, V stay raw (A operands split on the fly in registers). Q, dO of a step land twice (TMA, the
// second read from L2): in the big halves of their parts, split there in place by the converters
// (B of Sᵀ, dPᵀ; free once those are done, so step j + 1 lands and is split while step j's later
// products run), and raw in rq / rdo (A of dKᵀ_h, dVᵀ_h, split on the fly). Pᵀ, dSᵀ [BN keys, BM
// query slots] and dS [BM queries, BN key slots] in big / small parts are the consumers' handoffs.
template <int D>
struct LayoutT {
    static constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    static constexpr int KV_PANEL = BN * 128;                // [BN, 32] panel of K / V
    static constexpr int KVT = BN * D * 4;                   // K or V raw [BN, D]
    static constexpr int Q_PANEL = BM * 128;                 // [BM, 32] panel of Q / dO
    static constexpr int QT = BM * D * 4;                    // one Q / dO tile part
    static constexpr int PT = BN * BM * 4;                   // one part of Pᵀ / dSᵀ [BN][BM] (one panel)
    static constexpr int DS_PANEL = BM * 128;                // [BM, 32 key slots] panel of dS
    static constexpr int KR = 0;                             // k_raw [D/32][BN][32] (TMA)
    static constexpr int VR = KR + KVT;                      // v_raw [D/32][BN][32] (TMA)
    static constexpr int QB = VR + KVT;                      // q_big [D/32][BM][32] (TMA raw, split in place)
    static constexpr int QS = QB + QT;                       // q_small
    static constexpr int DOB = QS + QT;                      // do_big (TMA raw, split in place)
    static constexpr int DOS = DOB + QT;                     // do_small
    static constexpr int RQ = DOS + QT;                      // q raw copy [D/32][BM][32] (TMA)
    static constexpr int RDO = RQ + QT;                      // dO raw copy (TMA)
    static constexpr int PTB = RDO + QT;                     // pT_big [BN keys][BM query slots] (c0)
    static constexpr int PTS = PTB + PT;                     // pT_small
    static constexpr int DSTB = PTS + PT;                    // dsT_big [BN keys][BM query slots] (c1)
    static constexpr int DSTS = DSTB + PT;                   // dsT_small
    static constexpr int DSB = DSTS + PT;                    // ds_big [BN/32][BM queries][32 key slots] (c1)
    static constexpr int DSS = DSB + BN * BM * 4;            // ds_small
    static constexpr int ROWS = DSS + BN * BM * 4;           // [step % 2][lse·log2 e, D][BM]
    static constexpr int TILE = ROWS + 2 * 2 * BM * 4;       // tile_smem [TILE_RING] int (+ pad)
    static constexpr int BARS = TILE + 16;                   // 15 mbarrier slots: Layout's up to
    static constexpr int BYTES = BARS + 8 * 15;              //   t_empty (13: one landing stage), pt_full, pt_empty
    static constexpr int K_LAND = KR, V_LAND = VR;           // where TMA lands K, V
};
template <int D> struct LayoutOf { using type = Layout<D>; };
template <> struct LayoutOf<128> { using type = LayoutT<128>; };

// Work tile w = n_block + num_n · (kv_head + h_k · batch) (dense; hopper/bwd.cu's order)
struct WorkTile {
    int n0, kv_head, batch;   // keys n0 .. n0 + BN of kv head kv_head in batch `batch`
    int m_first, m_count;     // the BM-row query tiles that see them
    int steps;                // m_count x the query heads of the group
};
template <int D, bool WINDOW>
__device__ __forceinline__ WorkTile work_tile(const Params& p, int w) {
    constexpr int BN = Shape<D>::BN;
    const int num_n = (p.s_k + BN - 1) / BN;
    WorkTile wt;
    wt.n0 = (w % num_n) * BN;
    wt.kv_head = (w / num_n) % p.h_k;
    wt.batch = w / num_n / p.h_k;
    // rows i with i + diag - left <= j <= i + diag + right for some key j of the tile
    const int n_rows = min(BN, p.s_k - wt.n0);
    int i_lo = 0, i_hi = p.s_q - 1;
    if (WINDOW) {
        i_lo = max(0, wt.n0 - p.diag_offset - p.window_right);
        i_hi = min(p.s_q - 1, wt.n0 + n_rows - 1 - p.diag_offset + p.window_left);
    }
    wt.m_first = i_lo / BM;
    wt.m_count = i_hi >= i_lo ? i_hi / BM - i_lo / BM + 1 : 0;
    wt.steps = wt.m_count * p.h_per_hk;
    return wt;
}
__device__ __forceinline__ int step_head(const Params& p, const WorkTile& wt, int st) {
    return wt.kv_head * p.h_per_hk + st / wt.m_count;
}
__device__ __forceinline__ int step_m0(const WorkTile& wt, int st) {
    return (wt.m_first + st % wt.m_count) * BM;
}

// Key order inside each 8-key k-step of dQᵀ = Kᵀ dSᵀ (a contraction: any order both operands
// share). Slot s holds key (s % 2)·4 + s / 2, so a k-step's A fragment columns c and c + 4 of the
// four lanes c = 0..3 are keys {0, 4, 1, 5} and {2, 6, 3, 7}: two per 16-byte-chunk band of K's
// 128-byte swizzle, and the Kᵀ fragment loads below are free of bank conflicts.
__device__ __forceinline__ int key_of_slot(int s) { return 8 * (s / 8) + (s % 2) * 4 + (s % 8) / 2; }
__device__ __forceinline__ int slot_of_key(int k) { return 8 * (k / 8) + 2 * (k % 4) + (k % 8) / 4; }

// Byte offset of element (row, col) in a [rows, 32·k] float tile stored as 128-byte swizzled
// panels of 32 columns, `panel` bytes apart (16-byte chunk index XOR row mod 8)
__device__ __forceinline__ u32 swz(int row, int col, int panel) {
    return (col / PANEL) * panel + row * 128 + ((((col % PANEL) / 4) ^ (row % 8)) << 4) + 4 * (col % 4);
}

// The float32 backward's shared memory: the 1024-aligned start (smem, in the shared window), the
// rows and work-tile ring (generic pointers) and the mbarriers, from Layout / LayoutT
template <int D>
struct BwdF32Smem {
    using L = typename LayoutOf<D>::type;
    u32 smem;                  // 1024-aligned start: tiles at smem + L::...
    float* rows_smem;          // [2][BM]: lse·log2 e, D
    volatile int* tile_smem;   // [TILE_RING], -1: none left
    u32 tile_full;             // [TILE_RING]: tile_smem slot written
    u32 tile_empty;            // [TILE_RING]: every reader has read it
    u32 kv_raw;                // K, V of the tile landed (TMA)
    u32 kv_full;               // K split: the consumers may read it
    u32 kv_empty;              // both consumers are done with K, V
    u32 raw_full;              // [RAW_STAGES]: Q, dO of a step landed (TMA)
    u32 raw_empty;             // [RAW_STAGES]: the converters are done with them
    // A step's buffers in two halves, so the converters prepare step j + 1 while step j runs:
    u32 nat_full;              // Q, dO big / small (as stored) and rows written
    u32 nat_empty;             // every consumer warp is past Sᵀ, dPᵀ, dSᵀ
    u32 t_full;                // Qᵀ, dOᵀ big / small written
    u32 t_empty;               // both consumers' dV, dK of the step done
    // Design T (hd 128) in the same slots: raw_full = Q, dO landed in their big halves (TMA); no
    // transposes, so two slots take new names: the raw Q, dO copies landed (TMA) / every consumer
    // warp has loaded its dKᵀ, dVᵀ fragments from them
    u32 r_full, r_empty;
    // Design T's Pᵀ handoff between its consumers (slots past t_empty: LayoutT only). Each thread
    // arrives after its own accesses (the rule of docs/reliability.md): pt_full counts c0's 128
    // writers, pt_empty c1's 128 readers (c0's own warps' reads are ordered by the DS_FULL sync
    // each c0 thread makes after its dVᵀ_0, before the next Pᵀ stores)
    u32 pt_full;               // c0's Pᵀ of the step written
    u32 pt_empty;              // c1 done with the step's Pᵀ
    __device__ __forceinline__ BwdF32Smem(unsigned char* smem_raw) {
        smem = (smem_addr(smem_raw) + 1023u) & ~1023u;   // swizzled panels: 1024-aligned
        unsigned char* smem_gen = smem_raw + (smem - smem_addr(smem_raw));
        rows_smem = (float*)(smem_gen + L::ROWS);
        tile_smem = (volatile int*)(smem_gen + L::TILE);
        tile_full = smem + L::BARS;
        tile_empty = tile_full + 8 * TILE_RING;
        kv_raw = tile_empty + 8 * TILE_RING;
        kv_full = kv_raw + 8;
        kv_empty = kv_full + 8;
        raw_full = kv_empty + 8;
        raw_empty = raw_full + 8 * Shape<D>::RAW_STAGES;
        nat_full = raw_empty + 8 * Shape<D>::RAW_STAGES;
        nat_empty = nat_full + 8;
        t_full = nat_empty + 8;
        t_empty = t_full + 8;
        r_full = raw_empty, r_empty = t_full;
        pt_full = t_empty + 8;
        pt_empty = pt_full + 8;
    }
};

}  // namespace sm90bf
