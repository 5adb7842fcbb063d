// cupyflash: the portable forward's parts (flash_fwd in portable/fwd.cu wires them): shared-memory
// pitches (Pitch), the tile copies (load_tile), the products S = Q Kᵀ (gemm_qk) and O += P V
// (gemm_pv), and the epilogue (fwd_epilogue: O / l and lse, the O tile's coalesced store).
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/score.cuh"
#include "common/tile_copy.cuh"
#include "common/types.cuh"

// Unroll of the k loop of S = Q Kᵀ: 1 for 16-bit types at D <= 64, else 2 (the next step's loads
// overlap this step's products without hoisting every load; measured, docs/kernels.md).
// Tuning builds may pass -DQK_UNROLL=n.
#ifndef QK_UNROLL
#define QK_UNROLL ((Elem<E>::is16 && D <= 64) || is_f64<E> ? 1 : 2)
#endif

// Shared-memory row pitch in elements. Rows are padded by 16 bytes (16-bit types) or 32 / 16
// bytes (float32 Q,K / V) instead of an XOR swizzle: every bucket (also 96, 160, 224, which a
// 128-byte XOR swizzle cannot tile) then reads conflict-free with ldmatrix / the float32
// fragment loads, and cp.async destinations stay 16-byte aligned.
// float64: Q / K rows padded by 64 bytes (the 16-byte pair loads of rows g, g + 1 fall in
// different bank halves), V rows by 16 bytes (the scalar loads of rows 2t hit distinct banks).
// OCols: the O accumulator's columns (float64 above 128 columns would need more than 255
// registers: the launcher runs such a d_v in 128-column pieces, each its own launch).
template <typename E, int D> struct Pitch {
    static constexpr bool is16 = Elem<E>::is16;
    static constexpr int QK = is16 ? D + 8 : D + 8;
    static constexpr int OCols = is_f64<E> && D > 128 ? 128 : D;
    static constexpr int V = is16 ? D + 8 : (is_f64<E> ? OCols + 2 : D + 4);
};

// Copy a [ROWS, D] tile (rows row0.., columns < cols_valid) from global to shared memory with
// NT threads, one 16-byte chunk per thread and pass. Rows >= rows_valid and columns >=
// cols_valid are zero-filled. When NT is a multiple of the chunks per row, each thread keeps one
// column and walks rows with a fixed pointer step (few live registers inside the K/V loop).
template <int ROWS, int D, int PITCH, int NT, typename S>
__device__ __forceinline__ void load_tile(S* tile_smem,            // [ROWS, PITCH]
                                          const S* tile_gmem,      // [rows_valid, ., cols_valid]
                                          i64 row_stride, int rows_valid, int cols_valid,
                                          bool vec_ok, const void* safe_gmem, int tid) {
    constexpr int CH = 16 / sizeof(S);           // elements per 16-byte chunk
    constexpr int CPR = D / CH;                  // chunks per row
    constexpr int CHUNKS = ROWS * CPR;
    if constexpr (NT % CPR == 0 && ROWS % (NT / CPR) == 0) {
        constexpr int RS = NT / CPR;             // rows per pass
        const int r0 = tid / CPR, col = (tid % CPR) * CH;
        const S* src = tile_gmem + r0 * row_stride + col;
        S* dst = tile_smem + r0 * PITCH + col;
        int valid_col = cols_valid - col;
        valid_col = valid_col < 0 ? 0 : (valid_col > CH ? CH : valid_col);
#pragma unroll
        for (int i = 0; i < ROWS / RS; ++i) {
            const int valid = (r0 + i * RS < rows_valid) ? valid_col : 0;
            if (vec_ok) {
                cp_async_16(dst + i * RS * PITCH, valid ? (const void*)src : safe_gmem, valid * (int)sizeof(S));
            } else {   // unaligned rows (odd strides or head dims): element copies
#pragma unroll
                for (int e = 0; e < CH; ++e) dst[i * RS * PITCH + e] = e < valid ? src[e] : S(0);
            }
            src += RS * row_stride;
        }
    } else {
        // float64 tiles of many chunks per thread: a partial unroll (full unroll hoists every
        // chunk's address into registers, which the float64 O accumulator needs)
        constexpr int ITERS = (CHUNKS + NT - 1) / NT;
        copy_chunks<ROWS, D, PITCH, NT, (sizeof(S) == 8 && ITERS > 4 ? 4 : ITERS)>(
            tile_smem, tile_gmem, row_stride, rows_valid, cols_valid, vec_ok, safe_gmem, tid);
    }
}

