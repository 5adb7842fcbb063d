// cupyflash: which scores the portable kernels keep: the per-score predicate (key < s_k, causal /
// sliding window, boolean mask). diag(i) = i + diag_offset; key j is kept for row i when
// diag − left <= j <= diag + right.
#pragma once

#include "common/params.cuh"

// ---------------------------------------------------------------------------------------------
// Whether score (row, key) is kept: key < s_k, inside the window (WINDOW), mask[row, key] true
// (mask_plane: the [s_q, s_k] plane of this (batch, head), or null; rows / keys past the ends
// clamped, their scores are dropped anyway).
// ---------------------------------------------------------------------------------------------
template <bool WINDOW>
__device__ __forceinline__ bool score_kept(const Params& p, const unsigned char* mask_plane, int row,
                                           int key, int s_q, int s_k, int diag_offset) {
    const int diag = row + diag_offset;
    bool keep = key < s_k;
    if (WINDOW) keep = keep && key >= diag - p.window_left && key <= diag + p.window_right;
    if (mask_plane)
        keep = keep && mask_plane[(i64)min(row, s_q - 1) * p.mask_stride_q + (i64)min(key, s_k - 1) * p.mask_stride_k];
    return keep;
}
