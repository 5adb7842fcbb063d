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
// Covered (the launcher routes the rest to portable/bwd.cu): float16 / bfloat16, d = d_v in {64, 128},
// causal / window (either alignment), GQA / MQA, any s_q, s_k, scale > 0, no softcap / ALiBi,
// atomic or (DET) ordered dQ, TMA-compatible strides; dense or (VARLEN) packed sequences;
// (BIAS, not with DET) an additive bias with dbias, in the layouts plan_bwd_sm90.bias_unsupported
// accepts. A boolean mask, deterministic dbias and other bias layouts run portable/bwd.cu.
#include "common/bwd_pre_dq.cuh"
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_epilogue.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/bwd_producer.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

// VARLEN: packed sequences (see the header). BIAS (sm90b::BIAS_*): 0 none; 1 bias elements in
// E's storage, 2 float32 bias elements, both loaded by the consumers (unit key stride: the
// launcher checks); 3 E's elements staged into shared memory per step by TMA (Params.tma_bias:
// a full query dimension, 16-byte row strides). dbias (Params dbias_accum / dbias_mode /
// dbias_stride_*) then receives dS. The varlen API passes no bias: never both.
template <typename E, int D, bool WINDOW, bool DQ_BULK, int KVBUF, bool VARLEN, int BIAS,
          bool DET = false>