// S[mt][j] (+)= Q[warp rows] K[j*8 .. j*8+7]ᵀ over the first d columns.
template <typename E, int D, int BN, int MT>
__device__ __forceinline__ void gemm_qk(Acc<E> (&s_frag)[MT][BN / 8][4],
                                        const typename Elem<E>::storage* q_smem,  // [BM, QK pitch], this warp's first row
                                        const typename Elem<E>::storage* k_smem,  // [BN, QK pitch]
                                        int lane, int d) {
    constexpr int P = Pitch<E, D>::QK;
    if constexpr (Elem<E>::is16) {
#pragma unroll QK_UNROLL
        for (int kk = 0; kk < D / 16; ++kk) {
            {
                u32 q_frag[MT][4];                   // A: 16 rows x 16 cols of Q per slab
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(q_frag[mt], q_smem + (mt * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int nn = 0; nn < BN / 16; ++nn) {
                    u32 k_frag[4];                   // B: keys nn*16.., two n8 tiles x k16
                    ldmatrix_x4(k_frag, k_smem + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * P
                                            + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<E>(s_frag[mt][2 * nn], q_frag[mt], k_frag[0], k_frag[1]);
                        mma16816<E>(s_frag[mt][2 * nn + 1], q_frag[mt], k_frag[2], k_frag[3]);
                    }
                }
            }
        }
    } else {
        // float32 / float64, m16n8k8: the k index of both operands is permuted the same way
        // inside each 8-column step (logical t <-> column 2t, t+4 <-> 2t+1), so one 8-byte
        // (float) or 16-byte (double) load gives a pair.
        typedef typename Elem<E>::storage S;
        typedef typename Vec2<S>::type S2;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll QK_UNROLL
        for (int kk = 0; kk < D / 8; ++kk) {
            {
                S q_frag[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const S2 lo = *(const S2*)(q_smem + (mt * 16 + g) * P + kk * 8 + 2 * t);
                    const S2 hi = *(const S2*)(q_smem + (mt * 16 + g + 8) * P + kk * 8 + 2 * t);
                    q_frag[mt][0] = lo.x; q_frag[mt][1] = hi.x; q_frag[mt][2] = lo.y; q_frag[mt][3] = hi.y;
                }
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const S2 kb = *(const S2*)(k_smem + (j * 8 + g) * P + kk * 8 + 2 * t);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        mma_k8<E>(s_frag[mt][j], q_frag[mt], kb.x, kb.y);
                }
            }
        }
    }
}

// O[mt] += P[mt] V over the first d_v columns (of DO); P is the S accumulator after softmax.
template <typename E, int D, int DO, int BN, int MT>
__device__ __forceinline__ void gemm_pv(Acc<E> (&o_frag)[MT][DO / 8][4], Acc<E> (&s_frag)[MT][BN / 8][4],
                                        const typename Elem<E>::storage* v_smem,  // [BN, V pitch]
                                        int lane, int d_v) {
    constexpr int P = Pitch<E, D>::V;
    if constexpr (Elem<E>::is16) {
        // A operand = P, packed to 16-bit pairs first (halves the live registers of S)
        u32 p_frag[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                p_frag[mt][kk][0] = pack2<E>(s_frag[mt][2 * kk][0], s_frag[mt][2 * kk][1]);
                p_frag[mt][kk][1] = pack2<E>(s_frag[mt][2 * kk][2], s_frag[mt][2 * kk][3]);
                p_frag[mt][kk][2] = pack2<E>(s_frag[mt][2 * kk + 1][0], s_frag[mt][2 * kk + 1][1]);
                p_frag[mt][kk][3] = pack2<E>(s_frag[mt][2 * kk + 1][2], s_frag[mt][2 * kk + 1][3]);
            }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int dd = 0; dd < DO / 16; ++dd) {
                u32 v_frag[4];   // B: keys kk*16.. x columns dd*16.. (transposed load)
                ldmatrix_x4_trans(v_frag, v_smem + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * P
                                              + dd * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<E>(o_frag[mt][2 * dd], p_frag[mt][kk], v_frag[0], v_frag[1]);
                    mma16816<E>(o_frag[mt][2 * dd + 1], p_frag[mt][kk], v_frag[2], v_frag[3]);
                }
            }
        }
    } else {
        // float32 / float64, m16n8k8: one key step = one S n8 tile; logical k t <-> key 2t,
        // t+4 <-> 2t+1, so the accumulator registers are the A operand as they stand.
        typedef Acc<E> A;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            A p_frag[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                p_frag[mt][0] = s_frag[mt][j][0]; p_frag[mt][1] = s_frag[mt][j][2];
                p_frag[mt][2] = s_frag[mt][j][1]; p_frag[mt][3] = s_frag[mt][j][3];
            }
#pragma unroll
            for (int dn = 0; dn < DO / 8; ++dn) {
                if (dn * 8 < d_v) {
                    const A vb0 = v_smem[(j * 8 + 2 * t) * P + dn * 8 + g];
                    const A vb1 = v_smem[(j * 8 + 2 * t + 1) * P + dn * 8 + g];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma_k8<E, true>(o_frag[mt][dn], p_frag[mt], vb0, vb1);
                }
            }
        }
    }
}

