// cupyflash forward kernel, sm_80+ (mma.sync), FlashAttention-2 structure.
//
//   O = softmax(scale * Q Kᵀ [softcap, alibi, window/causal masks]) V,   lse = log Σ exp(scores)
//
// One thread block = one query tile of BM rows of one (batch, head); NW warps, each warp owns
// MT = BM / (16 NW) slabs of 16 query rows. The Q tile stays in shared memory; K and V tiles
// (BN keys) stream through one shared buffer each with cp.async: V(n) is loaded while S = Q K(n)ᵀ
// runs, K(n-1) while softmax and O += P V(n) run. S lives in registers (the m16n8 accumulator
// layout), becomes P in place, and is fed to the PV product as its A operand: P never touches
// shared memory. Online softmax in base 2 with the scale folded into one FFMA.
//
// Template arguments (cupyflash/gpu/plan_fwd.py enumerates the instantiated set):
//   E        f16_t | bf16_t | f32x3_t (float32, 3xTF32) | tf32_t (float32, plain TF32) |
//            f64_t (float64: DMMA products, every accumulator and statistic in double)
//   D        head-dim bucket (multiple of 32) covering both d and d_v; padding columns are
//            zero-filled on load and never stored
//   BM, BN   query / key tile sizes;  NW  warps per block
//   KSTAGES  K buffers: 1 (K(n-1) loaded during softmax + PV) or 2 (K(n-1) issued at the top of
//            iteration n, a whole iteration ahead)
//   WINDOW   causal or sliding window: skip tiles outside, mask the boundary tiles
//   SCORE_MOD softcap and/or ALiBi (or a non-positive scale): scores are transformed to base-2
//            units before the max
//   GENERAL  feature bits, each feature on at run time when its Params pointer is set; only
//            instantiated with WINDOW and SCORE_MOD (docs/kernels.md, "bias, mask, varlen"):
//            GEN_VARLEN packed sequences (cu_seqlens), GEN_BIAS_MASK bias and boolean mask.
//            0 = neither (the plain kernels); 1 = varlen alone, on the plain tiles; 3 = all
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/score.cuh"
#include "common/types.cuh"
#include "portable/fwd_parts.cuh"

template <typename E, int D, int BM, int BN, int NW, int KSTAGES, bool WINDOW, bool SCORE_MOD,
          int GENERAL = 0>