__global__ void __launch_bounds__(sm90b::THREADS, 1)
flash_bwd_sm90(const __grid_constant__ Params p) {
    using namespace sm90b;
    using L = Layout<D, KVBUF, BIAS == BIAS_TMA, DET>;
    typedef typename Elem<E>::storage S;
    static_assert(Elem<E>::is16 && (D == 64 || D == 128), "float16 / bfloat16, head dim 64 or 128");
    static_assert(KVBUF == 1 || KVBUF == 2, "one or two K / V buffers");
    static_assert(BIAS >= BIAS_NONE && BIAS <= BIAS_TMA, "bias: none, E, float32, E by TMA");
    constexpr bool BIAS_LD = BIAS == BIAS_LD16 || BIAS == BIAS_LD32;   // the consumers load it
    static_assert(!(VARLEN && BIAS), "varlen takes no bias");
    static_assert(!DET || (DQ_BULK && BIAS == BIAS_NONE),
                  "deterministic: bulk dQ, no bias (dbias is added with atomics)");
    constexpr int BIAS_BYTES = BIAS == BIAS_LD32 ? 4 : 2;   // bytes per bias element
    constexpr int NS = BM / 2;       // Sᵀ / dPᵀ accumulator registers per lane: [64, BM]
    constexpr int NKV = D / 2;       // dK / dV accumulator registers per lane: [64, D]
    constexpr int NQ = PANEL_COLS / 2;   // dQ slice accumulator registers per lane: [BM, 64]
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
    // the same, for the roles written as functions (bwd_producer.cuh, bwd_epilogue.cuh)
    const Smem sm = {smem, smem_gen, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem,
                     rows_smem, tile_smem, seq_smem, job_smem, kv_full, kv_empty, qdo_full, qdo_empty,
                     dq_full, dq_empty, tile_full, tile_empty};
    // VARLEN: p.b sequences, p.num_n_blocks key tiles of the longest one each
    const int num_work = (VARLEN ? p.num_n_blocks : (p.s_k + BN - 1) / BN) * p.h_k * p.b;

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
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<PRODUCER_REGS>();
        const int warp = t / 32, lane = t % 32;
        if (t == 0) {
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
        } else if (warp == ROWS_WARP) {
            stage_rows<WINDOW, VARLEN, BIAS, DET>(p, sm, lane);
        } else if (DQ_BULK && t == DQ_WARP * 32) {
            reduce_dq<DET>(sm);
        }
        return;
    }

    // ================================ consumers ================================
    regs_acquire<CONSUMER_REGS>();
    // consumer 0 or 1: keys n0 + 64·cw .. (broadcast from lane 0: warp-uniform for the compiler,
    // so what derives from it, the descriptors below, stays in uniform registers)
    const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
    // wgmma descriptors of stage / buffer 0 (K-major: LBO 16; MN-major: LBO = bytes between
    // panels); every product's is one of these plus a byte offset (desc_add: one add, not
    // smem_desc's ~10 instructions per product)
    const u64 k_desc = smem_desc(k_smem, 16, 1024), v_desc = smem_desc(v_smem, 16, 1024);     // K-major
    const u64 q_desc = smem_desc(q_smem, 16, 1024), do_desc = smem_desc(do_smem, 16, 1024);
    const u64 q_desc_mn = smem_desc(q_smem, L::Q_PANEL, 1024), do_desc_mn = smem_desc(do_smem, L::Q_PANEL, 1024);
    const u64 ds_desc = smem_desc(ds_smem, L::DS_TILE, 1024), k_desc_mn = smem_desc(k_smem, L::KV_PANEL, 1024);
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (t % 4);                      // accumulator columns col_in_8, +1 (of 8)
    const bool dq_cols = cw * PANEL_COLS < D;              // this consumer computes a dQ slice

    float dk_acc[NKV], dv_acc[NKV];   // dK, dV [64 keys, D], fp32

    // Bias plane [s_q, s_k] (unit key stride) of (batch, query head), as bytes; the dbias plane
    // of the float32 accumulator (null: no dbias wanted)
    auto bias_plane = [&](int batch, int head) -> const char* {
        return (const char*)p.bias + (batch * p.bias_stride_b + head * p.bias_stride_h) * BIAS_BYTES;
    };
    // This consumer's bias block [BM queries, 64 keys] of a step into L1 or L2 (ahead of its loads):
    // thread t takes query row t / 2, half t % 2 of the row's bytes (first and last byte: the
    // block need not be line-aligned)
    auto fetch_bias = [&](int batch, int head, int m0, int n0, bool L1) {
        const char* plane = bias_plane(batch, head);
        const int r = min(m0 + t / 2, p.s_q - 1);
        const int k_lo = min(n0 + cw * 64 + (t % 2) * 32, p.s_k - 1);
        const int k_hi = min(n0 + cw * 64 + (t % 2) * 32 + 31, p.s_k - 1);
        const char* row = plane + (i64)r * p.bias_stride_q * BIAS_BYTES;
        if (L1) {
            asm volatile("prefetch.global.L1 [%0];" :: "l"(row + (i64)k_lo * BIAS_BYTES));
            asm volatile("prefetch.global.L1 [%0];" :: "l"(row + (i64)k_hi * BIAS_BYTES));
        } else {
            asm volatile("prefetch.global.L2 [%0];" :: "l"(row + (i64)k_lo * BIAS_BYTES));
            asm volatile("prefetch.global.L2 [%0];" :: "l"(row + (i64)k_hi * BIAS_BYTES));
        }
    };
    int q_it = 0, kv_it = 0;          // Q/dO steps and K/V tiles consumed so far (ring positions)
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const KeyTile wt = key_tile<BN, BM, WINDOW, VARLEN, BIAS, DET>(p, w);
        const int n0 = wt.n0;
        const int key0 = n0 + cw * 64 + row_in_wg;         // this lane's keys: key0, key0 + 8
        // VARLEN's mask values, kept in shared memory (hd 128 has no registers to spare): nk =
        // s_k − n0 (keys of the tile in the sequence) and nrel = n0 − diag. Only tiles with steps
        // read them; one thread writes them after the DS_BAR of the last tile's last step (every
        // read of the old values is before it), and the DS_BAR after the write publishes them.
        if (VARLEN && wt.steps > 0) {
            if (cw == 0 && t == 0) {
                seq_smem[0] = wt.s_k - n0;
                seq_smem[1] = n0 - wt.diag;
            }
            named_bar_sync(DS_BAR, 256);
        }
        const int kb = kv_it % KVBUF;
        const u32 k_tile = k_smem + kb * L::KV_TILE, v_tile = v_smem + kb * L::KV_TILE;   // [BN, D]
        const u32 k_wg = k_tile + cw * 64 * 128, v_wg = v_tile + cw * 64 * 128;   // this consumer's 64 keys