// The key loop: the key range of this tile, the per-lane state (o_frag, m_row, l_row, sl2), then
// the Q tile and the key tiles of the range from the last down, each through the K / V buffers
// (cp.async), S = Q Kᵀ, score modifications, masks, the online softmax and O += P V.
template <typename E, int D, int BM, int BN, int NW, int KSTAGES, bool WINDOW, bool SCORE_MOD, int GENERAL>
__device__ __forceinline__ void fwd_mainloop(
        const Params& p, typename Elem<E>::storage* q_smem, typename Elem<E>::storage* k_smem0,
        typename Elem<E>::storage* v_smem, const typename Elem<E>::storage* q_gmem,
        const typename Elem<E>::storage* k_gmem, const typename Elem<E>::storage* v_gmem, const void* bias_gmem,
        const unsigned char* mask_gmem, int tid, int warp_row0, int lane, int g, int t, int batch, int head, int m0,
        int m_rows, int s_q, int s_k, int diag_offset, Acc<E>& sl2,
        Acc<E> (&o_frag)[BM / (16 * NW)][Pitch<E, D>::OCols / 8][4], Acc<E> (&m_row)[BM / (16 * NW)][2],
        Acc<E> (&l_row)[BM / (16 * NW)][2]) {
    constexpr bool BIAS_MASK = GENERAL & GEN_BIAS_MASK;
    typedef typename Elem<E>::storage S;
    typedef Acc<E> A;
    constexpr int NT = NW * 32;
    constexpr int MT = BM / (16 * NW);            // 16-row slabs per warp
    constexpr int DO = Pitch<E, D>::OCols;        // O columns (p.d_v <= DO)
    constexpr int PQK = Pitch<E, D>::QK, PV = Pitch<E, D>::V;

    // Key range any row of this tile can see: [n_lo, n_hi)
    int n_lo = 0, n_hi = s_k;
    if (WINDOW) {
        n_lo = max(0, m0 + diag_offset - p.window_left);
        n_hi = min(s_k, m0 + m_rows - 1 + diag_offset + p.window_right + 1);
    }
    const bool any_key = n_hi > n_lo;
    const int nb_min = n_lo / BN;
    const int nb_max = any_key ? (n_hi + BN - 1) / BN : nb_min;

    // Per-lane state. Row r of slab mt: warp * MT * 16 + mt * 16 + g (+8 for the second half).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < DO / 8; ++j) o_frag[mt][j][0] = o_frag[mt][j][1] = o_frag[mt][j][2] = o_frag[mt][j][3] = A(0);
        m_row[mt][0] = m_row[mt][1] = -CF_INF;
        l_row[mt][0] = l_row[mt][1] = A(0);
    }
    // SCORE_MOD turns scores into base-2 units before the max; otherwise fold scale into exp2.
    sl2 = SCORE_MOD ? A(1) : scale_log2_of<A>(p);
    A slope_log2 = A(0);                           // ALiBi slope in base-2 units
    if (SCORE_MOD) slope_log2 = alibi_slope_log2<A>(p, batch, head);

    if (nb_max > nb_min) {
        // Q tile and the last K tile in flight
        load_tile<BM, D, PQK, NT>(q_smem, q_gmem, p.q_stride_s, m_rows, p.d, p.vec_ok, p.q, tid);
        {
            const int n0 = (nb_max - 1) * BN;
            load_tile<BN, D, PQK, NT>(k_smem0, k_gmem + (i64)n0 * p.k_stride_s, p.k_stride_s, s_k - n0, p.d, p.vec_ok, p.k, tid);
        }
        cp_async_commit();

        for (int nb = nb_max - 1; nb >= nb_min; --nb) {
            const int n0 = nb * BN;
            const int it = nb_max - 1 - nb;        // iteration count; K(nb) sits in buffer it % KSTAGES
            S* k_smem = k_smem0 + (KSTAGES == 2 ? (it & 1) * BN * PQK : 0);   // [BN, PQK]
            cp_async_wait<0>();
            __syncthreads();   // K(nb) (and Q) landed for all threads; every warp finished PV on the V
                               // buffer and S on the other K buffer
            load_tile<BN, DO, PV, NT>(v_smem, v_gmem + (i64)n0 * p.v_stride_s, p.v_stride_s, s_k - n0, p.d_v, p.vec_ok, p.v, tid);
            cp_async_commit();
            if (KSTAGES == 2) {   // K(nb-1) into the other buffer: a whole iteration to land
                if (nb > nb_min) {
                    const int n1 = n0 - BN;
                    load_tile<BN, D, PQK, NT>(k_smem0 + ((it + 1) & 1) * BN * PQK, k_gmem + (i64)n1 * p.k_stride_s,
                                              p.k_stride_s, s_k - n1, p.d, p.vec_ok, p.k, tid);
                }
                cp_async_commit();   // (possibly empty) group, so the wait below counts right
            }

            // S = Q K(nb)ᵀ   [16 rows, BN] per slab, fp32
            A s_frag[MT][BN / 8][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) s_frag[mt][j][0] = s_frag[mt][j][1] = s_frag[mt][j][2] = s_frag[mt][j][3] = A(0);
            gemm_qk<E, D, BN, MT>(s_frag, q_smem + warp_row0 * PQK, k_smem, lane, p.d);

            // Score modifications, in base-2 units: softcap c·tanh(s/c), + bias, ALiBi −slope·|diag − j|
            if constexpr (BIAS_MASK) {
                // (& rather than &&, here and in the window test below: p is a reference here, and
                // with && the compiler kept branches / inverted compares the inline kernel had not)
                if ((bias_gmem != nullptr) & (p.bias_f32 != 0))
                    score_mod_tile<E, true, float, BN, MT>(s_frag, p, (const float*)bias_gmem, slope_log2,
                                                          m0 + warp_row0, n0, g, t, s_q, s_k, diag_offset);
                else if (bias_gmem)
                    score_mod_tile<E, true, S, BN, MT>(s_frag, p, (const S*)bias_gmem, slope_log2,
                                                      m0 + warp_row0, n0, g, t, s_q, s_k, diag_offset);
                else
                    score_mod_tile<E, false, S, BN, MT>(s_frag, p, nullptr, slope_log2,
                                                       m0 + warp_row0, n0, g, t, s_q, s_k, diag_offset);
            } else if constexpr (SCORE_MOD) {
                score_mod_tile<E, false, S, BN, MT>(s_frag, p, nullptr, slope_log2,
                                                   m0 + warp_row0, n0, g, t, s_q, s_k, diag_offset);
            }

            // Mask only the tiles that need it: the ragged last tile, window / causal edges, and
            // every tile when a boolean mask is given
            const bool need_mask = (n0 + BN > s_k) || (BIAS_MASK && mask_gmem) ||
                (WINDOW && (n0 + BN - 1 > m0 + diag_offset + p.window_right ||
                            n0 < m0 + m_rows - 1 + diag_offset - p.window_left));
            if (need_mask) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int row = m0 + warp_row0 + mt * 16 + g + (e >> 1) * 8;
                            const int col = n0 + j * 8 + 2 * t + (e & 1);
                            const int diag = row + diag_offset;
                            bool keep = col < s_k;
                            if (WINDOW) keep = keep & (col >= diag - p.window_left) & (col <= diag + p.window_right);
                            if (BIAS_MASK && mask_gmem)   // boolean mask [row, col] (clamped like the bias)
                                keep = keep && mask_gmem[(i64)min(row, s_q - 1) * p.mask_stride_q
                                                         + (i64)min(col, s_k - 1) * p.mask_stride_k];
                            if (!keep) s_frag[mt][j][e] = -CF_INF;
                        }
            }

            if (KSTAGES == 2) {
                cp_async_wait<1>();   // V(nb) complete; K(nb-1) may still be in flight
                __syncthreads();      // V(nb) landed for all threads
            } else {
                cp_async_wait<0>();
                __syncthreads();      // V(nb) landed for all threads; every warp finished reading K(nb)
                if (nb > nb_min) {
                    const int n1 = n0 - BN;
                    load_tile<BN, D, PQK, NT>(k_smem, k_gmem + (i64)n1 * p.k_stride_s, p.k_stride_s, s_k - n1, p.d, p.vec_ok, p.k, tid);
                }
                cp_async_commit();
            }

            // Online softmax per row: running max m, rescale O and l by 2^(m_old − m_new), P = 2^(s − m)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    A mx = m_row[mt][half];
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j)
                        mx = max_acc(mx, max_acc(s_frag[mt][j][2 * half], s_frag[mt][j][2 * half + 1]));
                    mx = quad_max(mx);                                   // row max over the 4 lanes
                    const A m_scaled = mx == -CF_INF ? A(0) : mx * sl2;   // fully masked so far: avoid inf − inf
                    const A alpha = exp2_acc(m_row[mt][half] * sl2 - m_scaled);  // O, l rescale
                    m_row[mt][half] = mx;
                    A row_sum = A(0);
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j) {
                        const A p0 = exp2_acc(s_frag[mt][j][2 * half] * sl2 - m_scaled);
                        const A p1 = exp2_acc(s_frag[mt][j][2 * half + 1] * sl2 - m_scaled);
                        s_frag[mt][j][2 * half] = p0;
                        s_frag[mt][j][2 * half + 1] = p1;
                        row_sum += p0 + p1;
                    }
                    l_row[mt][half] = l_row[mt][half] * alpha + row_sum;   // denominator l (this lane's part)
