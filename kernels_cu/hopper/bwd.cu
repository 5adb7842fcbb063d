// cupyflash: Hopper (sm_90a) attention backward, main kernel: dK, dV (and dQ through a float32
// accumulator) with TMA loads and wgmma products. The helper kernels before it (flash_bwd_pre_sm90:
// D = rowsum(dO ∘ O) and the zeroed dQ accumulator; flash_bwd_pre from portable/bwd.cu when O's rows are
// not 16-byte aligned) and after it (flash_bwd_dq_sm90: dq = dtype(accumulator)) are in this
// module too.
//
// Persistent grid: at most one block per SM; the blocks draw work tiles (key tile of BN = 128
// keys, kv head, batch) from a per-stream global counter (p.sched, shared with the forward: the
// last block to finish zeroes it), key tiles fastest, so blocks running together share a head's
// Q / dO in L2 and the causal key tiles with the most query steps come first in each head.
// 384 threads = three warpgroups:
//   warpgroup 0, producer: one thread draws the work tiles (handed to the others through a
//     two-deep ring of tile indices in shared memory), loads each tile's K and V (KVBUF buffers)
//     and the Q and dO tiles [BM = 64 query rows, D] of every step into a two-deep ring (TMA,
//     mbarriers); a second warp stages the step's lse·log2 e and D rows into the same ring slot;
//     a third adds each step's dQ tile from shared memory into the float32 accumulator (bulk
//     reduce-add, async); the consumers tell it where.
//   warpgroups 1 and 2, consumers: 64 keys each, dK and dV [64, D] in registers over a tile's steps.
// The rings run on across work tiles: the next tile's K / V (KVBUF = 2: during the current tile's
// last steps; KVBUF = 1: as soon as the consumers' last dQ product has read K) and its first Q / dO
// tiles load while the consumers finish the current tile and store its dK, dV.
// Steps of a tile: every query head of the kv head's group x every query tile that can see it.
// Per step, each consumer computes (transposed, so its 64 keys are the M dimension of wgmma):
//   Sᵀ  = K Qᵀ             [64 keys, BM]  (wgmma, both operands in shared memory)
//   dPᵀ = V dOᵀ            [64 keys, BM]
//   Pᵀ  = exp2(Sᵀ·scale·log2 e − lse·log2 e)      (P recomputed from lse, never stored)
//   dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale
//   dV += Pᵀ dO,  dK += dSᵀ Q                     (Pᵀ, dSᵀ straight from registers)
//   dSᵀ -> shared memory; then dQ[BM, 64-column slice] = dS K over all 128 keys of the tile
//   (both operands MN-major in shared memory), added to the float32 accumulator:
//     DQ_BULK: stored to dq_smem, which the producer's reduce warp adds with one
//       cp.reduce.async.bulk .add.f32 per step (the tile's rows are contiguous in the accumulator);
//     else: red.global.add.v2.f32 from the consumer's registers.
//   The accumulator rows are chunk-swizzled like dq_smem (16-byte chunk index XOR row mod 8, so
//   the fragment stores hit every bank); flash_bwd_dq_sm90 undoes that when converting.
// Sᵀ and dPᵀ are separate wgmma groups: Pᵀ = exp2(..) runs while dPᵀ is still in the tensor
// cores. The consumers load from global memory only a bias in the BIAS_LD* variants; BIAS_TMA
// stages the step's bias tile [BM, BN] into the Q / dO ring slot (bias_smem, by the TMA thread).
// VARLEN (packed sequences): work tiles (key tile of the longest sequence, kv head, sequence z);
// each reads its sequence's first rows and lengths from cu_seqlens (KeyTile: s_q, s_k, diag,
// q_row, k_row). The tensor maps cover the packed [1, total, h, d] tensors, so a TMA box may take
// in rows of the next sequence: those keys are masked (P = 0), those query rows get lse = +inf
// (P = 0, dS = 0) and D = 0, dK / dV rows past the sequence's s_k are not stored, and the dQ bulk
// reduce-add covers only the sequence's rows (min(BM, s_q - m0) rows). lse, D and the dQ
// accumulator are [h, total_q] rows (p.s_q = total_q); the accumulator's chunk swizzle is by the
// packed row index, so a tile's rows are offset by q_row mod 8 (flash_bwd_dq_sm90 unchanged).
// Causal / window are aligned per sequence (p.varlen_bottom_right). The producer skips tiles whose
// keys start past their sequence's end before handing them on: the readers never see them.
// DET (deterministic=True): every dQ tile [BM rows of one (sequence, query head)] gets the
// additions of the key tiles that see it, n_lo .. n_hi, in key-tile order, descending or
// ascending (p.det_sched & 1): the DQ_WARP lane waits until the tile's int32 semaphore (after the
// accumulator: bwd_parts.cuh dq_sem) equals its key tile's rank (n_hi − n or n − n_lo: dq_rank;
// acquire), adds, waits for the addition to land and releases rank + 1. The work tiles are
// numbered so that each key tile's predecessor has the smaller index (sched.cuh key_tile: pairs
// in groups of p.det_sched / 2, key-tile-major), which the counter hands out first and only to
// running blocks: no deadlock whatever the residency (the static draw could: DET traps without
// p.sched). Steps run query tiles outer, ascending or descending with the order, the group's
// heads inner, so that the predecessor reaches each shared query tile first (sched.cuh step_m0;
// docs/hopper.md). dK, dV are summed in registers in both modes (GQA too).
// Covered (the launcher routes the rest to portable/bwd.cu): float16 / bfloat16, d = d_v in {64, 128, 256},
// causal / window (either alignment), GQA / MQA, any s_q, s_k, scale > 0, no softcap / ALiBi,
// atomic or (DET) ordered dQ, TMA-compatible strides; dense or (VARLEN) packed sequences;
// (BIAS, not with DET) an additive bias with dbias, in the layouts plan_bwd_sm90.bias_unsupported
// accepts. A boolean mask, deterministic dbias and other bias layouts run portable/bwd.cu.
// d = 256 (Layout::SPLIT_D): 64-key work tiles, both consumers on the same keys with half the head
// dim each (hopper/bwd_split_consumer.cuh), dQ added from registers; no bias.
#include "common/bwd_pre_dq.cuh"
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_consumer.cuh"
#include "hopper/bwd_epilogue.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/bwd_producer.cuh"
#include "hopper/bwd_split_consumer.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

