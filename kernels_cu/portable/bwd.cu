// cupyflash backward kernels, sm_80+ (mma.sync), FlashAttention-2 order.
//
//   given O, lse from the forward and dO:
//   D  = rowsum(dO ∘ O)                                   flash_bwd_pre (also zeroes the dQ accumulator)
//   per key tile (flash_bwd), over every query tile that can see it:
//     S  = Q Kᵀ,  P = exp(score(S) − lse)                 recomputed, never stored
//     dV += Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − D) · ds/dS_raw
//     dK += dSᵀ Q,  dQ += dS K  (float32, red.global.add; or, deterministic, added in program
//                               order into the slab of the block, which takes key tiles x, x + G, ...)
//   dq = dtype(dQ accumulator)                            flash_bwd_dq (sums the G slabs in order)
//   dbias tile = Σ over its broadcast pairs of dS         flash_bwd_dbias (when flash_bwd writes none:
//                                                         recomputes S, dP; sums in registers)
//
// Two main kernels (cupyflash/gpu/plan_bwd.py picks): flash_bwd_2d (16-bit types, head dims up to
// 128, no bias / mask / varlen: FlashAttention-2's 2-D warp tiles, described at its definition
// below) and flash_bwd (every other call), described here.
//
// flash_bwd works on the TRANSPOSED scores: warp w owns 16 keys and computes Sᵀ = K Qᵀ and
// dPᵀ = V dOᵀ for them ([16 keys, BM queries] in the m16n8 accumulator layout). Pᵀ and dSᵀ are
// then already the A operands of dV += Pᵀ dO and dK += dSᵀ Q (registers, no shared memory), and
// dK, dV stay in registers for the whole block. Only dS goes through shared memory, for
// dQ = dS K, where the warps are laid out over query rows instead.
//
// Template arguments (cupyflash/gpu/plan_bwd.py enumerates the instantiated set):
//   E         f16_t | bf16_t | f32x3_t (float32, 3xTF32) | tf32_t (float32, plain TF32) |
//             f64_t (float64: DMMA products; accumulators, lse, D, dQ / dbias sums in double)
//   D         head-dim bucket (multiple of 32) covering d and d_v; padding zero-filled, never stored
//   BM        query rows per step;  NW  warps;  WD  warps sharing one 16-key slab, each owning
//             D / WD columns of dK, dV (large D: Sᵀ and dPᵀ computed WD times, registers bounded)
//             -> BN = 16 · NW / WD keys per block
//   NBUF      1 | 2 shared-memory buffers for the Q / dO / lse / D tile (2: next tile prefetched
//             during the whole step; 1: during the dQ product only)
//   WINDOW    causal or sliding window: only the query tiles that see the key tile; edges masked
//   SCORE_MOD softcap and/or ALiBi
//   GENERAL   bias (+ dbias), boolean mask, varlen; each on when its Params pointer is set; only
//             instantiated with WINDOW and SCORE_MOD (docs/backward.md, "bias, mask, varlen")
#include "common/bwd_pre_dq.cuh"
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/score.cuh"
#include "common/types.cuh"
#include "portable/bwd_parts.cuh"

// ---------------------------------------------------------------------------------------------
// One key tile n_block of (kv head blockIdx.y, batch blockIdx.z): loops over the query heads of
// the group and the query tiles that see the key tile; dK, dV in registers throughout.
// ---------------------------------------------------------------------------------------------
template <typename E, int D, int BM, int NW, int WD, int NBUF, bool WINDOW, bool SCORE_MOD,
          bool GENERAL>
