// cupyflash: score transforms in docs/semantics.md §2 order (scale or softcap, bias, ALiBi),
// shared by the portable forward, backward and dbias kernels.
#pragma once

#include "common/mask.cuh"
#include "common/params.cuh"

// One score through the docs/semantics.md §2 pipeline, in base-2 units: s = scale·qk, softcap
// c·tanh(s/c), ALiBi −slope·|diag − col| with diag = row + diag_offset. Masks (and a bias) are
// applied by the caller. *ds_dqk receives
// d s / d(qk) in natural units: scale, times 1 − tanh²(s/c) under softcap.
template <bool SCORE_MOD, typename A>
__device__ __forceinline__ A score_log2(A qk, const Params& p, A slope_log2, int row,
                                        int col, int diag_offset, A scale, A* ds_dqk) {
    if (!SCORE_MOD) { *ds_dqk = scale; return qk * scale_log2_of<A>(p); }
    A s;
    if (p.softcap_post > 0.f) {   // softcap on (softcap_pre may be negative with a negative scale)
        const A th = tanh_acc(qk * softcap_pre_of<A>(p));
        s = softcap_post_of<A>(p) * th;
        *ds_dqk = scale * (A(1) - th * th);
    } else {
        s = qk * scale_log2_of<A>(p);
        *ds_dqk = scale;
    }
    return s - slope_log2 * abs_as(row + diag_offset - col, A());
}

// ---------------------------------------------------------------------------------------------
// The score of element (row, key) as the backward recomputes it, in base-2 units: score_log2 of
// the raw product qk, + bias[row, key]·log2(e), −inf where masked (key past s_k, outside the
// window, mask false; checked only when need_mask). *ds_dqk as score_log2's.
// bias_plane / mask_plane: the [s_q, s_k] planes of this (batch, head), or null.
// ---------------------------------------------------------------------------------------------
template <typename E, bool WINDOW, bool SCORE_MOD, bool GENERAL>
__device__ __forceinline__ Acc<E> bwd_score(Acc<E> qk, const Params& p, Acc<E> slope_log2, int row,
                                            int key, int s_q, int s_k, int diag_offset, Acc<E> scale,
                                            const char* bias_plane, const unsigned char* mask_plane,
                                            bool need_mask, Acc<E>* ds_dqk) {
    typedef typename Elem<E>::storage S;
    typedef Acc<E> A;
    A s = score_log2<SCORE_MOD>(qk, p, slope_log2, row, key, diag_offset, scale, ds_dqk);
    if (GENERAL && bias_plane) {   // s += bias[row, key] · log2(e) (clamped past the ends: dropped anyway)
        const i64 off = (i64)min(row, s_q - 1) * p.bias_stride_q + (i64)min(key, s_k - 1) * p.bias_stride_k;
        const A bv = p.bias_f32 ? (A)((const float*)bias_plane)[off] : to_acc<E>(((const S*)bias_plane)[off]);
        s = fma_acc(bv, log2e<A>(), s);
    }
    if (need_mask && !score_kept<WINDOW>(p, GENERAL ? mask_plane : nullptr, row, key, s_q, s_k, diag_offset))
        s = -CF_INF;
    return s;
}

// A whole S tile (m16n8 accumulator layout; flash_fwd and flash_bwd_dbias).
// Scores of one S tile moved to base-2 units in place, in docs/semantics.md §2 order: scale·qk or softcap
// c·tanh(scale·qk / c), + bias (HAS_BIAS; BT = the bias element type), − ALiBi slope·|diag − j|.
// Each step is one pass over the registers behind a block-uniform branch (a step that is off
// costs nothing per score). bias_gmem: the [s_q, s_k] bias plane of this (batch, head) with
// element strides p.bias_stride_q / _k; rows / columns past the sequence are clamped to its last
// ones (their scores are dropped by the caller: rows never stored, columns masked). With
// p.bias_pair (unit key stride, even s_k, 4-byte aligned pairs: set by the launcher) each lane
// reads its two adjacent columns in one load.
template <typename E, bool HAS_BIAS, typename BT, int BN, int MT, typename A>
__device__ __forceinline__ void score_mod_tile(A (&s_frag)[MT][BN / 8][4], const Params& p,
                                               const BT* bias_gmem,   // [s_q, s_k] (strided)
                                               A slope_log2, int row0, int n0, int g, int t,
                                               int s_q, int s_k, int diag_offset) {
    // s = softcap·tanh(qk·scale / softcap), or s = qk·scale, in base-2 units
    if (p.softcap_post > 0.f) {   // softcap on (softcap_pre is negative with a negative scale)
        const A pre = softcap_pre_of<A>(p), post = softcap_post_of<A>(p);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_frag[mt][j][e] = post * tanh_acc(s_frag[mt][j][e] * pre);
    } else {
        const A sl2 = scale_log2_of<A>(p);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_frag[mt][j][e] *= sl2;
    }
    // s += bias[row, col] · log2(e)
    if constexpr (HAS_BIAS) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = min(row0 + mt * 16 + g + half * 8, s_q - 1);
                const BT* row_gmem = bias_gmem + (i64)row * p.bias_stride_q;   // [s_k] (strided)
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int col = n0 + j * 8 + 2 * t;                        // even
                    A b0, b1;
                    if (p.bias_pair) {   // columns col, col + 1 in one load (s_k even: both in the row)
                        const int c = min(col, s_k - 2);
                        if constexpr (sizeof(BT) == 8) {
                            const double2 v = *(const double2*)(row_gmem + c);
                            b0 = v.x; b1 = v.y;
                        } else if constexpr (sizeof(BT) == 4) {
                            const float2 v = *(const float2*)(row_gmem + c);
                            b0 = v.x; b1 = v.y;
                        } else {
                            const u32 v = *(const u32*)(row_gmem + c);
                            b0 = to_float<E>((BT)(v & 0xffffu)); b1 = to_float<E>((BT)(v >> 16));
                        }
                    } else {
                        const BT v0 = row_gmem[(i64)min(col, s_k - 1) * p.bias_stride_k];
                        const BT v1 = row_gmem[(i64)min(col + 1, s_k - 1) * p.bias_stride_k];
                        if constexpr (sizeof(BT) >= 4) { b0 = v0; b1 = v1; }
                        else { b0 = to_float<E>(v0); b1 = to_float<E>(v1); }
                    }
                    s_frag[mt][j][2 * half] = fma_acc(b0, log2e<A>(), s_frag[mt][j][2 * half]);
                    s_frag[mt][j][2 * half + 1] = fma_acc(b1, log2e<A>(), s_frag[mt][j][2 * half + 1]);
                }
            }
    }
    // s −= slope · |diag − col|  (ALiBi, slope in base-2 units)
    if (slope_log2 != A(0)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + mt * 16 + g + (e >> 1) * 8;
                    const int col = n0 + j * 8 + 2 * t + (e & 1);
                    s_frag[mt][j][e] -= slope_log2 * abs_as(row + diag_offset - col, A());
                }
    }
}