// VARLEN: packed sequences (see the header). BIAS (sm90b::BIAS_*): 0 none; 1 bias elements in
// E's storage, 2 float32 bias elements, both loaded by the consumers (unit key stride: the
// launcher checks); 3 E's elements staged into shared memory per step by TMA (Params.tma_bias:
// a full query dimension, 16-byte row strides). dbias (Params dbias_accum / dbias_mode /
// dbias_stride_*) then receives dS. The varlen API passes no bias: never both.
// The entry sets up shared memory (Smem) and the mbarriers and hands each warpgroup its role: the
// producer's TMA thread bwd_load and ROWS_WARP stage_rows (hopper/bwd_producer.cuh), DQ_WARP
// reduce_dq (hopper/bwd_epilogue.cuh), the consumers bwd_consumer (hopper/bwd_consumer.cuh).
template <typename E, int D, bool WINDOW, bool DQ_BULK, int KVBUF, bool VARLEN, int BIAS,
          bool DET = false>
__global__ void __launch_bounds__(sm90b::THREADS, 1)
flash_bwd_sm90(const __grid_constant__ Params p) {
    using namespace sm90b;
    using L = Layout<D, KVBUF, BIAS == BIAS_TMA, DET>;
    static_assert(Elem<E>::is16 && (D == 64 || D == 128 || D == 256), "float16 / bfloat16, head dim 64, 128, 256");
    static_assert(D != 256 || (!DQ_BULK && KVBUF == 1 && BIAS == BIAS_NONE),
                  "head dim 256: dQ from registers, one K / V buffer, no bias");
    static_assert(KVBUF == 1 || KVBUF == 2, "one or two K / V buffers");
    static_assert(BIAS >= BIAS_NONE && BIAS <= BIAS_TMA, "bias: none, E, float32, E by TMA");
    static_assert(!(VARLEN && BIAS), "varlen takes no bias");
    static_assert(!DET || ((DQ_BULK || D == 256) && BIAS == BIAS_NONE),
                  "deterministic: bulk dQ (d = 256: ordered adds from registers), no bias (dbias is added with atomics)");
    constexpr int DQ_THREADS = (D / PANEL_COLS) * 128;   // consumer threads that write a dQ slice

    extern __shared__ unsigned char smem_raw[];
    const u32 smem = aligned_smem<L>(smem_raw);   // swizzled panels: 1024-aligned (traps if too small)
    unsigned char* smem_gen = smem_raw + (smem - smem_addr(smem_raw));
    const u32 k_smem = smem + L::K, v_smem = smem + L::V, q_smem = smem + L::Q;
    const u32 do_smem = smem + L::DO, ds_smem = smem + L::DS, dq_smem = smem + L::DQ;
    float* rows_smem = (float*)(smem_gen + L::ROWS);    // [NBUF][2][BM]: lse·log2 e, D per stage
    volatile int* tile_smem = (volatile int*)(smem_gen + L::TILE);   // [TILE_RING] work tile, -1: none left
    volatile int* seq_smem = tile_smem + TILE_RING;     // [2] VARLEN: the consumers' tile nk, nrel
    volatile u64* job_smem = (volatile u64*)(smem_gen + L::JOB);     // [2] dQ tile's accumulator
                                                                     // address (0: stop), bytes;
                                                                     // DET [4]: + semaphore, rank
    const u32 kv_full = smem + L::BARS;                 // [KVBUF]: K, V tiles of the buffer landed
    const u32 kv_empty = kv_full + 8 * KVBUF;           // [KVBUF]: both consumers are done with them
    const u32 qdo_full = kv_empty + 8 * KVBUF;          // [NBUF]: Q, dO, lse, D (bias) of the stage landed
    const u32 qdo_empty = qdo_full + 8 * NBUF;          // [NBUF]: both consumers are done with them
    const u32 dq_full = qdo_empty + 8 * NBUF;           // dq_smem and job_smem hold the step's dQ tile
    const u32 dq_empty = dq_full + 8;                   // dq_smem read out by the bulk reduce
    const u32 tile_full = dq_empty + 8;                 // [TILE_RING]: tile_smem slot written
    const u32 tile_empty = tile_full + 8 * TILE_RING;   // [TILE_RING]: every reader has read the slot
    // the same, for the role functions
    const Smem sm = {smem, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem,
                     rows_smem, tile_smem, seq_smem, job_smem, kv_full, kv_empty, qdo_full, qdo_empty,
                     dq_full, dq_empty, tile_full, tile_empty};
    // VARLEN: p.b sequences, p.num_n_blocks key tiles of the longest one each
    const int num_work = (VARLEN ? p.num_n_blocks : (p.s_k + L::BN - 1) / L::BN) * p.h_k * p.b;

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int b = 0; b < KVBUF; ++b) {
            mbar_init(kv_full + 8 * b, 1);       // the TMA thread's expect_tx arrival (+ bytes)
            mbar_init(kv_empty + 8 * b, 2);      // one arrival per consumer warpgroup
        }
        for (int s = 0; s < NBUF; ++s) {
            mbar_init(qdo_full + 8 * s, 1 + 32);  // TMA thread (+ bytes) and the 32 lanes of ROWS_WARP
            mbar_init(qdo_empty + 8 * s, 256);   // one arrival per consumer thread (each after its own reads)
        }
        mbar_init(dq_full, DQ_THREADS);          // every thread that stored a part of the dQ tile
        mbar_init(dq_empty, 1);                  // the DQ_WARP lane that issued the bulk reduce
        for (int s = 0; s < TILE_RING; ++s) {
            mbar_init(tile_full + 8 * s, 1);     // the scheduling thread
            mbar_init(tile_empty + 8 * s, 32 * TILE_READERS);   // every lane of each reading warp
        }
        if constexpr (L::SPLIT_D) {
            mbar_init(tile_empty + 8 * TILE_RING, 128);       // pt_full: each c0 thread's Pᵀ pairs written
            mbar_init(tile_empty + 8 * TILE_RING + 8, 128);   // pt_empty: each c1 thread's read back
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<PRODUCER_REGS>();
        const int warp = t / 32, lane = t % 32;
        if (t == 0) {
            bwd_load<D, WINDOW, KVBUF, VARLEN, BIAS, DET>(p, sm, num_work);
        } else if (warp == ROWS_WARP) {
            stage_rows<L::BN, WINDOW, VARLEN, BIAS, DET>(p, sm, lane);
        } else if (DQ_BULK && t == DQ_WARP * 32) {
            reduce_dq<DET>(sm);
        }
        return;
    }

    // ================================ consumers ================================
    regs_acquire<CONSUMER_REGS>();
    if constexpr (L::SPLIT_D)
        bwd_split_consumer<E, D, WINDOW, VARLEN, DET>(p, sm, wg, t);
    else
        bwd_consumer<E, D, WINDOW, DQ_BULK, KVBUF, VARLEN, BIAS, DET>(p, sm, smem_raw, wg, t);
}