#pragma unroll
        for (int i = 0; i < NKV; ++i) dk_acc[i] = dv_acc[i] = 0.f;
        if (wt.steps > 0) mbar_wait(kv_full + 8 * kb, (kv_it / KVBUF) & 1);   // K, V of the tile landed

        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int m0 = step_m0<BM, DET>(p, wt, st);
            const int s = q_it % NBUF;
            const u32 q_tile = q_smem + s * L::Q_TILE, do_tile = do_smem + s * L::Q_TILE;
            const float* lse_smem = rows_smem + s * 2 * BM;   // [BM] lse·log2 e of the step
            const float* dsum_smem = lse_smem + BM;           // [BM] D of the step
            const int head = step_head<DET>(p, wt, st);
            if constexpr (BIAS_LD) {   // bias blocks: this step's into L1 (loaded after Sᵀ),
                                       // the next step's into L2
                fetch_bias(wt.batch, head, m0, n0, true);
                if (st + 1 < wt.steps) fetch_bias(wt.batch, step_head(p, wt, st + 1), step_m0<BM>(p, wt, st + 1), n0, false);
            }

            // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ  [64 keys, BM], fp32: two groups, so Pᵀ can start
            //      as soon as Sᵀ is done
            float s_acc[NS], dp_acc[NS];
            mbar_wait(qdo_full + 8 * s, (q_it / NBUF) & 1);   // Q, dO, lse, D of the step landed
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (kk % 4) * 32;    // 16 columns = 32 bytes within a 128-byte panel row
                wgmma_ss<E, BM>(s_acc, desc_add(k_desc, k_wg - k_smem + (kk / 4) * L::KV_PANEL + off),
                                desc_add(q_desc, q_tile - q_smem + (kk / 4) * L::Q_PANEL + off), kk > 0);
            }
            wgmma_commit();
            // dPᵀ = V dOᵀ: issued right behind Sᵀ (Pᵀ overlaps it), or after Pᵀ (a bias at d = 128:
            // dK, dV, Sᵀ, dPᵀ in flight and the bias leave too few registers; BIAS_TMA spills
            // 8-40 B with dPᵀ early: tuning builds may pass -DBIAS_TMA_DP_EARLY=1 to compare)