__device__ __forceinline__ void flash_bwd_key_tile(const Params& p, const int n_block) {
    typedef typename Elem<E>::storage S;
    typedef Acc<E> A;                             // float, or double for float64
    constexpr int NT = NW * 32;
    constexpr int BN = 16 * NW / WD;              // keys per block
    constexpr int DW = D / WD;                    // dK / dV columns per warp
    constexpr int WMQ = BM / 16;                  // dQ phase: warps over query rows ...
    constexpr int WNQ = NW / WMQ;                 // ... times warps over columns
    constexpr int DQW = D / WNQ;                  // dQ columns per warp
    constexpr int CG = Elem<E>::is16 ? 16 : 8;    // column granularity of the B-operand loads
    static_assert(NW % WD == 0 && BN % 16 == 0, "NW must be a multiple of WD");
    static_assert(BM % 16 == 0 && NW % WMQ == 0, "BM / 16 must divide NW");
    static_assert(DW % CG == 0 && DQW % CG == 0, "column split must keep whole fragments");
    static_assert(NBUF == 1 || NBUF == 2, "one or two Q / dO buffers");
    static_assert(!GENERAL || (WINDOW && SCORE_MOD), "GENERAL runs on the window and score-mod paths");
    constexpr int PR = BwdPitch<E, D>::ROW, PDS = DsPitch<E, BM>::ROW;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    S* k_smem = (S*)smem_raw;                     // [BN, PR]
    S* v_smem = k_smem + BN * PR;                 // [BN, PR]
    S* q_smem = v_smem + BN * PR;                 // [NBUF][BM, PR]
    S* do_smem = q_smem + NBUF * BM * PR;         // [NBUF][BM, PR]
    S* dst_smem = do_smem + NBUF * BM * PR;       // [BN, PDS]  dSᵀ (keys x queries)
    A* lse2_smem = (A*)(dst_smem + BN * PDS);     // [NBUF][BM]  lse·log2(e); +inf: row contributes nothing
    A* dsum_smem = lse2_smem + NBUF * BM;         // [NBUF][BM]  D

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;        // accumulator row / column pair of this lane
    const int head_k = blockIdx.y, batch = blockIdx.z;
    const int n0 = n_block * BN;

    // This block's sequence: batch entry `batch`, or (varlen) packed rows cu_seqlens[batch]..
    // [batch + 1] (batch strides are 0 then; lse, D and the dQ accumulator are [1, h, total_q])
    int s_q = p.s_q, s_k = p.s_k, diag_offset = p.diag_offset;
    i64 q_tok0 = 0, k_tok0 = 0;                   // first packed row of the sequence
    int lse_b = batch;                            // batch index into the [b, h, s_q] row arrays
    if (GENERAL && p.cu_seqlens_q) {
        const int q_beg = p.cu_seqlens_q[batch], k_beg = p.cu_seqlens_k[batch];
        s_q = p.cu_seqlens_q[batch + 1] - q_beg;
        s_k = p.cu_seqlens_k[batch + 1] - k_beg;
        q_tok0 = q_beg; k_tok0 = k_beg; lse_b = 0;
        diag_offset = p.varlen_bottom_right ? s_k - s_q : 0;
        if (n0 >= s_k) return;                    // key tile past this sequence (whole block, before any barrier)
    }
    const int n_rows = min(BN, s_k - n0);
    const int key0 = (warp / WD) * 16;            // this warp's 16 keys (tile rows)
    const int col0 = (warp % WD) * DW;            // this warp's dK / dV columns
    const int qrow0 = (warp % WMQ) * 16;          // dQ phase: this warp's 16 query rows
    const int qcol0 = (warp / WMQ) * DQW;         //           and columns
    const A scale = scale_of<A>(p);

    const S* k_gmem = (const S*)p.k + batch * p.k_stride_b + head_k * p.k_stride_h + (k_tok0 + n0) * p.k_stride_s;  // [n_rows, d]
    const S* v_gmem = (const S*)p.v + batch * p.v_stride_b + head_k * p.v_stride_h + (k_tok0 + n0) * p.v_stride_s;  // [n_rows, d_v]

    const QuerySteps<BM, WINDOW> steps(p, s_q, n0, n_rows, diag_offset);
    const int total = steps.total;                                  // steps: (group head, query tile)

    // Issue the loads of step `it` into buffer `buf`: Q, dO tiles (cp.async), lse·log2(e) and D.
    auto load_step = [&](int it, int buf) {
        const int head = steps.head(p, head_k, it), m0 = steps.m0(it);
        const int m_rows = min(BM, s_q - m0);
        const S* q_gmem = (const S*)p.q + batch * p.q_stride_b + head * p.q_stride_h + (q_tok0 + m0) * p.q_stride_s;          // [m_rows, d]
        const S* do_gmem = (const S*)p.dout + batch * p.do_stride_b + head * p.do_stride_h + (q_tok0 + m0) * p.do_stride_s;  // [m_rows, d_v]
        copy_chunks<BM, D, PR, NT>(q_smem + buf * BM * PR, q_gmem, p.q_stride_s, m_rows, p.d, p.vec_ok, p.q, tid);
        copy_chunks<BM, D, PR, NT>(do_smem + buf * BM * PR, do_gmem, p.do_stride_s, m_rows, p.d_v, p.vec_ok, p.dout, tid);
        const i64 row0 = ((i64)lse_b * p.h + head) * p.s_q + q_tok0 + m0;   // [b, h, s_q] index of row m0
        load_row_stats<BM, NT>(lse2_smem + buf * BM, dsum_smem + buf * BM, p, row0, m_rows, tid);
    };

    A dk_frag[DW / 8][4], dv_frag[DW / 8][4];       // dK, dV [16 keys, DW] of this warp
#pragma unroll
    for (int j = 0; j < DW / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_frag[j][e] = dv_frag[j][e] = A(0);

    // dbias: this block's plane of the Acc<E> accumulator (its slab in deterministic mode), or
    // null. Only the warps owning column 0 write (with WD > 1 the others recompute the same dS).
    A* dbias_gmem = nullptr;                      // [s_q', s_k'] at (batch, head 0) with dbias strides
    if (GENERAL && p.dbias_accum && col0 == 0) {
        const bool by_b = p.dbias_mode & DBIAS_SLAB_B, by_h = p.dbias_mode & DBIAS_SLAB_H;
        const i64 slab = (i64)(by_b ? batch : 0) * (by_h ? p.h_k : 1) + (by_h ? head_k : 0);
        dbias_gmem = (A*)p.dbias_accum + slab * p.dbias_slab + batch * p.dbias_stride_b;
    }

    if (total > 0) {
        // K, V tiles (kept for the whole block) and the first Q / dO tile in flight
        copy_chunks<BN, D, PR, NT>(k_smem, k_gmem, p.k_stride_s, n_rows, p.d, p.vec_ok, p.k, tid);
        copy_chunks<BN, D, PR, NT>(v_smem, v_gmem, p.v_stride_s, n_rows, p.d_v, p.vec_ok, p.v, tid);
        load_step(0, 0);
        cp_async_commit();
    }
    for (int it = 0; it < total; ++it) {
        const int buf = NBUF == 2 ? (it & 1) : 0;
        const int head = steps.head(p, head_k, it), m0 = steps.m0(it);
        cp_async_wait<0>();
        __syncthreads();   // step it's tiles landed for all threads; every warp is done with the other buffer and with dSᵀ
        if (NBUF == 2 && it + 1 < total) load_step(it + 1, buf ^ 1);
        cp_async_commit();
        const S* qb_smem = q_smem + buf * BM * PR;      // [BM, PR]
        const S* dob_smem = do_smem + buf * BM * PR;    // [BM, PR]
        const A* lse2b = lse2_smem + buf * BM;          // [BM]
        const A* dsumb = dsum_smem + buf * BM;          // [BM]

        // dPᵀ = V dOᵀ, Sᵀ = K Qᵀ   [16 keys, BM queries]
        A dp_frag[BM / 8][4], s_frag[BM / 8][4];
        bwd_s_dp<E, D, BM, PR>(dp_frag, s_frag, p, k_smem, v_smem, qb_smem, dob_smem, key0, lane);

        // P = exp(score(S) − lse) (masked: 0), dS = P ∘ (dP − D) · ds/dS_raw, in place:
        // s_frag becomes Pᵀ, dp_frag becomes dSᵀ
        A slope_log2 = A(0);
        if (SCORE_MOD) slope_log2 = alibi_slope_log2<A>(p, batch, head);
        // bias / mask planes [s_q, s_k] of this (batch, head), dbias plane (null: off)
        const char* bias_step = nullptr;
        const unsigned char* mask_step = nullptr;
        A* dbias_step = nullptr;
        if (GENERAL && p.bias)
            bias_step = (const char*)p.bias + (batch * p.bias_stride_b + head * p.bias_stride_h) * (p.bias_f32 ? 4 : (i64)sizeof(S));
        if (GENERAL && p.mask) mask_step = p.mask + batch * p.mask_stride_b + head * p.mask_stride_h;
        if (GENERAL && dbias_gmem) dbias_step = dbias_gmem + head * p.dbias_stride_h;
        const bool dbias_rows = GENERAL && (p.dbias_mode & DBIAS_ROWS);
        const bool dbias_atomic = GENERAL && (p.dbias_mode & DBIAS_ATOMIC);
        A dbias_key[2] = {A(0), A(0)};            // DBIAS_ROWS: this lane's dS sums for keys g, g + 8
        const bool need_mask = (n0 + BN > s_k) || (GENERAL && mask_step) ||
            (WINDOW && (n0 + BN - 1 > m0 + diag_offset + p.window_right ||
                        n0 < m0 + BM - 1 + diag_offset - p.window_left));
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
            typedef typename Vec2<A>::type A2;
            const A2 l2 = *(const A2*)(lse2b + j * 8 + 2 * t);            // queries j*8 + 2t, +1
            const A2 dd = *(const A2*)(dsumb + j * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + key0 + g + (e >> 1) * 8;
                const int row = m0 + j * 8 + 2 * t + (e & 1);
                A ds_dqk;
                const A s = bwd_score<E, WINDOW, SCORE_MOD, GENERAL>(
                    s_frag[j][e], p, slope_log2, row, key, s_q, s_k, diag_offset, scale, bias_step,
                    mask_step, need_mask, &ds_dqk);
                const A pr = exp2_acc(s - ((e & 1) ? l2.y : l2.x));
                s_frag[j][e] = pr;
                // dS in natural units before the chain rule through softcap / scale: dbias
                const A ds = pr * (dp_frag[j][e] - ((e & 1) ? dd.y : dd.x));
                dp_frag[j][e] = ds * ds_dqk;
                if (GENERAL && dbias_step) {
                    if (dbias_rows) {
                        dbias_key[e >> 1] += ds;   // summed over this lane's rows (0 past s_q: P = 0)
                    } else if (row < s_q && key < s_k) {   // one owner lane per element in this block
                        A* dst = dbias_step + (i64)row * p.dbias_stride_q + (i64)key * p.dbias_stride_k;
                        if (dbias_atomic) red_add(dst, ds); else *dst += ds;
                    }
                }
            }
        }
        if (GENERAL && dbias_step && dbias_rows) {   // bias broadcast over rows: one sum per key
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const A v = quad_sum(dbias_key[half]);       // the 4 lanes of a key hold its row pairs
                const int key = n0 + key0 + g + half * 8;
                if (t == 0 && key < s_k) {
                    A* dst = dbias_step + (i64)key * p.dbias_stride_k;
                    if (dbias_atomic) red_add(dst, v); else *dst += v;
                }
            }
        }

        // dV += Pᵀ dO, dK += dSᵀ Q   [16 keys, DW]; dSᵀ to shared memory [BN keys, BM queries]
        bwd_dkdv_dst<E, BM, DW, PR, PDS>(dv_frag, dk_frag, s_frag, dp_frag, p, dst_smem, qb_smem, dob_smem, key0, col0, lane, g, t);
        __syncthreads();   // dSᵀ complete (dQ reads every key's row); Q / dO no longer read this step
        if (NBUF == 1 && it + 1 < total) load_step(it + 1, 0);
        cp_async_commit();

        // dQ[m tile] += dS K   [16 queries, DQW] per warp, into the Acc<E> accumulator in global memory
        bwd_add_dq<E, BN, DQW, PDS, PR>(p, dst_smem, k_smem, qrow0, qcol0, lane, g, t, lse_b, head, q_tok0, m0, s_q);
    }

    // dK, dV [16 keys, DW] of this warp to global memory in E
    bwd_store_dkdv<E, DW>(p, dk_frag, dv_frag, batch, head_k, k_tok0, n0, key0, col0, g, t, s_k);
}