// ---------------------------------------------------------------------------------------------
// Helper kernels, grid (query-row blocks, h, b) x 256 threads: no index division per element.
// ---------------------------------------------------------------------------------------------

// D = rowsum(dO ∘ O) [b, h, s_q] and the zeroed dQ accumulator row, D / 8 threads per query row,
// each with one 16-byte chunk of dO and O (the launcher runs portable/bwd.cu's flash_bwd_pre instead when
// O's rows are not 16-byte aligned; dO's are, for TMA).
template <typename E, int D>
__global__ void __launch_bounds__(256)
flash_bwd_pre_sm90(const Params p) {
    typedef typename Elem<E>::storage S;
    constexpr int LANES = D / 8;             // threads per row (consecutive lanes of one warp)
    constexpr int ROWS = 256 / LANES;        // rows per block
    const int head = blockIdx.y, batch = blockIdx.z;
    const int i = blockIdx.x * ROWS + threadIdx.x / LANES;   // query row
    const int chunk = threadIdx.x % LANES;                   // columns 8·chunk .. 8·chunk + 7
    float acc = 0.f;
    if (i < p.s_q) {
        const S* do_row = (const S*)p.dout + batch * p.do_stride_b + (i64)i * p.do_stride_s + head * p.do_stride_h;
        const S* o_row = (const S*)p.o + batch * p.o_stride_b + (i64)i * p.o_stride_s + head * p.o_stride_h;
        const uint4 dov = *(const uint4*)(do_row + 8 * chunk);   // 8 16-bit elements each
        const uint4 ov = *(const uint4*)(o_row + 8 * chunk);
        const u32 dw[4] = {dov.x, dov.y, dov.z, dov.w}, ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
            acc += to_float<E>((S)(dw[e] & 0xffffu)) * to_float<E>((S)(ow[e] & 0xffffu)) +
                   to_float<E>((S)(dw[e] >> 16)) * to_float<E>((S)(ow[e] >> 16));
    }
    // sum over the row's LANES threads
#pragma unroll
    for (int off = LANES / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (i < p.s_q) {
        const i64 row = ((i64)batch * p.h + head) * p.s_q + i;   // [b, h, s_q]
        if (chunk == 0) p.dsum[row] = acc;
        float4* dq_row = (float4*)(p.dq_accum + row * D);       // [D / 4] 16-byte chunks
        dq_row[chunk] = make_float4(0.f, 0.f, 0.f, 0.f);
        dq_row[chunk + LANES] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// dq = E(dQ accumulator): one thread per 16-byte chunk (4 floats) of an accumulator row, read
// from its chunk-swizzled place (dq_swizzle: chunk c of row i sits at c XOR i mod 8); grid (row
// blocks, h, b)
template <typename E, int D>
__global__ void __launch_bounds__(256)
flash_bwd_dq_sm90(const Params p) {
    typedef typename Elem<E>::storage S;
    static_assert(Elem<E>::is16, "the 16-bit backward's conversion (float32 adds into dq directly)");
    constexpr int CHUNKS = D / 4;            // 16-byte chunks per accumulator row
    constexpr int ROWS = 256 / CHUNKS;       // rows per block
    const int head = blockIdx.y, batch = blockIdx.z;
    const int i = blockIdx.x * ROWS + threadIdx.x / CHUNKS;   // query row
    const int c = threadIdx.x % CHUNKS;                       // columns 4c .. 4c + 3
    if (i >= p.s_q) return;
    const i64 row = ((i64)batch * p.h + head) * p.s_q + i;    // [b, h, s_q]
    const float4 a = *(const float4*)(p.dq_accum + row * D + 4 * (c ^ (i & 7)));
    S* dq_el = (S*)p.dq + batch * p.dq_stride_b + (i64)i * p.dq_stride_s + head * p.dq_stride_h + 4 * c;
    const u32 lo = pack2<E>(a.x, a.y), hi = pack2<E>(a.z, a.w);   // element 4c in lo's low half
    // 8-byte store where dq's rows allow it (a uniform test), else four 16-bit stores
    const bool vec = ((size_t)p.dq % 8 == 0) && p.dq_stride_b % 4 == 0 && p.dq_stride_s % 4 == 0 &&
                     p.dq_stride_h % 4 == 0;
    if (vec) {
        *(uint2*)dq_el = make_uint2(lo, hi);
    } else {
        dq_el[0] = (S)(lo & 0xffffu);
        dq_el[1] = (S)(lo >> 16);
        dq_el[2] = (S)(hi & 0xffffu);
        dq_el[3] = (S)(hi >> 16);
    }
}
