// cupyflash: the Hopper forwards' epilogue (16-bit and float32 forwards): a work tile's output
// and lse rows, final O / l and lse (store_rows, finish_rows), rows that see no key
// (store_empty_rows), O staged in shared memory for a TMA store (stage_rows).
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/fwd_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

// Output rows [s_q, d_v] and lse rows [s_q] of the work tile's (sequence, head)
template <typename S>
__device__ __forceinline__ S* out_rows(const Params& p, const FwdTile& wt) {
    return (S*)p.o + wt.batch * p.o_stride_b + wt.head * p.o_stride_h + (i64)wt.q_row * p.o_stride_s;
}
template <bool VARLEN>
__device__ __forceinline__ float* lse_rows(const Params& p, const FwdTile& wt) {
    if constexpr (VARLEN) return p.lse + (i64)wt.head * p.s_q + wt.q_row;   // lse [h, total_q]
    return p.lse + ((i64)wt.batch * p.h + wt.head) * p.s_q;                 // lse [b, h, s_q]
}

// A work tile whose rows see no key: out = 0 and lse = −inf for the WG_ROWS rows r0 .. of one
// warpgroup (thread t of 128; rows past s_q are not written), out [s_q, D] in E's storage
template <typename E, int D, bool VARLEN>
__device__ __forceinline__ void store_empty_rows(const Params& p, const FwdTile& wt, int r0, int t) {
    typedef typename Elem<E>::storage S;
    using sm90::WG_ROWS;
    S* o_bh = out_rows<S>(p, wt);                   // [s_q, d_v]
    for (int i = t; i < WG_ROWS * D; i += 128)
        if (r0 + i / D < wt.s_q) o_bh[(r0 + i / D) * p.o_stride_s + i % D] = from_float<E>(0.f);
    if (t < WG_ROWS && r0 + t < wt.s_q) lse_rows<VARLEN>(p, wt)[r0 + t] = -CF_INF;
}

// The rows' final denominators, inv_l[r] = 1 / l of rows row0 + 8r (0 for a row that saw no
// key), and their lse = (m·scale·log2e + log2 l)·ln 2 stored (−inf for such a row; rows past s_q
// are not; lse_lane: one lane of each quad)
template <bool VARLEN>
__device__ __forceinline__ void finish_rows(const Params& p, const FwdTile& wt, const float* m_run,
                                            const float* l_run, float sl2, int row0, bool lse_lane,
                                            float* inv_l) {
    float* lse_bh = lse_rows<VARLEN>(p, wt);        // [s_q]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_run[r]);
        const int row = row0 + 8 * r;
        inv_l[r] = l > 0.f ? 1.f / l : 0.f;
        if (row < wt.s_q && lse_lane)
            lse_bh[row] = l > 0.f ? (m_run[r] * sl2 + log2f(l)) * CF_LN2 : -CF_INF;
    }
}