// ---------------------------------------------------------------------------------------------
// Main kernel, grid (key tiles or G, kv heads, batch): block x takes key tile x, or, when
// deterministic (gridDim.x = G = p.dq_slabs <= p.num_n_blocks), key tiles x, x + G, ... in order,
// adding their dQ parts into slab x: G slabs of dQ, not one per key tile (memory stays O(N)).
// ---------------------------------------------------------------------------------------------
template <typename E, int D, int BM, int NW, int WD, int NBUF, bool WINDOW, bool SCORE_MOD,
          bool GENERAL = false>
__global__ void __launch_bounds__(NW * 32)
flash_bwd(const Params p) {
    for (int n_block = blockIdx.x; n_block < p.num_n_blocks; n_block += gridDim.x) {
        if (n_block != blockIdx.x) __syncthreads();   // the previous key tile's shared K, V, dSᵀ reads are done
        flash_bwd_key_tile<E, D, BM, NW, WD, NBUF, WINDOW, SCORE_MOD, GENERAL>(p, n_block);
    }
}

// =============================================================================================
// flash_bwd_2d: FlashAttention-2's layout, 16-bit types. The five products are split over the
// NW warps in 2-D warp tiles, so a warp reuses each fragment it loads across its whole tile
// (flash_bwd's 16-key slabs reload every Q / dO fragment per slab: ~1.4x the shared-memory
// reads per FLOP):
//   S = Q Kᵀ, dP = dO Vᵀ        [BM, BN] in registers: WMS warps over queries x NW / WMS over keys
//   P, dS                       rounded to E, written once to shared memory [BM, BN]
//   dV += Pᵀ dO, dK += dSᵀ Q    [BN, D] in registers for the whole block: WNKV warps over keys x
//                               NW / WNKV over columns (Pᵀ, dSᵀ read by ldmatrix.trans)
//   dQ = dS K                   [BM, D]: WMQ warps over queries x NW / WMQ over columns, added to
//                               the float32 accumulator by red.global.add (v2 pairs on sm_90)
// BN = 16·NW keys per block. The next step's Q, dO, lse and D arrive by cp.async during the
// whole step (NBUF = 2) or during the dQ product (NBUF = 1). Grid, GQA order, query-tile range,
// masks and deterministic slabs as flash_bwd; no GENERAL features (bias, mask, varlen run
// flash_bwd's GENERAL variant).
// =============================================================================================

