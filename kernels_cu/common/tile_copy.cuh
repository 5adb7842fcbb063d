// cupyflash: the portable kernels' global -> shared tile copy in 16-byte chunks (cp.async, or
// element copies for unaligned rows): portable/fwd_parts.cuh's load_tile (its general case) and
// the portable backward's tile loads (portable/bwd.cu).
#pragma once

#include "common/mma.cuh"
#include "common/types.cuh"

// Copy a [ROWS, D] tile (rows < rows_valid, columns < cols_valid) from global to shared memory
// with NT threads, chunk tid + i·NT in pass i; the rest of the tile is zero-filled (a chunk with
// nothing valid reads safe_gmem for 0 bytes). UNROLL: the passes unrolled (all of them by
// default; the float64 forward unrolls 4 so that its O accumulator keeps its registers).
template <int ROWS, int D, int PITCH, int NT, int UNROLL = 0, typename S>
__device__ __forceinline__ void copy_chunks(S* tile_smem,              // [ROWS, PITCH]
                                            const S* tile_gmem,        // [rows_valid, ., cols_valid]
                                            i64 row_stride, int rows_valid, int cols_valid,
                                            bool vec_ok, const void* safe_gmem, int tid) {
    constexpr int CH = 16 / sizeof(S);           // elements per 16-byte chunk
    constexpr int CPR = D / CH;                  // chunks per row
    constexpr int CHUNKS = ROWS * CPR;
    constexpr int ITERS = (CHUNKS + NT - 1) / NT;
#pragma unroll (UNROLL ? UNROLL : ITERS)
    for (int i = 0; i < ITERS; ++i) {
        const int c = tid + i * NT;
        if (CHUNKS % NT == 0 || c < CHUNKS) {
            const int r = c / CPR, col = (c % CPR) * CH;
            S* dst = tile_smem + r * PITCH + col;
            const S* src = tile_gmem + r * row_stride + col;
            int valid = cols_valid - col;
            valid = (r < rows_valid) ? (valid < 0 ? 0 : (valid > CH ? CH : valid)) : 0;
            if (vec_ok) {
                cp_async_16(dst, valid ? (const void*)src : safe_gmem, valid * (int)sizeof(S));
            } else {   // unaligned rows (odd strides or head dims): element copies
#pragma unroll
                for (int e = 0; e < CH; ++e) dst[e] = e < valid ? src[e] : S(0);
            }
        }
    }
}
