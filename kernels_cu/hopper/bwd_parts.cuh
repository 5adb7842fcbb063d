// cupyflash: the Hopper backwards' shared parts (namespace sm90b): constants, shared-memory
// layout, the dQ accumulator's rows and swizzle, and the float32 reductions into global memory
// (bulk reduce, red.global.add.v2). hopper/bwd.cu (its work tile: hopper/sched.cuh's key_tile);
// hopper/bwd_f32.cu uses the reductions.
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90b {

constexpr int BN = 128;              // keys per block: two consumer warpgroups x 64
constexpr int BM = 64;               // query rows per step
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;   // 40·128 + 232·256 <= 64K registers per SM
constexpr int DS_BAR = 1;            // named barrier 1: both consumers wrote their dSᵀ rows
constexpr int SPLIT_DS_FULL = 2;     // d = 256: c1 wrote the step's dSᵀ (both sync)
constexpr int SPLIT_DS_EMPTY = 3;    // d = 256: c0's products have read the last dSᵀ (c1 syncs)
constexpr int SPLIT_WG_BAR = 4;      // d = 256, DET: bar 4 + c, consumer c's own 128 threads
constexpr int ROWS_WARP = 1;         // producer warp staging lse·log2 e and D
constexpr int DQ_WARP = 2;           // producer warp adding dq_smem into the accumulator
constexpr int PANEL_COLS = 64;       // 64 16-bit columns = one 128-byte swizzle row
constexpr int NBUF = 2;              // Q / dO ring depth
constexpr int TILE_RING = 2;         // work-tile indices in flight (tile_smem ring)
// Warps that read each tile_smem index (each of their lanes frees the slot): the consumer
// warps (4 + 4) and the ROWS_WARP
constexpr int TILE_READERS = 2 * 4 + 1;
static_assert(TILE_RING + 2 <= 4, "tile_smem and seq_smem share 16 bytes");

// The kernel's BIAS template argument: how the additive bias reaches the scores
constexpr int BIAS_NONE = 0;
constexpr int BIAS_LD16 = 1;   // E's 16-bit elements, loaded from global memory by the consumers
constexpr int BIAS_LD32 = 2;   // float32 elements, likewise
constexpr int BIAS_TMA = 3;    // E's 16-bit elements, staged per step into bias_smem by TMA

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_bwd_sm90.py: smem_bytes. DET: the dQ job has two more fields (the tile's
// semaphore and its rank). SPLIT_D (d = 256, hopper/bwd_split_consumer.cuh): BN = 64 keys, both
// consumers on the same keys with half the head dim each; one dSᵀ tile and one Pᵀ tile (the
// consumers' handoffs), no dq_smem (dQ is added from registers: 64 KB more do not fit)
template <int D, int KVBUF, bool BIAS_SMEM, bool DET = false>
struct Layout {
    static constexpr bool SPLIT_D = D == 256;
    static constexpr int BN = SPLIT_D ? 64 : sm90b::BN;     // keys per work tile
    static constexpr int PANELS = D / PANEL_COLS;
    static constexpr int KV_PANEL = BN * 128;                // bytes of k_smem / v_smem [BN, 64]
    static constexpr int KV_TILE = PANELS * KV_PANEL;
    static constexpr int Q_PANEL = BM * 128;                 // bytes of q_smem / do_smem [BM, 64]
    static constexpr int Q_TILE = PANELS * Q_PANEL;
    static constexpr int DS_TILE = BN * BM * 2;              // dsT_smem [BN keys, BM queries]
    static constexpr int DQ_PITCH = D * 4;                   // dq_smem row bytes (chunk-swizzled)
    static constexpr int K = 0;                              // k_smem [KVBUF][PANELS][BN][64]
    static constexpr int V = K + KVBUF * KV_TILE;            // v_smem [KVBUF][PANELS][BN][64]
    static constexpr int Q = V + KVBUF * KV_TILE;            // q_smem [NBUF][PANELS][BM][64]
    static constexpr int DO = Q + NBUF * Q_TILE;             // do_smem [NBUF][PANELS][BM][64]
    static constexpr int DS = DO + NBUF * Q_TILE;            // dsT_smem [2][BN][BM] (SPLIT_D: [BN][BM])
    static constexpr int PT = DS + DS_TILE;                  // SPLIT_D: pT_smem [BN][BM] (in the
                                                             // second dSᵀ buffer's place)
    static constexpr int DQ = DS + 2 * DS_TILE;              // dq_smem [BM][D] float32 (DQ_BULK)
    static constexpr int BIAS_PANEL = BM * 128;              // bias_smem [BM queries, 64 keys], 16-bit
    static constexpr int BIAS_TILE = BIAS_SMEM ? (BN / PANEL_COLS) * BIAS_PANEL : 0;
    static constexpr int BIAS = DQ + (SPLIT_D ? 0 : BM * DQ_PITCH);   // bias_smem [NBUF][BN / 64][BM][64] (BIAS_TMA)
    static constexpr int ROWS = BIAS + NBUF * BIAS_TILE;     // rows_smem [NBUF][lse·log2 e, D][BM]
    static constexpr int TILE = ROWS + NBUF * 2 * BM * 4;    // tile_smem [TILE_RING] int, seq_smem [2] int (16 bytes)
    static constexpr int JOB = TILE + 16;                    // dq_job: accumulator address, bytes
                                                             // (DET: + semaphore address, rank)
    static constexpr int BARS = JOB + (DET ? 32 : 16);       // kv_full[KVBUF], kv_empty[KVBUF],
                                                             // qdo_full[NBUF], qdo_empty[NBUF],
                                                             // dq_full, dq_empty,
                                                             // tile_full[TILE_RING], tile_empty[TILE_RING]
                                                             // (SPLIT_D: pt_full, pt_empty)
    static constexpr int BYTES = BARS + 8 * (2 * KVBUF + 2 * NBUF + 2 + 2 * TILE_RING + (SPLIT_D ? 2 : 0));
};

// flash_bwd_sm90's shared memory (Layout's regions from the 1024-aligned base smem: u32 shared
// addresses for TMA / wgmma / st.shared, generic pointers for plain loads and stores) and its
// mbarriers, in this order (the kernel fills it); the roles written as functions read it
struct Smem {
    u32 smem;                                   // the aligned base (generic pointer: derived
                                                // from the kernel's smem_raw where needed)
    u32 k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem;
    float* rows_smem;                           // [NBUF][2][BM]: lse·log2 e, D per stage
    volatile int* tile_smem;                    // [TILE_RING] work tile, -1: none left
    volatile int* seq_smem;                     // [2] VARLEN: the consumers' tile nk, nrel
    volatile u64* job_smem;                     // [2] dQ tile's accumulator address (0: stop),
                                                // bytes; DET [4]: + semaphore, rank
    u32 kv_full, kv_empty;                      // [KVBUF]: K, V landed / both consumers done with them
    u32 qdo_full, qdo_empty;                    // [NBUF]: Q, dO, lse, D (bias) landed / consumers done
    u32 dq_full, dq_empty;                      // dq_smem, job_smem hold the step's dQ tile / read out
    u32 tile_full, tile_empty;                  // [TILE_RING]: tile_smem slot written / read by all
};

// cu_seqlens[z], read again where it is used (an L1 hit) rather than held in a register across
// a tile's steps: the hd 128 consumers have none to spare
__device__ __forceinline__ int ld_seq(const int* a) {
    return __ldg(a);
}
// The work tile's accumulator rows [s_q, D] of query head `head` and (*s_q) the sequence's s_q
template <bool VARLEN, int D>
__device__ __forceinline__ float* dq_rows(const Params& p, const KeyTile& wt, int head, int* s_q) {
    if constexpr (VARLEN) {
        const int q_row = ld_seq(p.cu_seqlens_q + wt.batch);
        *s_q = ld_seq(p.cu_seqlens_q + wt.batch + 1) - q_row;
        return p.dq_accum + ((i64)head * p.s_q + q_row) * D;
    }
    *s_q = p.s_q;
    return p.dq_accum + ((i64)wt.batch * p.h + head) * p.s_q * D;
}

// DET: the semaphore of the dQ tile (query head `head`, rows m0 .. m0 + BM of the sequence) of
// work tile wt: int32 counters after the accumulator's p.dq_accum_slab floats (zeroed by the
// launcher), one per BM-row tile of each (sequence, head) slab of accumulator rows, at
// floor(R / BM) + slab (R: the tile's first accumulator row; slab: the slab's place in row order),
// distinct for distinct tiles and below ceil(rows / BM) + slabs (docs/hopper.md). PARTS > 1 (the
// d = 256 kernel: one per consumer's column half): PARTS semaphores per tile, `part` its own
template <bool VARLEN, int BM, int PARTS = 1>
__device__ __forceinline__ int* dq_sem(const Params& p, const KeyTile& wt, int head, int m0, int part = 0) {
    i64 slab, row0;   // the slab's number and first accumulator row
    if constexpr (VARLEN) {
        slab = (i64)head * p.b + wt.batch;
        row0 = (i64)head * p.s_q + ld_seq(p.cu_seqlens_q + wt.batch);
    } else {
        slab = (i64)wt.batch * p.h + head;
        row0 = slab * p.s_q;
    }
    return (int*)(p.dq_accum + p.dq_accum_slab) + PARTS * ((row0 + m0) / BM + slab) + part;
}
// DET: the rank of key tile n0 / BN among the key tiles that touch query tile m0 of a sequence
// (s_q, s_k, diag): they are n_lo .. n_hi, the tiles of the keys the query tile's rows keep,
// n_lo the tile of the first key row m0 keeps, max(0, m0 + diag − left) / BN, n_hi that of the
// last key its last row keeps, min(s_k − 1, min(m0 + BM, s_q) − 1 + diag + right) / BN (without
// WINDOW: 0 and (s_k − 1) / BN). Ascending order (p.det_sched even): n − n_lo; descending: n_hi − n
template <bool WINDOW, int BM, int BN>
__device__ __forceinline__ int dq_rank(const Params& p, int n0, int s_q, int s_k, int diag, int m0) {
    if (p.det_sched & 1) {
        const int n_hi = WINDOW ? min(s_k - 1, min(m0 + BM, s_q) - 1 + diag + p.window_right) / BN
                                : (s_k - 1) / BN;
        return n_hi - n0 / BN;
    }
    const int n_lo = WINDOW ? max(0, m0 + diag - p.window_left) / BN : 0;
    return n0 / BN - n_lo;
}
// DET: wait until *sem == value (acquire at GPU scope: what was released with it is seen)
__device__ __forceinline__ void sem_wait_eq(const int* sem, int value) {
    int v;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
    } while (v != value);
}
// DET: *sem = value, after every earlier memory operation of this thread (release at GPU scope)
__device__ __forceinline__ void sem_release(int* sem, int value) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(sem), "r"(value) : "memory");
}
// Orders this thread's generic-proxy global accesses with its async-proxy ones (bulk copies)
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Float offset of element (row i, column c) in a chunk-swizzled float32 row of D columns:
// 16-byte chunk c / 4 XOR i mod 8 (stays within the row: D / 4 >= 8 chunks)
__device__ __forceinline__ int dq_swizzle(int i, int c) {
    return (((c >> 2) ^ (i & 7)) << 2) | (c & 3);
}

