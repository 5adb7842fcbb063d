// cupyflash: the Hopper forwards' online softmax on wgmma accumulator fragments (16-bit and
// float32 forwards): exp_scores, online_softmax (masks, running max, P, denominators), rescale_o,
// reset_rows.
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/sched.cuh"

// ---- Per-row softmax state shared by the 16-bit and float32 Hopper forwards. A consumer lane
//      holds rows row0 and row0 + 8 of its warpgroup's 64 (quad of 4 lanes per row) and, of each
//      8 columns of the S [64, BN] and O [64, D] accumulators, columns col_in_8 and col_in_8 + 1:
//      s_acc[i] / o_acc[i] is row row0 + 8·((i % 4) >= 2), column 8·(i / 4) + col_in_8 + (i % 2).

// P = exp2(s·sl2 − shift) of the first N of a lane's NS scores in place (P = 0 for the rest,
// scores the masks set to −inf), their sum added to the denominators l
template <int N, int NS>
__device__ __forceinline__ void exp_scores(float* s_acc, float* l_run, const float* shift, float sl2) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
        s_acc[i] = fast_exp2(s_acc[i] * sl2 - shift[0]);
        s_acc[i + 1] = fast_exp2(s_acc[i + 1] * sl2 - shift[0]);
        s_acc[i + 2] = fast_exp2(s_acc[i + 2] * sl2 - shift[1]);
        s_acc[i + 3] = fast_exp2(s_acc[i + 3] * sl2 - shift[1]);
        l_run[0] += s_acc[i] + s_acc[i + 1];
        l_run[1] += s_acc[i + 2] + s_acc[i + 3];
    }
#pragma unroll
    for (int i = N; i < NS; ++i) s_acc[i] = 0.f;
}

// Online softmax of one key tile's scores (keys n0 .. n0 + BN), in place in s_acc [NS = BN / 2]:
// masks (only tiles that cross the ragged end or a band edge: key j kept when j < s_k and
// diag(i) − left <= j <= diag(i) + right), running max m, P = exp2(s·sl2 − shift), denominator l,
// and alpha [2], the factors that rescale O and l (l here, O by rescale_o). sl2: score -> base-2
// exponent factor (scale·log2 e; 1 where the scores are in base-2 units already). MASKS = false:
// the caller knows that the band and the ragged end mask no key of the tile (no mask code).
template <int NS, int BN, bool WINDOW, bool FIRST = false, bool MASKS = true>
__device__ __forceinline__ void online_softmax(float* s_acc, float* m_run, float* l_run, float* alpha,
                                               const Params& p, const FwdTile& wt, int n0, int row0,
                                               int col_in_8, float sl2) {
    // ---- masks
    bool need_mask = MASKS && n0 + BN > wt.s_k;
    if (WINDOW && MASKS)
        need_mask |= n0 + BN - 1 > wt.m0 + wt.diag + p.window_right ||
                     n0 < wt.m_last + wt.diag - p.window_left;
    // FIRST (a work tile's first key tile, the diagonal one in causal order) and WINDOW: whether
    // the band masks the tile's right half for all 16 rows of this warp (a causal tile's first
    // 64 rows at BM = BN), so that its exp2s can be skipped below
    bool right_half_masked = false;
    if (need_mask) {
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            const int j = n0 + (i / 4) * 8 + col_in_8 + (i % 2);
            const int diag = row0 + ((i % 4) >= 2 ? 8 : 0) + wt.diag;
            bool keep = j < wt.s_k;
            if (WINDOW) keep = keep && j <= diag + p.window_right && j >= diag - p.window_left;
            if (!keep) s_acc[i] = -CF_INF;
        }
        if (WINDOW && FIRST) {
            // the lane's lower row, row0 + 8, keeps keys j < min(s_k, diag + right + 1)
            const int keep_end = min(wt.s_k, row0 + 8 + wt.diag + p.window_right + 1);
            right_half_masked = __all_sync(0xffffffffu, keep_end - n0 <= BN / 2);
        }
    }
    // ---- running max m (rows row0, row0 + 8: quad of 4 lanes per row)
    float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int i = 0; i < NS; i += 4) {
        m_new[0] = fmaxf(m_new[0], fmaxf(s_acc[i], s_acc[i + 1]));
        m_new[1] = fmaxf(m_new[1], fmaxf(s_acc[i + 2], s_acc[i + 3]));
    }
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m_new[r] = quad_max(m_new[r]);
        // exponent shift m·scale·log2e; 0 while the row has seen no key (no inf - inf)
        shift[r] = m_new[r] == -CF_INF ? 0.f : m_new[r] * sl2;
        alpha[r] = fast_exp2(m_run[r] * sl2 - shift[r]);   // O, l rescale; 0 on the first key
        m_run[r] = m_new[r];
        l_run[r] *= alpha[r];
    }
    // ---- P = exp2(s·scale·log2e − shift) in place, denominator l; a right half masked for the
    //      whole warp gets P = 0 without exp2 (the exp2 unit bounds the softmax at hd 64: H200,
    //      hd 64 causal s = 512 / 1k / 2k +1-3 %; 16k causal -1-4 %, not understood). Only in
    //      the first key tile: there no product is in flight, while this branch inside the
    //      key-tile loop made ptxas serialize every wgmma of the kernel.
    if (WINDOW && FIRST && right_half_masked) exp_scores<NS / 2, NS>(s_acc, l_run, shift, sl2);
    else exp_scores<NS, NS>(s_acc, l_run, shift, sl2);
}

// O [64, D] rescale by alpha (rows row0, row0 + 8), once the previous O += P V has completed
template <int NO>
__device__ __forceinline__ void rescale_o(float* o_acc, const float* alpha) {
#pragma unroll
    for (int i = 0; i < NO; i += 4) {
        o_acc[i] *= alpha[0];
        o_acc[i + 1] *= alpha[0];
        o_acc[i + 2] *= alpha[1];
        o_acc[i + 3] *= alpha[1];
    }
}

// A work tile's first key tile: fresh O, running max m and denominator l
template <int NO>
__device__ __forceinline__ void reset_rows(float* o_acc, float* m_run, float* l_run) {
#pragma unroll
    for (int i = 0; i < NO; ++i) o_acc[i] = 0.f;
    m_run[0] = m_run[1] = -CF_INF;
    l_run[0] = l_run[1] = 0.f;
}
