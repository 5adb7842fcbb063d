// cupyflash: the portable backward's parts (flash_bwd, flash_bwd_2d and flash_bwd_dbias in
// portable/bwd.cu wire them; their tile copies are common/tile_copy.cuh's copy_chunks):
// shared-memory pitches (BwdPitch, DsPitch), flash_bwd's warp-level products (mma_nt, mma_rn,
// mma_tn), the rows' lse and D
// (load_row_stats), a key tile's query steps (QuerySteps), flash_bwd_2d's warp-tile products
// (warp_tile_mma, warp_tile_mma_pair), opaque_int; then each kernel's phases: flash_bwd's
// (bwd_s_dp, bwd_dkdv_dst, bwd_add_dq, bwd_store_dkdv), flash_bwd_2d's (bwd2d_s_dp,
// bwd2d_store_p_ds, bwd2d_dkdv, bwd2d_add_dq, bwd2d_store_dkdv) and flash_bwd_dbias's
// (dbias_s_dp, dbias_store_tile). The P / dS step with its masks stays inline in each kernel:
// as a part (also with the window tests written with `|`) it changed the SASS.
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/score.cuh"
#include "common/tile_copy.cuh"
#include "common/types.cuh"

// Shared-memory row pitch (elements). 16-bit rows padded by 16 bytes: ldmatrix reads
// conflict-free for every bucket; float32 rows by 16 bytes: the scalar B-fragment loads
// (rows 2t, columns g) hit 32 distinct banks; float64 rows by 32 bytes (pair and scalar loads
// both at most two-way conflicts). All keep cp.async destinations 16-byte aligned.
template <typename E, int D> struct BwdPitch {
    static constexpr int ROW = Elem<E>::is16 ? D + 8 : D + 4;   // Q, K, V, dO rows
};
template <typename E, int BM> struct DsPitch {
    static constexpr int ROW = Elem<E>::is16 ? BM + 8 : BM + 4; // dSᵀ rows (one per key)
};

// ---------------------------------------------------------------------------------------------
// Warp-level products on one 16-row slab, fp32 accumulators in the m16n8 layout
// (lane: g = lane / 4 row, t = lane % 4 column pair; c[j] = columns j*8.., rows g and g + 8).
// float32 (m16n8k8): inside each 8-wide k step the logical k index t <-> 2t, t + 4 <-> 2t + 1 in
// BOTH operands, so an accumulator pair or an 8-byte row load is an operand as it stands.
// ---------------------------------------------------------------------------------------------

// C[16, N] += A[16, K] B[N, K]ᵀ;  A, B row-major in shared memory; k steps >= k_valid skipped.
template <typename E, int N, int KMAX, int PA, int PB>
__device__ __forceinline__ void mma_nt(Acc<E> (&c)[N / 8][4],
                                       const typename Elem<E>::storage* a_smem,   // [16, PA]
                                       const typename Elem<E>::storage* b_smem,   // [N, PB]
                                       int lane, int k_valid) {
    if constexpr (Elem<E>::is16) {
        // k loop kept rolled: its index only moves addresses (unrolled, every B load is hoisted)
#pragma unroll 1
        for (int kk = 0; kk < KMAX / 16; ++kk) {
            if (kk * 16 < k_valid) {
                u32 a_frag[4];                       // A: 16 rows x k16
                ldmatrix_x4(a_frag, a_smem + (lane & 15) * PA + kk * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int nn = 0; nn < N / 16; ++nn) {
                    u32 b_frag[4];                   // B: rows nn*16.., two n8 tiles x k16
                    ldmatrix_x4(b_frag, b_smem + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * PB
                                            + kk * 16 + ((lane >> 3) & 1) * 8);
                    mma16816<E>(c[2 * nn], a_frag, b_frag[0], b_frag[1]);
                    mma16816<E>(c[2 * nn + 1], a_frag, b_frag[2], b_frag[3]);
                }
            }
        }
    } else {
        typedef typename Elem<E>::storage S;
        typedef typename Vec2<S>::type S2;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
        for (int kk = 0; kk < KMAX / 8; ++kk) {
            if (kk * 8 < k_valid) {
                const S2 lo = *(const S2*)(a_smem + g * PA + kk * 8 + 2 * t);
                const S2 hi = *(const S2*)(a_smem + (g + 8) * PA + kk * 8 + 2 * t);
                const S a_frag[4] = {lo.x, hi.x, lo.y, hi.y};
#pragma unroll
                for (int j = 0; j < N / 8; ++j) {
                    const S2 b = *(const S2*)(b_smem + (j * 8 + g) * PB + kk * 8 + 2 * t);
                    mma_k8<E>(c[j], a_frag, b.x, b.y);
                }
            }
        }
    }
}