// dst_gmem[0 .. bytes/4) += src_smem[..] (float32), done by the TMA unit; counted in this
// thread's bulk group (bulk_commit / bulk_wait*)
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst_gmem, u32 src_smem, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst_gmem), "r"(src_smem), "r"(bytes) : "memory");
}
// *addr += (x, y) on two consecutive floats in global memory (sm_90 vector reduction)
__device__ __forceinline__ void red_add_v2(float* addr, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(x), "f"(y) : "memory");
}

// A consumer's dQ slice [BM rows, N columns] from its wgmma accumulator (registers i, i + 1: row
// r0, columns col0 + 8·(i / 4) + col_in_8, + 1; i + 2, i + 3: row r0 + 8) added into the
// accumulator rows dq_bh [s_q, D] (chunk-swizzled by row + sw: varlen rows' offset), with
// red.global.add.v2; rows past s_q are left alone (r0 is m0 + the lane's row: m0 % 8 = 0)
template <int N, int D>
__device__ __forceinline__ void red_dq_slice(float* dq_bh, int r0, int s_q, int sw, int col0,
                                             int col_in_8, const float* dq_acc) {
#pragma unroll
    for (int i = 0; i < N / 2; i += 4) {
        const int col = col0 + (i / 4) * 8 + col_in_8;
        if (r0 < s_q) red_add_v2(dq_bh + (i64)r0 * D + dq_swizzle(r0 + sw, col), dq_acc[i], dq_acc[i + 1]);
        if (r0 + 8 < s_q)
            red_add_v2(dq_bh + (i64)(r0 + 8) * D + dq_swizzle(r0 + 8 + sw, col), dq_acc[i + 2], dq_acc[i + 3]);
    }
}

}  // namespace sm90b