__global__ void __launch_bounds__(NW * 32)
flash_fwd(const Params p) {
    constexpr bool VARLEN = GENERAL & GEN_VARLEN, BIAS_MASK = GENERAL & GEN_BIAS_MASK;
    typedef typename Elem<E>::storage S;
    typedef Acc<E> A;                              // float, or double for float64
    constexpr int NT = NW * 32;
    constexpr int MT = BM / (16 * NW);            // 16-row slabs per warp
    constexpr int DO = Pitch<E, D>::OCols;        // O columns (p.d_v <= DO)
    static_assert(MT * 16 * NW == BM, "BM must be a multiple of 16 * NW");
    static_assert(KSTAGES == 1 || KSTAGES == 2, "one or two K buffers");
    static_assert(!GENERAL || (WINDOW && SCORE_MOD), "GENERAL runs on the window and score-mod paths");
    constexpr int PQK = Pitch<E, D>::QK, PV = Pitch<E, D>::V;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    S* q_smem = (S*)smem_raw;                      // [BM, PQK]  (reused for O at the end)
    S* k_smem0 = q_smem + BM * PQK;                // [KSTAGES][BN, PQK]
    S* v_smem = k_smem0 + KSTAGES * BN * PQK;      // [BN, PV]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;         // accumulator row / column-pair of this lane
    const int m_block = p.num_m_blocks - 1 - (int)blockIdx.x;   // longest (causal) tiles first
    const int head = blockIdx.y, batch = blockIdx.z;
    const int head_k = head / p.h_per_hk;          // GQA / MQA
    const int m0 = m_block * BM;

    // This block's sequence: batch entry `batch`, or (varlen) packed rows cu_seqlens[batch]..
    // [batch + 1] of q (k, v likewise; batch strides are 0 then)
    int s_q = p.s_q, s_k = p.s_k, diag_offset = p.diag_offset;
    // first packed row of the sequence (k_tok0 declared first: with the parts inlined, this order
    // of the varlen phis gives the SASS of the kernel written inline)
    i64 k_tok0 = 0, q_tok0 = 0;
    int lse_b = batch;                             // batch index into lse [b, h, s_q] ([1, h, total_q] varlen)
    if (VARLEN && p.cu_seqlens_q) {
        const int q_beg = p.cu_seqlens_q[batch], k_beg = p.cu_seqlens_k[batch];
        s_q = p.cu_seqlens_q[batch + 1] - q_beg;
        s_k = p.cu_seqlens_k[batch + 1] - k_beg;
        q_tok0 = q_beg; k_tok0 = k_beg; lse_b = 0;
        diag_offset = p.varlen_bottom_right ? s_k - s_q : 0;
        if (m0 >= s_q) return;                     // tile past this sequence (whole block, before any barrier)
    }
    const int m_rows = min(BM, s_q - m0);

    const S* q_gmem = (const S*)p.q + batch * p.q_stride_b + head * p.q_stride_h + (q_tok0 + m0) * p.q_stride_s;  // [m_rows, d]
    const S* k_gmem = (const S*)p.k + batch * p.k_stride_b + head_k * p.k_stride_h + k_tok0 * p.k_stride_s;      // [s_k, d]
    const S* v_gmem = (const S*)p.v + batch * p.v_stride_b + head_k * p.v_stride_h + k_tok0 * p.v_stride_s;      // [s_k, d_v]
    S* o_gmem = (S*)p.o + batch * p.o_stride_b + head * p.o_stride_h + (q_tok0 + m0) * p.o_stride_s;             // [m_rows, d_v]
    A* lse_gmem = (A*)p.lse + ((i64)lse_b * p.h + head) * p.s_q + q_tok0 + m0;                                   // [m_rows]
    // bias / mask planes of this (batch, head): [s_q, s_k] with their own strides (null: off)
    const void* bias_gmem = nullptr;
    const unsigned char* mask_gmem = nullptr;
    if (BIAS_MASK && p.bias)
        bias_gmem = (const char*)p.bias + (batch * p.bias_stride_b + head * p.bias_stride_h) * (p.bias_f32 ? 4 : (i64)sizeof(S));
    if (BIAS_MASK && p.mask) mask_gmem = p.mask + batch * p.mask_stride_b + head * p.mask_stride_h;

    // Per-lane state. Row r of slab mt: warp * MT * 16 + mt * 16 + g (+8 for the second half).
    A o_frag[MT][DO / 8][4];                       // O accumulator [16 rows, DO] per slab
    A m_row[MT][2], l_row[MT][2];                  // running max (raw score units), partial denominator
    const int warp_row0 = warp * MT * 16;          // first tile row of this warp
    A sl2;                                         // scale·log2 e, or 1 with SCORE_MOD
    fwd_mainloop<E, D, BM, BN, NW, KSTAGES, WINDOW, SCORE_MOD, GENERAL>(
        p, q_smem, k_smem0, v_smem, q_gmem, k_gmem, v_gmem, bias_gmem, mask_gmem, tid, warp_row0, lane, g, t, batch,
        head, m0, m_rows, s_q, s_k, diag_offset, sl2, o_frag, m_row, l_row);

    fwd_finish_rows<E, D, BM, NW>(q_smem, lse_gmem, warp_row0, g, t, m_rows, sl2, o_frag, m_row, l_row);
    S* o_smem = q_smem;   // [BM, PQK]: the O tile (fwd_finish_rows wrote it)
    cp_async_wait<0>();
    __syncthreads();   // the whole O tile is in shared memory before the coalesced store
    constexpr int CH = 16 / sizeof(S), CPR = DO / CH;
#pragma unroll
    for (int i = 0; i < (BM * CPR + NT - 1) / NT; ++i) {
        const int c = tid + i * NT;
        const int r = c / CPR, col = (c % CPR) * CH;
        if (c < BM * CPR && r < m_rows && col < p.d_v) {
            const S* src = o_smem + r * PQK + col;
            S* dst = o_gmem + r * p.o_stride_s + col;
            if (p.vec_ok && col + CH <= p.d_v) {
                *(uint4*)dst = *(const uint4*)src;
            } else {
#pragma unroll
                for (int e = 0; e < CH; ++e) if (col + e < p.d_v) dst[e] = src[e];
            }
        }
    }
}