// C[16, NC] += A[16, K] B[K, NC];  A in registers (an accumulator [16, K], rounded to E for
// 16-bit types), B row-major in shared memory; column groups >= n_valid skipped.
template <typename E, int K, int NC, int PB>
__device__ __forceinline__ void mma_rn(Acc<E> (&c)[NC / 8][4], const Acc<E> (&a_acc)[K / 8][4],
                                       const typename Elem<E>::storage* b_smem,   // [K, PB]
                                       int lane, int n_valid) {
    if constexpr (Elem<E>::is16) {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
            u32 a_frag[4];   // accumulator pairs of columns kk*16.. packed to 16 bits
            a_frag[0] = pack2<E>(a_acc[2 * kk][0], a_acc[2 * kk][1]);
            a_frag[1] = pack2<E>(a_acc[2 * kk][2], a_acc[2 * kk][3]);
            a_frag[2] = pack2<E>(a_acc[2 * kk + 1][0], a_acc[2 * kk + 1][1]);
            a_frag[3] = pack2<E>(a_acc[2 * kk + 1][2], a_acc[2 * kk + 1][3]);
#pragma unroll
            for (int dd = 0; dd < NC / 16; ++dd) {
                if (dd * 16 < n_valid) {
                    u32 b_frag[4];   // B: k rows kk*16.. x columns dd*16.. (transposed load)
                    ldmatrix_x4_trans(b_frag, b_smem + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * PB
                                                  + dd * 16 + (lane >> 4) * 8);
                    mma16816<E>(c[2 * dd], a_frag, b_frag[0], b_frag[1]);
                    mma16816<E>(c[2 * dd + 1], a_frag, b_frag[2], b_frag[3]);
                }
            }
        }
    } else {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int j = 0; j < K / 8; ++j) {
            const Acc<E> a_frag[4] = {a_acc[j][0], a_acc[j][2], a_acc[j][1], a_acc[j][3]};
#pragma unroll
            for (int dn = 0; dn < NC / 8; ++dn) {
                if (dn * 8 < n_valid) {
                    const Acc<E> b0 = b_smem[(j * 8 + 2 * t) * PB + dn * 8 + g];
                    const Acc<E> b1 = b_smem[(j * 8 + 2 * t + 1) * PB + dn * 8 + g];
                    mma_k8<E, true>(c[dn], a_frag, b0, b1);   // dK, dV: long sums
                }
            }
        }
    }
}