#ifndef BIAS_TMA_DP_EARLY
#define BIAS_TMA_DP_EARLY 0
#endif
            constexpr bool DP_EARLY = BIAS == BIAS_NONE || D == 64 || (BIAS == BIAS_TMA && BIAS_TMA_DP_EARLY);
            auto issue_dp = [&]() {
                if (!DP_EARLY || BIAS_LD) wgmma_fence();   // (else: in the same fence as Sᵀ)
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    const u32 off = (kk % 4) * 32;
                    wgmma_ss<E, BM>(dp_acc, desc_add(v_desc, v_wg - v_smem + (kk / 4) * L::KV_PANEL + off),
                                    desc_add(do_desc, do_tile - do_smem + (kk / 4) * L::Q_PANEL + off), kk > 0);
                }
                wgmma_commit();
            };
            if constexpr (DP_EARLY) {
                issue_dp();
                wgmma_wait<1>();                  // Sᵀ done (dPᵀ may still run)
            } else {
                wgmma_wait<0>();                  // Sᵀ done
            }
            fence_regs<NS>(s_acc);

            // ---- Pᵀ = exp2(Sᵀ·scale·log2 e (+ bias·log2 e) − lse·log2 e), masked, in place in
            //      s_acc (fp32)
            // VARLEN in two per-tile values: nk = s_k − n0 (keys of the tile in the sequence; the
            // next sequence's are masked too) and nrel = n0 − diag (key − diag(row) = nrel +
            // (key − n0) − row)
            const int nk = VARLEN ? seq_smem[0] : 0, nrel = VARLEN && WINDOW ? seq_smem[1] : 0;
            bool need_mask = VARLEN ? nk < BN : n0 + BN > p.s_k;
            if (WINDOW)
                need_mask |= VARLEN ? nrel + BN - 1 > m0 + p.window_right || nrel < m0 + BM - 1 - p.window_left
                                    : n0 + BN - 1 > m0 + p.diag_offset + p.window_right ||
                                      n0 < m0 + BM - 1 + p.diag_offset - p.window_left;
            if constexpr (BIAS == 0) {
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    const int col = (i / 4) * 8 + col_in_8 + (i % 2);   // query row m0 + col
                    const int key = key0 + ((i % 4) >= 2 ? 8 : 0);
                    float pe = fast_exp2(s_acc[i] * p.scale_log2 - lse_smem[col]);
                    if (need_mask) {
                        bool keep;
                        if constexpr (VARLEN) {
                            const int kt = key - n0, rel = nrel + kt - m0 - col;   // key − diag(row)
                            keep = kt < nk;
                            if (WINDOW) keep = keep && rel <= p.window_right && rel >= -p.window_left;
                        } else {
                            const int diag = m0 + col + p.diag_offset;
                            keep = key < p.s_k;
                            if (WINDOW) keep = keep && key <= diag + p.window_right && key >= diag - p.window_left;
                        }
                        if (!keep) pe = 0.f;
                    }
                    s_acc[i] = pe;
                }
            } else {
                // BIAS_LD: the bias [query m0 + col, key] read per pair of queries (clamped into the
                // plane: those P are masked or 0)
                // bias rows m0 + col_in_8 (+ 8 per i / 4, + 1 per i % 2) at keys key0, key0 + 8 (keys
                // clamped into the row; rows past s_q not read: their P is 0 anyway, lse = +inf)
                const char* brow = nullptr;
                i64 b_sq = 0;            // bytes between bias rows
                int b_k8 = 0;            // bytes from key key0 to key0 + 8 (clamped)
                if constexpr (BIAS_LD) {
                    const int k_a = min(key0, p.s_k - 1), k_b = min(key0 + 8, p.s_k - 1);
                    b_sq = p.bias_stride_q * BIAS_BYTES;
                    b_k8 = (k_b - k_a) * BIAS_BYTES;
                    brow = bias_plane(wt.batch, head) + (i64)(m0 + col_in_8) * b_sq + (i64)k_a * BIAS_BYTES;
                }
                // BIAS_TMA: this consumer's panel bias_smem [BM queries, 64 keys] of the stage. One
                // ldmatrix.x4.trans gives a lane the pairs (queries col, col + 1; one key) of 16
                // queries x 16 keys: matrix mt = lane / 8 holds queries 8·(mt / 2) .. + 7 of the 16
                // (rows: lane % 8 gives their addresses) and the warp's keys 8·(mt % 2) .. + 7 (a
                // 16-byte chunk, swizzled: chunk XOR row mod 8); transposed, lane l receives key
                // l / 4 of queries 2(l % 4), + 1: exactly s_acc's pairs (i = 8g + 2·mt)
                const int lane = t % 32, mt = lane / 8;
                const unsigned char* bias_rows = smem_gen + L::BIAS + s * L::BIAS_TILE + cw * L::BIAS_PANEL +
                                                 (8 * (mt / 2) + lane % 8) * 128 +
                                                 (((2 * (t / 32) + mt % 2) ^ (lane % 8)) << 4);
                u32 bias_pairs[4];
#pragma unroll
                for (int i = 0; i < NS; i += 2) {
                    const int col = (i / 4) * 8 + col_in_8;             // query rows m0 + col, + 1
                    const int key = key0 + ((i % 4) >= 2 ? 8 : 0);
                    const float2 l2 = *(const float2*)(lse_smem + col);
                    float x0 = s_acc[i] * p.scale_log2, x1 = s_acc[i + 1] * p.scale_log2;
                    if constexpr (BIAS_LD) {
                        const char* r0 = brow + ((i % 4) >= 2 ? b_k8 : 0);
                        const char* r1 = r0 + b_sq;
                        float b0 = 0.f, b1 = 0.f;
                        if (m0 + col < p.s_q) {
                            if constexpr (BIAS == 1) b0 = to_float<E>(*(const S*)r0);
                            else b0 = *(const float*)r0;
                        }
                        if (m0 + col + 1 < p.s_q) {
                            if constexpr (BIAS == 1) b1 = to_float<E>(*(const S*)r1);
                            else b1 = *(const float*)r1;
                        }
                        x0 = fmaf(b0, CF_LOG2E, x0);
                        x1 = fmaf(b1, CF_LOG2E, x1);
                        if (i % 4 == 2) brow += 8 * b_sq;                // next 8 query rows
                    } else {   // BIAS_TMA: queries 16g .. 16g + 15 of the step per ldmatrix
                        if (i % 8 == 0) ldmatrix_x4_trans(bias_pairs, bias_rows + (i / 8) * 16 * 128);
                        const u32 pr = bias_pairs[(i % 8) / 2];   // query col in the low half
                        x0 = fmaf(to_float<E>((S)(pr & 0xffffu)), CF_LOG2E, x0);
                        x1 = fmaf(to_float<E>((S)(pr >> 16)), CF_LOG2E, x1);
                    }
                    float pe0 = fast_exp2(x0 - l2.x), pe1 = fast_exp2(x1 - l2.y);
                    if (need_mask) {
                        const int diag = m0 + col + p.diag_offset;
                        bool keep0 = key < p.s_k, keep1 = keep0;
                        if (WINDOW) {
                            keep0 = keep0 && key <= diag + p.window_right && key >= diag - p.window_left;
                            keep1 = keep1 && key <= diag + 1 + p.window_right && key >= diag + 1 - p.window_left;
                        }
                        if (!keep0) pe0 = 0.f;
                        if (!keep1) pe1 = 0.f;
                    }
                    s_acc[i] = pe0;
                    s_acc[i + 1] = pe1;
                }
            }

            if constexpr (!DP_EARLY) issue_dp();
            // ---- dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale; Pᵀ, dSᵀ packed to 16-bit pairs (wgmma A fragments)
            wgmma_wait<0>();                      // dPᵀ done
            fence_regs<NS>(dp_acc);
            u32 p_frag[NS / 2], ds_frag[NS / 2];