#pragma unroll
                    for (int j = 0; j < DO / 8; ++j) {
                        o_frag[mt][j][2 * half] *= alpha;
                        o_frag[mt][j][2 * half + 1] *= alpha;
                    }
                }

            // O += P V(nb)
            gemm_pv<E, D, DO, BN, MT>(o_frag, s_frag, v_smem, lane, p.d_v);
        }
    }
}

// The epilogue's first half, after the key loop: each warp's rows O / l into shared memory (over
// the Q tile: o_smem) and their lse (the coalesced store of the O tile stays in the kernel: as a
// part of its own it reassociated the store address differently).
template <typename E, int D, int BM, int NW>
__device__ __forceinline__ void fwd_finish_rows(typename Elem<E>::storage* q_smem,
                                                Acc<E>* lse_gmem, int warp_row0, int g, int t, int m_rows,
                                                Acc<E> sl2,
                                                const Acc<E> (&o_frag)[BM / (16 * NW)][Pitch<E, D>::OCols / 8][4],
                                                const Acc<E> (&m_row)[BM / (16 * NW)][2],
                                                const Acc<E> (&l_row)[BM / (16 * NW)][2]) {
    typedef typename Elem<E>::storage S;
    typedef Acc<E> A;
    constexpr int MT = BM / (16 * NW);            // 16-row slabs per warp
    constexpr int DO = Pitch<E, D>::OCols;        // O columns (p.d_v <= DO)
    constexpr int PQK = Pitch<E, D>::QK;
    // Final O / l and lse = (m·scale + log2 l)·ln 2; rows with no key give O = 0, lse = −inf.
    S* o_smem = q_smem;   // [BM, PQK]; this warp only touches its own rows, which only it read as Q
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const A l = quad_sum(l_row[mt][half]);
            const A inv_l = l > A(0) ? A(1) / l : A(0);
            const int r = warp_row0 + mt * 16 + g + half * 8;
            if (t == 0 && r < m_rows)
                lse_gmem[r] = l > A(0) ? (m_row[mt][half] * sl2 + log2_acc(l)) * ln2<A>() : -CF_INF;
#pragma unroll
            for (int j = 0; j < DO / 8; ++j) {
                o_smem[r * PQK + j * 8 + 2 * t] = from_acc<E>(o_frag[mt][j][2 * half] * inv_l);
                o_smem[r * PQK + j * 8 + 2 * t + 1] = from_acc<E>(o_frag[mt][j][2 * half + 1] * inv_l);
            }
        }
}