// C[16, NC] += A[16, K] B[K, NC];  A stored TRANSPOSED in shared memory (At [K, 16 used columns]),
// B row-major in shared memory; column groups >= n_valid skipped.
template <typename E, int K, int NC, int PA, int PB>
__device__ __forceinline__ void mma_tn(Acc<E> (&c)[NC / 8][4],
                                       const typename Elem<E>::storage* at_smem,  // [K, PA]
                                       const typename Elem<E>::storage* b_smem,   // [K, PB]
                                       int lane, int n_valid) {
    if constexpr (Elem<E>::is16) {
#pragma unroll 1
        for (int kk = 0; kk < K / 16; ++kk) {
            u32 a_frag[4];   // A: 16 rows x k16, read from At by a transposed load
            ldmatrix_x4_trans(a_frag, at_smem + (kk * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * PA
                                          + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int dd = 0; dd < NC / 16; ++dd) {
                if (dd * 16 < n_valid) {
                    u32 b_frag[4];
                    ldmatrix_x4_trans(b_frag, b_smem + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * PB
                                                  + dd * 16 + (lane >> 4) * 8);
                    mma16816<E>(c[2 * dd], a_frag, b_frag[0], b_frag[1]);
                    mma16816<E>(c[2 * dd + 1], a_frag, b_frag[2], b_frag[3]);
                }
            }
        }
    } else {
        typedef typename Elem<E>::storage S;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
        for (int kk = 0; kk < K / 8; ++kk) {
            const S* a0 = at_smem + (kk * 8 + 2 * t) * PA;      // k = 2t row of At
            const S* a1 = a0 + PA;                              // k = 2t + 1
            const S a_frag[4] = {a0[g], a0[g + 8], a1[g], a1[g + 8]};
#pragma unroll
            for (int dn = 0; dn < NC / 8; ++dn) {
                if (dn * 8 < n_valid) {
                    const S b0 = b_smem[(kk * 8 + 2 * t) * PB + dn * 8 + g];
                    const S b1 = b_smem[(kk * 8 + 2 * t + 1) * PB + dn * 8 + g];
                    mma_k8<E>(c[dn], a_frag, b0, b1);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// lse·log2(e) and D of the BM query rows from [b, h, s_q] index row0 into shared memory; rows
// past m_rows and rows with lse = −inf get +inf and 0 (P = 0: the row contributes nothing).
// ---------------------------------------------------------------------------------------------
template <int BM, int NT, typename A>
__device__ __forceinline__ void load_row_stats(A* lse2_smem,            // [BM]
                                               A* dsum_smem,            // [BM]
                                               const Params& p, i64 row0, int m_rows, int tid) {
    for (int r = tid; r < BM; r += NT) {
        A l2 = CF_INF, dsum = A(0);
        if (r < m_rows) {
            const A l = ((const A*)p.lse)[row0 + r];
            if (l != -CF_INF) l2 = l * log2e<A>();
            dsum = ((const A*)p.dsum)[row0 + r];
        }
        lse2_smem[r] = l2;
        dsum_smem[r] = dsum;
    }
}

// ---------------------------------------------------------------------------------------------
// The query steps of one key tile [n0, n0 + n_rows): rows [i_lo, i_hi] see some key of it (key j
// is kept for row i when i + diag_offset − left <= j <= i + diag_offset + right), in tiles of BM
// rows; step it = (query head of the group it / num_m, query tile it % num_m).
// ---------------------------------------------------------------------------------------------
template <int BM, bool WINDOW>
struct QuerySteps {
    int m_first, num_m, total;
    __device__ __forceinline__ QuerySteps(const Params& p, int s_q, int n0, int n_rows,
                                          int diag_offset) {
        int i_lo = 0, i_hi = s_q - 1;
        if (WINDOW) {
            i_lo = max(0, n0 - diag_offset - p.window_right);
            i_hi = min(s_q - 1, n0 + n_rows - 1 - diag_offset + p.window_left);
        }
        m_first = i_lo / BM;
        num_m = i_hi >= i_lo ? i_hi / BM - m_first + 1 : 0;   // query tiles per head
        total = num_m * p.h_per_hk;
    }
    __device__ __forceinline__ int head(const Params& p, int head_k, int it) const {
        return head_k * p.h_per_hk + it / num_m;
    }
    __device__ __forceinline__ int m0(int it) const { return (m_first + it % num_m) * BM; }
};

// Warp-tile products C[16·MI, 8·NJ] += A[16·MI, K] · B[K, 8·NJ]: 16-bit operands in shared
// memory, read by ldmatrix (x4: lanes 8i..8i+7 address the rows of 8x8 matrix i).
//   A_T = false: A row-major [16·MI, PA];  A_T = true: Aᵀ row-major [K, PA]
//   B_T = false: Bᵀ row-major [8·NJ, PB];  B_T = true: B row-major [K, PB]
// This lane's row address in a 16x16 fragment of A / B
template <bool A_T, int PA>
__device__ __forceinline__ const u16* frag_lane_a(const u16* a_smem, int lane) {
    return A_T ? a_smem + ((lane & 7) + ((lane >> 4) & 1) * 8) * PA + ((lane >> 3) & 1) * 8
               : a_smem + (lane & 15) * PA + (lane >> 4) * 8;
}
template <bool B_T, int PB>
__device__ __forceinline__ const u16* frag_lane_b(const u16* b_smem, int lane) {
    return B_T ? b_smem + ((lane & 7) + ((lane >> 3) & 1) * 8) * PB + (lane >> 4) * 8
               : b_smem + ((lane & 7) + (lane >> 4) * 8) * PB + ((lane >> 3) & 1) * 8;
}
// The fragments of k step kk: MI of A, NJ / 2 of B (two n8 tiles each)
template <int MI, int NJ, bool A_T, bool B_T, int PA, int PB>
__device__ __forceinline__ void load_frags(u32 (&a_frag)[MI][4], u32 (&b_frag)[NJ / 2][4],
                                           const u16* a_lane, const u16* b_lane, int kk) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        if (A_T) ldmatrix_x4_trans(a_frag[mi], a_lane + kk * 16 * PA + mi * 16);
        else     ldmatrix_x4(a_frag[mi], a_lane + mi * 16 * PA + kk * 16);
    }
#pragma unroll
    for (int nn = 0; nn < NJ / 2; ++nn) {
        if (B_T) ldmatrix_x4_trans(b_frag[nn], b_lane + kk * 16 * PB + nn * 16);
        else     ldmatrix_x4(b_frag[nn], b_lane + nn * 16 * PB + kk * 16);
    }
}
// The MI x NJ products of one k step
template <typename E, int MI, int NJ>
__device__ __forceinline__ void mma_frags(float (&c)[MI][NJ][4], const u32 (&a_frag)[MI][4],
                                          const u32 (&b_frag)[NJ / 2][4]) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int nn = 0; nn < NJ / 2; ++nn) {
            mma16816<E>(c[mi][2 * nn], a_frag[mi], b_frag[nn][0], b_frag[nn][1]);
            mma16816<E>(c[mi][2 * nn + 1], a_frag[mi], b_frag[nn][2], b_frag[nn][3]);
        }
}

// One product on one warp; the fragments of k step kk + 1 are loaded before the products of kk
template <typename E, int MI, int NJ, int K, bool A_T, bool B_T, int PA, int PB>
__device__ __forceinline__ void warp_tile_mma(float (&c)[MI][NJ][4], const u16* a_smem,
                                              const u16* b_smem, int lane) {
    static_assert(NJ % 2 == 0 && K % 16 == 0, "whole 16x16 fragments");
    // this lane's row address in a 16x16 fragment (frag_lane_a / _b's, written out: calling them
    // reorders the address arithmetic in the SASS of the default hd 64 / 96 variants)
    const u16* a_lane = A_T ? a_smem + ((lane & 7) + ((lane >> 4) & 1) * 8) * PA + ((lane >> 3) & 1) * 8
                            : a_smem + (lane & 15) * PA + (lane >> 4) * 8;
    const u16* b_lane = B_T ? b_smem + ((lane & 7) + ((lane >> 3) & 1) * 8) * PB + (lane >> 4) * 8
                            : b_smem + ((lane & 7) + (lane >> 4) * 8) * PB + ((lane >> 3) & 1) * 8;
    u32 a_frag[2][MI][4], b_frag[2][NJ / 2][4];   // two k steps: loading one, multiplying the other
    auto load = [&](int kk, int buf) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            if (A_T) ldmatrix_x4_trans(a_frag[buf][mi], a_lane + kk * 16 * PA + mi * 16);
            else     ldmatrix_x4(a_frag[buf][mi], a_lane + mi * 16 * PA + kk * 16);
        }
#pragma unroll
        for (int nn = 0; nn < NJ / 2; ++nn) {   // two n8 tiles per load
            if (B_T) ldmatrix_x4_trans(b_frag[buf][nn], b_lane + kk * 16 * PB + nn * 16);
            else     ldmatrix_x4(b_frag[buf][nn], b_lane + nn * 16 * PB + kk * 16);
        }
    };
    load(0, 0);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        if (kk + 1 < K / 16) load(kk + 1, (kk + 1) & 1);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int nn = 0; nn < NJ / 2; ++nn) {
                mma16816<E>(c[mi][2 * nn], a_frag[kk & 1][mi], b_frag[kk & 1][nn][0], b_frag[kk & 1][nn][1]);
                mma16816<E>(c[mi][2 * nn + 1], a_frag[kk & 1][mi], b_frag[kk & 1][nn][2], b_frag[kk & 1][nn][3]);
            }
    }
}