#pragma unroll
            for (int i = 0; i < NS; i += 2) {
                const int col = (i / 4) * 8 + col_in_8;
                p_frag[i / 2] = pack2<E>(s_acc[i], s_acc[i + 1]);
                if constexpr (BIAS != 0) {   // dp_acc keeps dSᵀ without the scale: dbias
                    dp_acc[i] = s_acc[i] * (dp_acc[i] - dsum_smem[col]);
                    dp_acc[i + 1] = s_acc[i + 1] * (dp_acc[i + 1] - dsum_smem[col + 1]);
                    ds_frag[i / 2] = pack2<E>(dp_acc[i] * p.scale, dp_acc[i + 1] * p.scale);
                } else {
                    ds_frag[i / 2] = pack2<E>(s_acc[i] * (dp_acc[i] - dsum_smem[col]) * p.scale,
                                              s_acc[i + 1] * (dp_acc[i + 1] - dsum_smem[col + 1]) * p.scale);
                }
            }

            // ---- dSᵀ rows of this consumer -> dsT_smem [BN keys, BM queries] (128-byte swizzle:
            //      16-byte chunk index XOR row mod 8), the A operand of dQ = dS K
            const u32 ds_tile = ds_smem + (q_it & 1) * L::DS_TILE;   // two buffers: see the barrier below