// Final O / l and lse = (m·scale·log2e + log2 l)·ln 2 of the work tile's rows row0, row0 + 8
// (rows past s_q are not stored; a row that saw no key: out = 0, lse = −inf); out in E's storage
// (16-bit pairs, or float32). Float32 goes out in 16-byte stores (the launcher sends out bases
// that are not 16-byte aligned to the portable kernel; TMA's checks make the strides 16-byte
// multiples): of the column groups 2h, 2h + 1 (16 columns of a row, 2 per lane of the quad),
// lanes c and c ^ 1 swap one column pair so that even c holds columns 16h + 2c .. + 3 and odd c
// columns 16h + 8 + 2(c − 1) .. + 3 (one 16-byte store each: 64 contiguous bytes per row and quad,
// a quarter of the scalar stores). 16-bit out likewise when its base is 16-byte aligned (the
// strides are): of the column groups 4h .. 4h + 3 (a 4-byte pair per lane in each), lane c
// gathers group 4h + c whole through a 4 x 4 transpose across the quad (otherwise 4-byte pairs).
// The 4-byte stores took ~4000 SM cycles of each work tile at hd 128 (1.4 key-tile steps, the
// most of a work tile's fixed cost; benchmarks/fwd_trace.py on the H200).
template <typename E, int NO, bool VARLEN>
__device__ __forceinline__ void store_rows(const Params& p, const FwdTile& wt, const float* o_acc,
                                           const float* m_run, const float* l_run, float sl2,
                                           int row0, int col_in_8, bool lse_lane) {
    typedef typename Elem<E>::storage S;
    S* o_bh = out_rows<S>(p, wt);                   // [s_q, d_v]
    const bool odd = col_in_8 & 2;                  // the lane's c = col_in_8 / 2 is odd
    const bool high = col_in_8 & 4;                 // c >= 2
    const bool wide = ((size_t)o_bh & 15) == 0;     // 16-bit out: rows start 16-byte aligned
    float inv_ls[2];
    finish_rows<VARLEN>(p, wt, m_run, l_run, sl2, row0, lse_lane, inv_ls);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        const float inv_l = inv_ls[r];
        if constexpr (!Elem<E>::is16) {
            S* o_row = o_bh + row * p.o_stride_s;
#pragma unroll
            for (int i = 0; i < NO; i += 8) {            // column groups 2h, 2h + 1 (h = i / 8)
                const float x0 = o_acc[i + 2 * r] * inv_l, x1 = o_acc[i + 2 * r + 1] * inv_l;   // group 2h
                const float y0 = o_acc[i + 4 + 2 * r] * inv_l, y1 = o_acc[i + 5 + 2 * r] * inv_l;   // 2h + 1
                // every lane of the warp swaps (rows past s_q too: the shuffles take all 32)
                const float g0 = __shfl_xor_sync(0xffffffffu, odd ? x0 : y0, 1);
                const float g1 = __shfl_xor_sync(0xffffffffu, odd ? x1 : y1, 1);
                const float4 v = odd ? make_float4(g0, g1, y0, y1) : make_float4(x0, x1, g0, g1);
                if (row < wt.s_q) *(float4*)(o_row + 2 * i + (odd ? 6 : 0) + col_in_8) = v;
            }
        }
        if constexpr (Elem<E>::is16) {
            S* o_row = o_bh + row * p.o_stride_s;
            if (wide) {
#pragma unroll
                for (int i = 0; i < NO; i += 16) {           // column groups 4h .. 4h + 3 (h = i / 16)
                    u32 w[4];                                  // w[k]: this lane's pair of group 4h + k
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        w[k] = pack2<E>(o_acc[i + 4 * k + 2 * r] * inv_l, o_acc[i + 4 * k + 2 * r + 1] * inv_l);
                    // 4 x 4 transpose across the quad (every lane of the warp, rows past s_q too):
                    // lanes c, c ^ 1 swap one pair of each (2m, 2m + 1), then lanes c, c ^ 2 one
                    // of each (m, m + 2); lane c ends with w[k] = lane k's pair of group 4h + c
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const u32 y = __shfl_xor_sync(0xffffffffu, odd ? w[2 * m] : w[2 * m + 1], 1);
                        if (odd) w[2 * m] = y; else w[2 * m + 1] = y;
                    }
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const u32 y = __shfl_xor_sync(0xffffffffu, high ? w[m] : w[m + 2], 2);
                        if (high) w[m] = y; else w[m + 2] = y;
                    }
                    if (row < wt.s_q) *(uint4*)(o_row + 2 * i + 4 * col_in_8) = make_uint4(w[0], w[1], w[2], w[3]);
                }
            } else if (row < wt.s_q) {                       // 4-byte pairs
#pragma unroll
                for (int i = 0; i < NO; i += 4) {
                    const int col = (i / 4) * 8 + col_in_8;
                    *(u32*)(o_row + col) = pack2<E>(o_acc[i + 2 * r] * inv_l, o_acc[i + 2 * r + 1] * inv_l);
                }
            }
        }
    }
}

// Final O / l of one consumer's 64 rows into its o_smem [D / 64 panels][64 rows][64 columns]
// (O_SMEM), in the TMA box's 128-byte swizzled layout (16-byte chunk k of row r at chunk
// k ^ (r % 8)): stmatrix writes four 8 x 8 blocks per step, rows 16·warp + 0..7 / 8..15 of column
// groups g, g + 1 (conflict-free: a block's 8 rows land in 8 different chunks)
template <typename E, int NO>
__device__ __forceinline__ void stage_rows(u32 o_wg, const float* o_acc, const float* inv_l, int warp,
                                           int lane) {
    constexpr int O_PANEL = sm90::WG_ROWS * 128;
    const int row = 16 * warp + 8 * ((lane / 8) % 2) + lane % 8;   // the row this lane addresses
#pragma unroll
    for (int g = 0; g < NO / 4; g += 2) {
        const int gl = g + lane / 16;                                  // ... in column group gl
        const u32 addr = o_wg + (gl / 8) * O_PANEL + row * 128 + (((gl % 8) ^ (row % 8)) << 4);
        const float* o = o_acc + 4 * g;          // groups g, g + 1: (row0, row0 + 8) pairs each
        stmatrix_x4(addr, pack2<E>(o[0] * inv_l[0], o[1] * inv_l[0]), pack2<E>(o[2] * inv_l[1], o[3] * inv_l[1]),
                    pack2<E>(o[4] * inv_l[0], o[5] * inv_l[0]), pack2<E>(o[6] * inv_l[1], o[7] * inv_l[1]));
    }
}