// Two independent products of one K extent in one k loop (C0 += A0 B0, C1 += A1 B1, same
// layouts): twice warp_tile_mma's independent mma.sync per k step; fragments single-buffered
// (their registers pay for the second product's)
template <typename E, int MI, int NJ, int K, bool A_T, bool B_T, int PA, int PB>
__device__ __forceinline__ void warp_tile_mma_pair(float (&c0)[MI][NJ][4], float (&c1)[MI][NJ][4],
                                                   const u16* a0_smem, const u16* b0_smem,
                                                   const u16* a1_smem, const u16* b1_smem, int lane) {
    static_assert(NJ % 2 == 0 && K % 16 == 0, "whole 16x16 fragments");
    const u16* a0_lane = frag_lane_a<A_T, PA>(a0_smem, lane);
    const u16* b0_lane = frag_lane_b<B_T, PB>(b0_smem, lane);
    const u16* a1_lane = frag_lane_a<A_T, PA>(a1_smem, lane);
    const u16* b1_lane = frag_lane_b<B_T, PB>(b1_smem, lane);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 a_frag[2][MI][4], b_frag[2][NJ / 2][4];   // [product]
        load_frags<MI, NJ, A_T, B_T, PA, PB>(a_frag[0], b_frag[0], a0_lane, b0_lane, kk);
        load_frags<MI, NJ, A_T, B_T, PA, PB>(a_frag[1], b_frag[1], a1_lane, b1_lane, kk);
        mma_frags<E, MI, NJ>(c0, a_frag[0], b_frag[0]);
        mma_frags<E, MI, NJ>(c1, a_frag[1], b_frag[1]);
    }
}