#pragma unroll
            for (int i = 0; i < NS; i += 2) {
                const int r = cw * 64 + row_in_wg + ((i % 4) >= 2 ? 8 : 0);
                const u32 addr = ds_tile + r * 128 + ((((i / 4)) ^ (r & 7)) << 4) + 4 * (t % 4);
                asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(ds_frag[i / 2]) : "memory");
            }
            fence_proxy_async();   // before the wgmma below, which reads shared memory too
            // ---- dV += Pᵀ dO, dK += dSᵀ Q  [64 keys, D]: dO, Q read MN-major (k-step = 16 rows)
            fence_regs<NKV>(dv_acc);
            fence_regs<NKV>(dk_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_rs<E, D>(dv_acc, p_frag + 4 * kk, desc_add(do_desc_mn, do_tile - do_smem + kk * 2048));
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_rs<E, D>(dk_acc, ds_frag + 4 * kk, desc_add(q_desc_mn, q_tile - q_smem + kk * 2048));
            wgmma_commit();

            // Both consumers' dSᵀ rows are written (and, two steps back, the other buffer's dQ
            // product has completed in both: each passed this barrier one step ago after it).
            named_bar_sync(DS_BAR, 256);
            wgmma_wait<0>();                      // dV, dK done: p_frag, ds_frag free
            fence_regs<NKV>(dv_acc);
            fence_regs<NKV>(dk_acc);
            // Q, dO, lse, D of stage s no longer needed here. Every thread arrives after its own
            // reads of lse / D: ROWS_WARP overwrites them once qdo_empty completes, and racecheck
            // orders a write after a read only through the reading thread's own arrival
            mbar_arrive(qdo_empty + 8 * s);

            // ---- dbias (+)= dSᵀ transposed to [query, key] (after dV, dK: registers)
            if constexpr (BIAS != 0) {
                if (p.dbias_accum) {
                    // [s_q', s_k'] float32 plane of (batch, head) (0-stride dimensions summed)
                    float* db = p.dbias_accum + wt.batch * p.dbias_stride_b + head * p.dbias_stride_h;
                    if (p.dbias_mode & DBIAS_ROWS) {
                        // bias broadcast over queries: one sum per key over the step's queries
                        // (0 past s_q: P = 0), the quad's 4 lanes hold the key's other queries
                        float sk[2] = {0.f, 0.f};
#pragma unroll
                        for (int i = 0; i < NS; ++i) sk[(i % 4) / 2] += dp_acc[i];
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const float v = quad_sum(sk[r]);
                            if (t % 4 == 0 && key0 + 8 * r < p.s_k) red_add_f32(db + key0 + 8 * r, v);
                        }
                    } else {
                        // keys in pairs (key, key + 1) from lanes t, t ^ 4 (one shuffle per pair):
                        // the lane of an even key writes query col, the odd one query col + 1;
                        // s_k and the accumulator's row stride are even (launcher), so the pair
                        // is 8-byte aligned and both keys are in range or neither
                        const int odd = (row_in_wg & 1);
                        const bool store = p.dbias_mode & DBIAS_STORE;
#pragma unroll
                        for (int i = 0; i < NS; i += 2) {
                            const float a = dp_acc[i], b = dp_acc[i + 1];   // queries col, col + 1
                            const float got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 4);
                            const int q = m0 + (i / 4) * 8 + col_in_8 + odd;
                            const int k = key0 + ((i % 4) >= 2 ? 8 : 0) - odd;
                            if (q < p.s_q && k < p.s_k) {
                                float* dst = db + (i64)q * p.dbias_stride_q + k;
                                const float x = odd ? got : a, y = odd ? b : got;
                                if (store)
                                    asm volatile("st.global.v2.f32 [%0], {%1, %2};" :: "l"(dst), "f"(x), "f"(y) : "memory");
                                else
                                    red_add_v2(dst, x, y);
                            }
                        }
                    }
                }
            }


            // ---- dQ[BM, 64 columns from 64·cw] = dS K over the tile's 128 keys; both operands
            //      MN-major: dsT_smem (LBO unused: BM = one panel), K (LBO = bytes between panels)
            float dq_acc[NQ];
            if (dq_cols) {
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk)
                    wgmma_ss_tt<E, PANEL_COLS>(dq_acc, desc_add(ds_desc, ds_tile - ds_smem + kk * 2048),
                                               desc_add(k_desc_mn, k_tile - k_smem + cw * L::KV_PANEL + kk * 2048),
                                               kk > 0);
                wgmma_commit();
                wgmma_wait<0>();
            }

            // ---- dQ slice (rows row_in_wg, +8; chunk-swizzled columns) -> the accumulator
            // The sequence's accumulator rows [s_q, D] (dq_rows); their chunk swizzle is by the row's
            // index in the (batch, head) slab: varlen rows start at q_row, so the tile's rows are
            // offset by sw = q_row mod 8.
            if (dq_cols && DQ_BULK) {
                // via dq_smem [BM][D]; DQ_WARP adds the whole tile
                fence_regs<NQ>(dq_acc);
                if (q_it > 0) mbar_wait(dq_empty, (q_it - 1) & 1);   // last step's tile was read out
                const int sw = VARLEN ? ld_seq(p.cu_seqlens_q + wt.batch) & 7 : 0;
                if (cw == 0 && t == 0) {                             // where DQ_WARP adds it
                    int s_q;
                    float* dq_bh = dq_rows<VARLEN, D>(p, wt, head, &s_q);
                    job_smem[0] = (u64)(dq_bh + (i64)m0 * D);
                    job_smem[1] = (u64)(min(BM, s_q - m0) * D * 4);   // this sequence's rows only
                    if constexpr (DET) {   // after the earlier key tiles' additions (bwd_parts.cuh)
                        const int diag = VARLEN ? n0 - seq_smem[1] : p.diag_offset;
                        const int s_k = VARLEN ? n0 + seq_smem[0] : p.s_k;
                        job_smem[2] = (u64)dq_sem<VARLEN, BM>(p, wt, head, m0);
                        job_smem[3] = (u64)dq_rank<WINDOW, BM, BN>(p, n0, s_q, s_k, diag, m0);
                    }
                }
#pragma unroll
                for (int i = 0; i < NQ; i += 4) {
                    const int col = cw * PANEL_COLS + (i / 4) * 8 + col_in_8;
                    const int r0 = row_in_wg, r1 = row_in_wg + 8;     // r1 mod 8 = r0 mod 8
                    const u32 addr0 = dq_smem + r0 * L::DQ_PITCH + 4 * dq_swizzle(r0 + sw, col);
                    const u32 addr1 = dq_smem + r1 * L::DQ_PITCH + 4 * dq_swizzle(r1 + sw, col);
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr0), "f"(dq_acc[i]), "f"(dq_acc[i + 1]) : "memory");
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr1), "f"(dq_acc[i + 2]), "f"(dq_acc[i + 3]) : "memory");
                }
                fence_proxy_async();              // generic stores -> visible to the bulk reduce
                mbar_arrive(dq_full);
            } else if (dq_cols) {
                // straight from registers (m0 is a multiple of 8: row mod 8 = row_in_wg mod 8)
                fence_regs<NQ>(dq_acc);
                int s_q;
                float* dq_bh = dq_rows<VARLEN, D>(p, wt, head, &s_q);
                const int sw = VARLEN ? ld_seq(p.cu_seqlens_q + wt.batch) & 7 : 0;
                const int r0 = m0 + row_in_wg;
#pragma unroll
                for (int i = 0; i < NQ; i += 4) {
                    const int col = cw * PANEL_COLS + (i / 4) * 8 + col_in_8;
                    if (r0 < s_q) red_add_v2(dq_bh + (i64)r0 * D + dq_swizzle(r0 + sw, col), dq_acc[i], dq_acc[i + 1]);
                    if (r0 + 8 < s_q)
                        red_add_v2(dq_bh + (i64)(r0 + 8) * D + dq_swizzle(r0 + 8 + sw, col), dq_acc[i + 2], dq_acc[i + 3]);
                }
            }
        }
        if (wt.steps > 0) {
            // this consumer's last reads of K (dQ product) and V (dPᵀ) have completed (waited above)
            if (t == 0) mbar_arrive(kv_empty + 8 * kb);
            ++kv_it;
        }

        // ---- dK, dV of this consumer's 64 keys (GQA: already summed over the group's query
        //      heads; zeros for a tile that no query sees); the next tile's loads are in flight
        const int k_row = VARLEN ? ld_seq(p.cu_seqlens_k + wt.batch) : 0;   // packed row of key 0
        const int s_k = VARLEN ? ld_seq(p.cu_seqlens_k + wt.batch + 1) - k_row : p.s_k;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 8 * r;
            if (key < s_k) {   // varlen: never a row of the next sequence
                const i64 row = k_row + key;
                S* dk_row = (S*)p.dk + wt.tma_b * p.dk_stride_b + row * p.dk_stride_s + wt.kv_head * p.dk_stride_h;
                S* dv_row = (S*)p.dv + wt.tma_b * p.dv_stride_b + row * p.dv_stride_s + wt.kv_head * p.dv_stride_h;
#pragma unroll
                for (int i = 0; i < NKV; i += 4) {
                    const int col = (i / 4) * 8 + col_in_8;
                    *(u32*)(dk_row + col) = pack2<E>(dk_acc[i + 2 * r], dk_acc[i + 2 * r + 1]);
                    *(u32*)(dv_row + col) = pack2<E>(dv_acc[i + 2 * r], dv_acc[i + 2 * r + 1]);
                }
            }
        }
    }

    // ---- no work left: stop DQ_WARP (after it has read out the last tile)
    if (DQ_BULK && dq_cols) {
        if (q_it > 0) mbar_wait(dq_empty, (q_it - 1) & 1);
        if (cw == 0 && t == 0) job_smem[0] = 0;
        mbar_arrive(dq_full);
    }
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