// One key tile n_block of (kv head blockIdx.y, batch blockIdx.z), 2-D warp tiles (see above)
template <typename E, int D, int BM, int NW, int WMS, int WNKV, int WMQ, int NBUF, bool WINDOW,
          bool SCORE_MOD, bool PAIR>
__device__ __forceinline__ void flash_bwd_2d_key_tile(const Params& p, const int n_block) {
    static_assert(Elem<E>::is16, "2-D warp tiles: 16-bit types (ldmatrix)");
    typedef u16 S;
    constexpr int NT = NW * 32, BN = 16 * NW;
    constexpr int SM = BM / WMS, SN = BN / (NW / WMS);      // S / dP tile of a warp: queries x keys
    constexpr int KN = BN / WNKV, KD = D / (NW / WNKV);     // dK / dV tile: keys x columns
    constexpr int QM = BM / WMQ, QD = D / (NW / WMQ);       // dQ tile: queries x columns
    static_assert(NW % WMS == 0 && NW % WNKV == 0 && NW % WMQ == 0, "warp grids must tile the block");
    static_assert(SM % 16 == 0 && SN % 16 == 0 && KN % 16 == 0 && KD % 16 == 0 && QM % 16 == 0 &&
                  QD % 16 == 0, "warp tiles of whole 16x16 fragments");
    static_assert(NBUF == 1 || NBUF == 2, "one or two Q / dO buffers");
    // rows padded by 16 bytes: ldmatrix and ldmatrix.trans read 8 rows of 16 bytes conflict-free
    constexpr int PR = BwdPitch<E, D>::ROW, PP = BN + 8;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    S* k_smem = (S*)smem_raw;                     // [BN, PR]
    S* v_smem = k_smem + BN * PR;                 // [BN, PR]
    S* q_smem = v_smem + BN * PR;                 // [NBUF][BM, PR]
    S* do_smem = q_smem + NBUF * BM * PR;         // [NBUF][BM, PR]
    S* p_smem = do_smem + NBUF * BM * PR;         // [BM, PP]  P
    S* ds_smem = p_smem + BM * PP;                // [BM, PP]  dS
    float* lse_smem = (float*)(ds_smem + BM * PP);   // [NBUF][BM]  lse as stored (natural log; 0 past s_q)
    float* dsum_smem = lse_smem + NBUF * BM;         // [NBUF][BM]  D (0 past s_q)

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;        // accumulator row / column pair of this lane
    const int head_k = blockIdx.y, batch = blockIdx.z;
    const int n0 = n_block * BN;
    const int s_q = p.s_q, s_k = p.s_k, diag_offset = p.diag_offset;
    const int n_rows = min(BN, s_k - n0);
    const int s_r0 = (warp % WMS) * SM, s_c0 = (warp / WMS) * SN;       // S / dP tile: first query, key
    const int kv_r0 = (warp % WNKV) * KN, kv_c0 = (warp / WNKV) * KD;   // dK / dV tile: first key, column
    const int q_r0 = (warp % WMQ) * QM, q_c0 = (warp / WMQ) * QD;       // dQ tile: first query, column
    const float scale = p.scale, scale_log2 = p.scale_log2;

    const S* k_gmem = (const S*)p.k + batch * p.k_stride_b + head_k * p.k_stride_h + (i64)n0 * p.k_stride_s;  // [n_rows, d]
    const S* v_gmem = (const S*)p.v + batch * p.v_stride_b + head_k * p.v_stride_h + (i64)n0 * p.v_stride_s;  // [n_rows, d_v]

    const QuerySteps<BM, WINDOW> steps(p, s_q, n0, n_rows, diag_offset);
    const int total = steps.total;                                  // steps: (group head, query tile)

    // Issue the loads of step `it` into buffer `buf` (cp.async): Q, dO tiles; lse and D rows
    // (zero past s_q: those rows are masked, and their Q, dO rows are zero)
    auto load_step = [&](int it, int buf) {
        const int head = steps.head(p, head_k, it), m0 = steps.m0(it);
        const int m_rows = min(BM, s_q - m0);
        const S* q_gmem = (const S*)p.q + batch * p.q_stride_b + head * p.q_stride_h + (i64)m0 * p.q_stride_s;          // [m_rows, d]
        const S* do_gmem = (const S*)p.dout + batch * p.do_stride_b + head * p.do_stride_h + (i64)m0 * p.do_stride_s;  // [m_rows, d_v]
        copy_chunks<BM, D, PR, NT>(q_smem + buf * BM * PR, q_gmem, p.q_stride_s, m_rows, p.d, p.vec_ok, p.q, tid);
        copy_chunks<BM, D, PR, NT>(do_smem + buf * BM * PR, do_gmem, p.do_stride_s, m_rows, p.d_v, p.vec_ok, p.dout, tid);
        auto load_stat = [&](int i) {   // i in [0, BM): lse row i; [BM, 2 BM): D row i − BM
            const int r = i % BM;
            const float* stat_gmem = i < BM ? p.lse : p.dsum;        // [b, h, s_q]
            const i64 row = ((i64)batch * p.h + head) * s_q + m0 + r;
            cp_async_4((i < BM ? lse_smem : dsum_smem) + buf * BM + r,
                       r < m_rows ? stat_gmem + row : stat_gmem, r < m_rows ? 4 : 0);
        };
        if constexpr (2 * BM <= NT) {
            if (tid < 2 * BM) load_stat(tid);
        } else {
            for (int i = tid; i < 2 * BM; i += NT) load_stat(i);
        }
    };

    float dk_frag[KN / 16][KD / 8][4], dv_frag[KN / 16][KD / 8][4];   // dK, dV [KN keys, KD] of this warp
#pragma unroll
    for (int mi = 0; mi < KN / 16; ++mi)
#pragma unroll
        for (int j = 0; j < KD / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_frag[mi][j][e] = dv_frag[mi][j][e] = 0.f;

    if (total > 0) {
        // K, V tiles (kept for the whole block) and the first step's tiles in flight
        copy_chunks<BN, D, PR, NT>(k_smem, k_gmem, p.k_stride_s, n_rows, p.d, p.vec_ok, p.k, tid);
        copy_chunks<BN, D, PR, NT>(v_smem, v_gmem, p.v_stride_s, n_rows, p.d_v, p.vec_ok, p.v, tid);
        load_step(0, 0);
        cp_async_commit();
    }
    for (int it = 0; it < total; ++it) {
        const int buf = NBUF == 2 ? (it & 1) : 0;
        const int head = steps.head(p, head_k, it), m0 = steps.m0(it);
        cp_async_wait<0>();
        __syncthreads();   // step it's tiles landed for all threads; every warp is done with the other buffer and with P, dS
        if (NBUF == 2 && it + 1 < total) load_step(it + 1, buf ^ 1);
        cp_async_commit();
        const S* qb_smem = q_smem + buf * BM * PR;      // [BM, PR]
        const S* dob_smem = do_smem + buf * BM * PR;    // [BM, PR]

        // S = Q Kᵀ, dP = dO Vᵀ   [SM queries, SN keys] of this warp
        float s_frag[SM / 16][SN / 8][4], dp_frag[SM / 16][SN / 8][4];
        bwd2d_s_dp<E, D, SM, SN, PR, PAIR>(s_frag, dp_frag, qb_smem, k_smem, dob_smem, v_smem, s_r0, s_c0, lane);

        // P = exp2(score(S) − lse·log2 e) (masked: 0), dS = P ∘ (dP − D) · ds/dS_raw, in place
        float l2[SM / 16][2], dd[SM / 16][2];           // this lane's rows g, g + 8 of each 16-row slab
#pragma unroll
        for (int mi = 0; mi < SM / 16; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = s_r0 + mi * 16 + g + h * 8;
                l2[mi][h] = lse_smem[buf * BM + r] * CF_LOG2E;
                dd[mi][h] = dsum_smem[buf * BM + r];
            }
        // this warp's tile holds a masked score: keys past s_k, rows past s_q, a window edge
        const int wq0 = m0 + s_r0, wk0 = n0 + s_c0;
        const bool need_mask = (wk0 + SN > s_k) || (wq0 + SM > s_q) ||
            (WINDOW && (wk0 + SN - 1 > wq0 + diag_offset + p.window_right ||
                        wk0 < wq0 + SM - 1 + diag_offset - p.window_left));
        if (!SCORE_MOD && !need_mask) {
#pragma unroll
            for (int mi = 0; mi < SM / 16; ++mi)
#pragma unroll
                for (int j = 0; j < SN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float pr = fast_exp2(fmaf(s_frag[mi][j][e], scale_log2, -l2[mi][e >> 1]));
                        s_frag[mi][j][e] = pr;
                        dp_frag[mi][j][e] = pr * (dp_frag[mi][j][e] - dd[mi][e >> 1]) * scale;
                    }
        } else {
            const float slope_log2 = SCORE_MOD ? alibi_slope_log2<float>(p, batch, head) : 0.f;
#pragma unroll
            for (int mi = 0; mi < SM / 16; ++mi)
#pragma unroll
                for (int j = 0; j < SN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = wq0 + mi * 16 + g + (e >> 1) * 8, key = wk0 + j * 8 + 2 * t + (e & 1);
                        float ds_dqk;
                        const float sc = score_log2<SCORE_MOD>(s_frag[mi][j][e], p, slope_log2, row, key,
                                                               diag_offset, scale, &ds_dqk);
                        const bool kept = !need_mask ||
                            (row < s_q && score_kept<WINDOW>(p, nullptr, row, key, s_q, s_k, diag_offset));
                        const float pr = kept ? fast_exp2(sc - l2[mi][e >> 1]) : 0.f;
                        s_frag[mi][j][e] = pr;
                        dp_frag[mi][j][e] = pr * (dp_frag[mi][j][e] - dd[mi][e >> 1]) * ds_dqk;
                    }
        }
        // P, dS to shared memory [BM, BN] in E (rounded like the naive backward's operands)
        bwd2d_store_p_ds<E, SM, SN, PP>(p_smem, ds_smem, s_frag, dp_frag, s_r0, s_c0, g, t);
        __syncthreads();   // P, dS complete: the next products read other warps' tiles

        // dV += Pᵀ dO, dK += dSᵀ Q   [KN keys, KD columns] of this warp
        bwd2d_dkdv<E, BM, KN, KD, PP, PR, PAIR>(dv_frag, dk_frag, p_smem, ds_smem, qb_smem, dob_smem, kv_r0, kv_c0, lane);
        if (NBUF == 1) {
            __syncthreads();   // every warp is done reading Q, dO, lse and D of this step
            if (it + 1 < total) load_step(it + 1, 0);
            cp_async_commit();
        }

        // dQ[m tile] += dS K   [QM queries, QD columns] of this warp, into the float32 accumulator
        bwd2d_add_dq<E, BN, QM, QD, PP, PR>(p, ds_smem, k_smem, q_r0, q_c0, lane, g, t, batch, head, m0, s_q);
    }

    // dK, dV [KN keys, KD] of this warp to global memory in E
    bwd2d_store_dkdv<E, KN, KD>(p, dk_frag, dv_frag, batch, head_k, n0, kv_r0, kv_c0, g, t, s_k);
}

// Entry, grid (key tiles or G, kv heads, batch) as flash_bwd's (deterministic: key tiles x, x + G, ...).
// PAIR: S with dP, and dV with dK, in one k loop each (warp_tile_mma_pair; not timed yet)
template <typename E, int D, int BM, int NW, int WMS, int WNKV, int WMQ, int NBUF, bool WINDOW,
          bool SCORE_MOD, bool PAIR = false>
__global__ void __launch_bounds__(NW * 32, 1)
flash_bwd_2d(const Params p) {
    for (int n_block = blockIdx.x; n_block < p.num_n_blocks; n_block += gridDim.x) {
        if (n_block != blockIdx.x) __syncthreads();   // the previous key tile's shared K, V, P, dS reads are done
        flash_bwd_2d_key_tile<E, D, BM, NW, WMS, WNKV, WMQ, NBUF, WINDOW, SCORE_MOD, PAIR>(p, n_block);
    }
}

// ---------------------------------------------------------------------------------------------
// dbias of a bias with whole query and key dimensions, when flash_bwd does not write it (the
// launcher's choice, cupyflash/gpu/plan_bwd.py dbias_by_kernel):
//
//   dbias[pb, ph, i, j] = Σ over the (batch, query head) pairs that plane (pb, ph) broadcasts to
//                         of dS[batch, head, i, j],   dS = P ∘ (dP − D) in natural units
//
// Block (x, y, z) owns the [BM queries, BN keys] tile (y, x) of plane z = pb · h' + ph and walks
// its pairs in order (batch outer, head inner), recomputing S = Q Kᵀ and dP = dO Vᵀ for the tile
// from Q, dO, K, V, lse and D; the sum stays in float32 registers and is stored once, in the
// bias's element type, into p.dbias [b', h', s_q, s_k] (dbias strides): no float32 copy of dbias
// in memory, and a fixed order (deterministic). Warp w owns query rows w·16.. of the tile
// (m16n8 accumulator layout: rows g, g + 8; keys j·8 + 2t, + 1). The scores go through the
// forward's score_mod_tile (scale / softcap, bias, ALiBi, one block-uniform pass each).
// ---------------------------------------------------------------------------------------------

template <typename E, int D, int BM, int BN, int NBUF>
__global__ void __launch_bounds__(BM / 16 * 32, 1)
flash_bwd_dbias(const Params p) {
    typedef typename Elem<E>::storage S;
    constexpr int NW = BM / 16, NT = NW * 32;
    constexpr int PR = BwdPitch<E, D>::ROW;
    constexpr int BUF = (2 * BM + 2 * BN) * PR;   // elements of one buffer's Q, dO, K, V tiles
    static_assert(BM % 16 == 0 && BN % 16 == 0, "whole 16-row / 16-key fragments");
    static_assert(NBUF == 1 || NBUF == 2, "one buffer, or two (the next pair's tiles land during this one)");
    static_assert(!is_f64<E>, "float64 dbias comes from flash_bwd's double accumulator");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    // buffer b: q_smem [BM, PR], do_smem [BM, PR], k_smem [BN, PR], v_smem [BN, PR] from tiles_smem + b·BUF
    S* tiles_smem = (S*)smem_raw;                             // [NBUF][BUF]
    float* lse2_smem = (float*)(tiles_smem + NBUF * BUF);     // [NBUF][BM]  lse·log2(e); +inf: row contributes nothing
    float* dsum_smem = lse2_smem + NBUF * BM;                 // [NBUF][BM]  D

    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int s_q = p.s_q, s_k = p.s_k, diag_offset = p.diag_offset;
    const int m_rows = min(BM, s_q - m0), n_rows = min(BN, s_k - n0);

    // Plane (pb, ph) and the pairs summed into it: every batch entry where the bias broadcasts
    // over the batch (dbias_stride_b = 0), else pb alone; likewise heads
    const int planes_h = p.dbias_stride_h ? p.h : 1;
    const int pb = blockIdx.z / planes_h, ph = blockIdx.z % planes_h;
    const int nb = p.dbias_stride_b ? 1 : p.b, nh = p.dbias_stride_h ? 1 : p.h;
    auto pair_batch = [&](int it) { return nb == 1 ? pb : it / nh; };
    auto pair_head = [&](int it) { return nh == 1 ? ph : it % nh; };
    // Window: a tile no row of which keeps any of its keys has dS = 0 in every pair
    const bool outside = n0 + n_rows - 1 < m0 + diag_offset - p.window_left ||
                         n0 > m0 + m_rows - 1 + diag_offset + p.window_right;
    const int pairs = outside ? 0 : nb * nh;
    const bool need_mask = (n0 + BN > s_k) || p.mask ||
        n0 + BN - 1 > m0 + diag_offset + p.window_right || n0 < m0 + BM - 1 + diag_offset - p.window_left;

    // Issue the loads of pair `it` into buffer `buf`: Q, dO [m_rows, d | d_v] of (batch, head),
    // K, V [n_rows, d | d_v] of (batch, kv head) by cp.async; lse·log2(e) and D of the rows.
    // The tile's addresses repeat in every pair: made from an opaque thread index, so they are
    // recomputed per pair, not hoisted out of the loop (as ~100 64-bit registers).
    auto load_pair = [&](int it, int buf) {
        const int batch = pair_batch(it), head = pair_head(it), head_k = head / p.h_per_hk;
        const int tid_it = opaque_int(tid);
        S* q_smem = tiles_smem + buf * BUF;
        const S* q_gmem = (const S*)p.q + batch * p.q_stride_b + head * p.q_stride_h + (i64)m0 * p.q_stride_s;
        const S* do_gmem = (const S*)p.dout + batch * p.do_stride_b + head * p.do_stride_h + (i64)m0 * p.do_stride_s;
        const S* k_gmem = (const S*)p.k + batch * p.k_stride_b + head_k * p.k_stride_h + (i64)n0 * p.k_stride_s;
        const S* v_gmem = (const S*)p.v + batch * p.v_stride_b + head_k * p.v_stride_h + (i64)n0 * p.v_stride_s;
        copy_chunks<BM, D, PR, NT>(q_smem, q_gmem, p.q_stride_s, m_rows, p.d, p.vec_ok, p.q, tid_it);
        copy_chunks<BM, D, PR, NT>(q_smem + BM * PR, do_gmem, p.do_stride_s, m_rows, p.d_v, p.vec_ok, p.dout, tid_it);
        copy_chunks<BN, D, PR, NT>(q_smem + 2 * BM * PR, k_gmem, p.k_stride_s, n_rows, p.d, p.vec_ok, p.k, tid_it);
        copy_chunks<BN, D, PR, NT>(q_smem + (2 * BM + BN) * PR, v_gmem, p.v_stride_s, n_rows, p.d_v, p.vec_ok, p.v, tid_it);
        const i64 row0 = ((i64)batch * p.h + head) * s_q + m0;   // [b, h, s_q] index of row m0
        load_row_stats<BM, NT>(lse2_smem + buf * BM, dsum_smem + buf * BM, p, row0, m_rows, tid_it);
    };

    float acc[BN / 8][4];                         // Σ dS [16 queries, BN keys] of this warp
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    if (pairs > 0) load_pair(0, 0);
    cp_async_commit();
    for (int it = 0; it < pairs; ++it) {
        const int buf = NBUF == 2 ? (it & 1) : 0;
        const int batch = pair_batch(it), head = pair_head(it);
        if (NBUF == 1 && it > 0) {
            __syncthreads();   // every warp is done reading the previous pair's tiles
            load_pair(it, 0);
            cp_async_commit();
        }
        cp_async_wait<0>();
        __syncthreads();   // pair it's tiles, lse and D landed for all threads; (NBUF 2) every warp is done with the other buffer
        if (NBUF == 2 && it + 1 < pairs) load_pair(it + 1, buf ^ 1);
        cp_async_commit();
        const int tid_it = opaque_int(tid), warp = tid_it >> 5, lane = tid_it & 31;
        const int g = lane >> 2, t = lane & 3;
        const S* q_smem = tiles_smem + buf * BUF;         // [BM, PR]
        const S* do_smem = q_smem + BM * PR;              // [BM, PR]
        const S* k_smem = q_smem + 2 * BM * PR;           // [BN, PR]
        const S* v_smem = k_smem + BN * PR;               // [BN, PR]

        // S = Q Kᵀ and dP = dO Vᵀ   [16 queries, BN keys] of this warp
        float s_frag[1][BN / 8][4], dp_frag[BN / 8][4];
        dbias_s_dp<E, D, BN, PR>(s_frag, dp_frag, p, q_smem, k_smem, do_smem, v_smem, warp, lane);

        // Scores in base-2 units (scale / softcap, + bias, ALiBi), −inf where masked
        const float slope_log2 = p.alibi ? p.alibi[batch * p.alibi_stride_b + head] * CF_LOG2E : 0.f;
        const char* bias_plane = (const char*)p.bias + (batch * p.bias_stride_b + head * p.bias_stride_h) * (p.bias_f32 ? 4 : (i64)sizeof(S));
        if (p.bias_f32)
            score_mod_tile<E, true, float, BN, 1>(s_frag, p, (const float*)bias_plane, slope_log2, m0 + warp * 16, n0, g, t, s_q, s_k, diag_offset);
        else
            score_mod_tile<E, true, S, BN, 1>(s_frag, p, (const S*)bias_plane, slope_log2, m0 + warp * 16, n0, g, t, s_q, s_k, diag_offset);
        if (need_mask) {
            const unsigned char* mask_plane = p.mask ? p.mask + batch * p.mask_stride_b + head * p.mask_stride_h : nullptr;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = m0 + warp * 16 + g + (e >> 1) * 8, key = n0 + j * 8 + 2 * t + (e & 1);
                    if (!score_kept<true>(p, mask_plane, row, key, s_q, s_k, diag_offset)) s_frag[0][j][e] = -CF_INF;
                }
        }
        // P = exp2(s − lse·log2 e);  Σ dS += P ∘ (dP − D)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = warp * 16 + g + half * 8;   // tile row
            const float l2 = lse2_smem[buf * BM + r], dd = dsum_smem[buf * BM + r];
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int e = 2 * half + c;
                    acc[j][e] += fast_exp2(s_frag[0][j][e] - l2) * (dp_frag[j][e] - dd);
                }
        }
    }

    // dbias tile of plane (pb, ph) in the bias's type (zeros for a tile outside the window)
    dbias_store_tile<E, BN>(p, acc, tid, pb, ph, m0, n0, s_q, s_k);
}