// x, but unknown to the compiler: values derived from it inside a loop are not hoisted out
__device__ __forceinline__ int opaque_int(int x) {
    int r; asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x)); return r;
}

// =============================================================================================
// flash_bwd's phases (one key tile, warp w: 16 keys key0.., dK / dV columns col0..; in the m16n8
// accumulator layout, lane rows g, g + 8 and column pair 2t, 2t + 1)
// =============================================================================================

// The dK, dV epilogue: [16 keys, DW] of this warp to global memory in E (zeros when no query
// sees the tile)
template <typename E, int DW>
__device__ __forceinline__ void bwd_store_dkdv(const Params& p, const Acc<E> (&dk_frag)[DW / 8][4],
                                               const Acc<E> (&dv_frag)[DW / 8][4], int batch,
                                               int head_k, i64 k_tok0, int n0, int key0, int col0,
                                               int g, int t, int s_k) {
    typedef typename Elem<E>::storage S;
    S* dk_gmem = (S*)p.dk + batch * p.dk_stride_b + head_k * p.dk_stride_h + k_tok0 * p.dk_stride_s;   // [s_k, d]
    S* dv_gmem = (S*)p.dv + batch * p.dv_stride_b + head_k * p.dv_stride_h + k_tok0 * p.dv_stride_s;   // [s_k, d_v]
#pragma unroll
    for (int j = 0; j < DW / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = n0 + key0 + g + (e >> 1) * 8, c = col0 + j * 8 + 2 * t + (e & 1);
            if (key < s_k) {
                if (c < p.d) dk_gmem[(i64)key * p.dk_stride_s + c] = from_acc<E>(dk_frag[j][e]);
                if (c < p.d_v) dv_gmem[(i64)key * p.dv_stride_s + c] = from_acc<E>(dv_frag[j][e]);
            }
        }
}

// dQ[m tile] += dS K: [16 queries, DQW] per warp (rows qrow0.., columns qcol0..) from dSᵀ in
// shared memory [BN keys, PDS], added into the Acc<E> accumulator in global memory
template <typename E, int BN, int DQW, int PDS, int PR>
__device__ __forceinline__ void bwd_add_dq(const Params& p, const typename Elem<E>::storage* dst_smem,
                                           const typename Elem<E>::storage* k_smem, int qrow0,
                                           int qcol0, int lane, int g, int t, int lse_b, int head,
                                           i64 q_tok0, int m0, int s_q) {
    typedef Acc<E> A;
    A dq_frag[DQW / 8][4];
#pragma unroll
    for (int j = 0; j < DQW / 8; ++j) dq_frag[j][0] = dq_frag[j][1] = dq_frag[j][2] = dq_frag[j][3] = A(0);
    mma_tn<E, BN, DQW, PDS, PR>(dq_frag, dst_smem + qrow0, k_smem + qcol0, lane, p.d - qcol0);
    A* dq_gmem = (A*)p.dq_accum + (p.deterministic ? (i64)blockIdx.x * p.dq_accum_slab : 0)
                     + (((i64)lse_b * p.h + head) * p.s_q + q_tok0 + m0) * p.d;   // [s_q − m0, d]
    // float32 with even d: column pairs (c, c + 1) as one 8-byte reduction (red_add_pair)
    const bool pairs = !is_f64<E> && (p.d & 1) == 0;
#pragma unroll
    for (int j = 0; j < DQW / 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = qrow0 + g + half * 8, c = qcol0 + j * 8 + 2 * t;
            if (m0 + r >= s_q) continue;
            // deterministic: this block's slab, and this lane adds these elements in every
            // key tile: one writer, whose reductions to one address apply in program order
            A* dst = dq_gmem + (i64)r * p.d + c;
            const A x = dq_frag[j][2 * half], y = dq_frag[j][2 * half + 1];
            if constexpr (!is_f64<E>) {
                if (pairs) {
                    if (c < p.d) red_add_pair(dst, x, y);
                    continue;
                }
            }
            if (c < p.d) red_add(dst, x);
            if (c + 1 < p.d) red_add(dst + 1, y);
        }
}

// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ of this warp's 16 keys (from key0) and the step's BM queries, from zero
template <typename E, int D, int BM, int PR>
__device__ __forceinline__ void bwd_s_dp(Acc<E> (&dp_frag)[BM / 8][4], Acc<E> (&s_frag)[BM / 8][4],
                                         const Params& p, const typename Elem<E>::storage* k_smem,
                                         const typename Elem<E>::storage* v_smem,
                                         const typename Elem<E>::storage* qb_smem,
                                         const typename Elem<E>::storage* dob_smem, int key0,
                                         int lane) {
    typedef Acc<E> A;
    // dPᵀ = V dOᵀ   [16 keys, BM queries]
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) dp_frag[j][0] = dp_frag[j][1] = dp_frag[j][2] = dp_frag[j][3] = A(0);
    mma_nt<E, BM, D, PR, PR>(dp_frag, v_smem + key0 * PR, dob_smem, lane, p.d_v);

    // Sᵀ = K Qᵀ   [16 keys, BM queries]
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) s_frag[j][0] = s_frag[j][1] = s_frag[j][2] = s_frag[j][3] = A(0);
    mma_nt<E, BM, D, PR, PR>(s_frag, k_smem + key0 * PR, qb_smem, lane, p.d);
}

// dV += Pᵀ dO and dK += dSᵀ Q [16 keys, DW] of this warp (Pᵀ, dSᵀ: its s_frag, dp_frag), and
// dSᵀ to shared memory [BN keys, BM queries] for dQ (by the warps owning column 0)
template <typename E, int BM, int DW, int PR, int PDS>
__device__ __forceinline__ void bwd_dkdv_dst(Acc<E> (&dv_frag)[DW / 8][4], Acc<E> (&dk_frag)[DW / 8][4],
                                             const Acc<E> (&s_frag)[BM / 8][4],
                                             const Acc<E> (&dp_frag)[BM / 8][4], const Params& p,
                                             typename Elem<E>::storage* dst_smem,
                                             const typename Elem<E>::storage* qb_smem,
                                             const typename Elem<E>::storage* dob_smem, int key0,
                                             int col0, int lane, int g, int t) {
    typedef typename Elem<E>::storage S;
    // dV += Pᵀ dO   [16 keys, DW]
    mma_rn<E, BM, DW, PR>(dv_frag, s_frag, dob_smem + col0, lane, p.d_v - col0);
    // dK += dSᵀ Q   [16 keys, DW]
    mma_rn<E, BM, DW, PR>(dk_frag, dp_frag, qb_smem + col0, lane, p.d - col0);

    // dSᵀ to shared memory [BN keys, BM queries] (rounded to E like the dK operand)
    if (col0 == 0) {
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                S* dst = dst_smem + (key0 + g + half * 8) * PDS + j * 8 + 2 * t;
                if constexpr (Elem<E>::is16) {
                    *(u32*)dst = pack2<E>(dp_frag[j][2 * half], dp_frag[j][2 * half + 1]);
                } else {   // float32 / float64 pair
                    *(typename Vec2<S>::type*)dst = vec2<S>(dp_frag[j][2 * half], dp_frag[j][2 * half + 1]);
                }
            }
    }
}

// =============================================================================================
// flash_bwd_2d's phases (one key tile, 16-bit types; warp tiles as described in portable/bwd.cu)
// =============================================================================================

// The dK, dV epilogue: [KN keys, KD columns] of this warp (first key kv_r0, column kv_c0) to
// global memory in E (zeros when no query sees the tile)
template <typename E, int KN, int KD>
__device__ __forceinline__ void bwd2d_store_dkdv(const Params& p, const float (&dk_frag)[KN / 16][KD / 8][4],
                                                 const float (&dv_frag)[KN / 16][KD / 8][4],
                                                 int batch, int head_k, int n0, int kv_r0, int kv_c0,
                                                 int g, int t, int s_k) {
    typedef u16 S;
// dK, dV [KN keys, KD] of this warp to global memory in E (zeros when no query sees the tile)
S* dk_gmem = (S*)p.dk + batch * p.dk_stride_b + head_k * p.dk_stride_h;   // [s_k, d]
S* dv_gmem = (S*)p.dv + batch * p.dv_stride_b + head_k * p.dv_stride_h;   // [s_k, d_v]
#pragma unroll
for (int mi = 0; mi < KN / 16; ++mi)
#pragma unroll
    for (int j = 0; j < KD / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = n0 + kv_r0 + mi * 16 + g + (e >> 1) * 8, c = kv_c0 + j * 8 + 2 * t + (e & 1);
            if (key < s_k) {
                if (c < p.d) dk_gmem[(i64)key * p.dk_stride_s + c] = from_float<E>(dk_frag[mi][j][e]);
                if (c < p.d_v) dv_gmem[(i64)key * p.dv_stride_s + c] = from_float<E>(dv_frag[mi][j][e]);
            }
        }
}

// dQ[m tile] += dS K: [QM queries, QD columns] of this warp (first query q_r0, column q_c0) from
// dS in shared memory [BM, PP], added into the float32 accumulator in global memory
template <typename E, int BN, int QM, int QD, int PP, int PR>
__device__ __forceinline__ void bwd2d_add_dq(const Params& p, const u16* ds_smem, const u16* k_smem,
                                             int q_r0, int q_c0, int lane, int g, int t, int batch,
                                             int head, int m0, int s_q) {
    float dq_frag[QM / 16][QD / 8][4];
#pragma unroll
    for (int mi = 0; mi < QM / 16; ++mi)
#pragma unroll
        for (int j = 0; j < QD / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq_frag[mi][j][e] = 0.f;
    warp_tile_mma<E, QM / 16, QD / 8, BN, false, true, PP, PR>(dq_frag, ds_smem + q_r0 * PP, k_smem + q_c0, lane);
    float* dq_gmem = (float*)p.dq_accum + (p.deterministic ? (i64)blockIdx.x * p.dq_accum_slab : 0)
                     + (((i64)batch * p.h + head) * s_q + m0) * p.d;   // [s_q − m0, d]
    const bool pairs = (p.d & 1) == 0;   // even d: column pairs (c, c + 1) are 8-byte aligned
#pragma unroll
    for (int mi = 0; mi < QM / 16; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = q_r0 + mi * 16 + g + h * 8;
            if (m0 + r >= s_q) continue;
            float* row_gmem = dq_gmem + (i64)r * p.d;   // [d]
#pragma unroll
            for (int j = 0; j < QD / 8; ++j) {
                // deterministic: this block's slab, and this lane adds these elements in every
                // key tile: one writer, whose reductions to one address apply in program order
                const int c = q_c0 + j * 8 + 2 * t;
                const float x = dq_frag[mi][j][2 * h], y = dq_frag[mi][j][2 * h + 1];
                if (pairs) {
                    if (c < p.d) red_add_pair(row_gmem + c, x, y);
                } else {
                    if (c < p.d) red_add(row_gmem + c, x);
                    if (c + 1 < p.d) red_add(row_gmem + c + 1, y);
                }
            }
        }
}

// dV += Pᵀ dO and dK += dSᵀ Q: [KN keys, KD columns] of this warp (first key kv_r0, column
// kv_c0), Pᵀ and dSᵀ read from P, dS [BM, PP] by ldmatrix.trans; PAIR: both in one k loop
template <typename E, int BM, int KN, int KD, int PP, int PR, bool PAIR>
__device__ __forceinline__ void bwd2d_dkdv(float (&dv_frag)[KN / 16][KD / 8][4],
                                           float (&dk_frag)[KN / 16][KD / 8][4], const u16* p_smem,
                                           const u16* ds_smem, const u16* qb_smem,
                                           const u16* dob_smem, int kv_r0, int kv_c0, int lane) {
    if constexpr (PAIR) {
        warp_tile_mma_pair<E, KN / 16, KD / 8, BM, true, true, PP, PR>(
            dv_frag, dk_frag, p_smem + kv_r0, dob_smem + kv_c0, ds_smem + kv_r0, qb_smem + kv_c0, lane);
    } else {
        warp_tile_mma<E, KN / 16, KD / 8, BM, true, true, PP, PR>(dv_frag, p_smem + kv_r0, dob_smem + kv_c0, lane);
        warp_tile_mma<E, KN / 16, KD / 8, BM, true, true, PP, PR>(dk_frag, ds_smem + kv_r0, qb_smem + kv_c0, lane);
    }
}

// P, dS of this warp's tile [SM queries from s_r0, SN keys from s_c0] to shared memory [BM, PP]
// in E (rounded like the naive backward's operands)
template <typename E, int SM, int SN, int PP>
__device__ __forceinline__ void bwd2d_store_p_ds(u16* p_smem, u16* ds_smem,
                                                 const float (&s_frag)[SM / 16][SN / 8][4],
                                                 const float (&dp_frag)[SM / 16][SN / 8][4],
                                                 int s_r0, int s_c0, int g, int t) {
#pragma unroll
    for (int mi = 0; mi < SM / 16; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < SN / 8; ++j) {
                const int off = (s_r0 + mi * 16 + g + h * 8) * PP + s_c0 + j * 8 + 2 * t;
                *(u32*)(p_smem + off) = pack2<E>(s_frag[mi][j][2 * h], s_frag[mi][j][2 * h + 1]);
                *(u32*)(ds_smem + off) = pack2<E>(dp_frag[mi][j][2 * h], dp_frag[mi][j][2 * h + 1]);
            }
}

// S = Q Kᵀ and dP = dO Vᵀ of this warp's tile [SM queries from s_r0, SN keys from s_c0], from
// zero; PAIR: both in one k loop
template <typename E, int D, int SM, int SN, int PR, bool PAIR>
__device__ __forceinline__ void bwd2d_s_dp(float (&s_frag)[SM / 16][SN / 8][4],
                                           float (&dp_frag)[SM / 16][SN / 8][4], const u16* qb_smem,
                                           const u16* k_smem, const u16* dob_smem,
                                           const u16* v_smem, int s_r0, int s_c0, int lane) {
#pragma unroll
    for (int mi = 0; mi < SM / 16; ++mi)
#pragma unroll
        for (int j = 0; j < SN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s_frag[mi][j][e] = dp_frag[mi][j][e] = 0.f;
    if constexpr (PAIR) {
        warp_tile_mma_pair<E, SM / 16, SN / 8, D, false, false, PR, PR>(
            s_frag, dp_frag, qb_smem + s_r0 * PR, k_smem + s_c0 * PR, dob_smem + s_r0 * PR, v_smem + s_c0 * PR, lane);
    } else {
        warp_tile_mma<E, SM / 16, SN / 8, D, false, false, PR, PR>(s_frag, qb_smem + s_r0 * PR, k_smem + s_c0 * PR, lane);
        warp_tile_mma<E, SM / 16, SN / 8, D, false, false, PR, PR>(dp_frag, dob_smem + s_r0 * PR, v_smem + s_c0 * PR, lane);
    }
}

// =============================================================================================
// flash_bwd_dbias's phases
// =============================================================================================

// The dbias tile's store: Σ dS [16 queries, BN keys] of this warp (acc) into plane (pb, ph) of
// p.dbias in the bias's type; a lane's two keys 2t, 2t + 1 as one store where dbias rows are
// contiguous with even s_k
template <typename E, int BN>
__device__ __forceinline__ void dbias_store_tile(const Params& p, const float (&acc)[BN / 8][4],
                                                 int tid, int pb, int ph, int m0, int n0, int s_q,
                                                 int s_k) {
    typedef typename Elem<E>::storage S;
const int warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
char* out = (char*)p.dbias + (pb * p.dbias_stride_b + ph * p.dbias_stride_h) * (p.bias_f32 ? 4 : (i64)sizeof(S));
const bool pairs_ok = p.dbias_stride_k == 1 && s_k % 2 == 0;
#pragma unroll
for (int half = 0; half < 2; ++half) {
    const int row = m0 + warp * 16 + g + half * 8;
    if (row >= s_q) continue;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int key = n0 + j * 8 + 2 * t;   // even
        const float v0 = acc[j][2 * half], v1 = acc[j][2 * half + 1];
        const i64 off = (i64)row * p.dbias_stride_q + (i64)key * p.dbias_stride_k;
        if (pairs_ok) {
            if (key < s_k) {
                if (p.bias_f32) *(float2*)((float*)out + off) = make_float2(v0, v1);
                else if constexpr (Elem<E>::is16) *(u32*)((S*)out + off) = pack2<E>(v0, v1);
                else *(float2*)((S*)out + off) = make_float2(v0, v1);
            }
        } else {
#pragma unroll
            for (int c = 0; c < 2; ++c)
                if (key + c < s_k) {
                    const i64 o = off + c * p.dbias_stride_k;
                    if (p.bias_f32) ((float*)out)[o] = c ? v1 : v0;
                    else ((S*)out)[o] = from_float<E>(c ? v1 : v0);
                }
        }
    }
}
}

// S = Q Kᵀ and dP = dO Vᵀ [16 queries (from warp · 16), BN keys] of this warp, from zero
template <typename E, int D, int BN, int PR>
__device__ __forceinline__ void dbias_s_dp(float (&s_frag)[1][BN / 8][4], float (&dp_frag)[BN / 8][4],
                                           const Params& p, const typename Elem<E>::storage* q_smem,
                                           const typename Elem<E>::storage* k_smem,
                                           const typename Elem<E>::storage* do_smem,
                                           const typename Elem<E>::storage* v_smem, int warp,
                                           int lane) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_frag[0][j][e] = dp_frag[j][e] = 0.f;
    mma_nt<E, BN, D, PR, PR>(s_frag[0], q_smem + warp * 16 * PR, k_smem, lane, p.d);
    mma_nt<E, BN, D, PR, PR>(dp_frag, do_smem + warp * 16 * PR, v_smem, lane, p.d_v);
}
