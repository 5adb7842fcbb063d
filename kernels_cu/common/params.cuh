// cupyflash: the kernels' one argument, struct Params, and its flag bits (every kernel).
#pragma once

#include "common/types.cuh"

// ---------------------------------------------------------------------------------------------
// Params: the whole host-to-kernel interface, passed by value. Mirrored ONCE in
// cupyflash/gpu/params.py (PARAMS_DTYPE); keep the two in the same order.
// Strides are in elements; the last dimension of every tensor is contiguous.
// ---------------------------------------------------------------------------------------------
// An opaque CUtensorMap (the driver's TMA descriptor): 128 bytes, 64-byte aligned.
struct __align__(64) TmaDesc { unsigned long long bits[16]; };

struct Params {
    const void* q;          // [b, s_q, h, d]
    const void* k;          // [b, s_k, h_k, d]
    const void* v;          // [b, s_k, h_k, d_v]
    void* o;                // [b, s_q, h, d_v]
    float* lse;             // [b, h, s_q], contiguous, natural log
    const float* alibi;     // [b or 1, h] slopes, or null
    i64 q_stride_b, q_stride_s, q_stride_h;
    i64 k_stride_b, k_stride_s, k_stride_h;
    i64 v_stride_b, v_stride_s, v_stride_h;
    i64 o_stride_b, o_stride_s, o_stride_h;
    i64 alibi_stride_b;     // 0 when the slopes broadcast over the batch
    int b, h, h_k, h_per_hk;
    int s_q, s_k, d, d_v;
    int window_left;        // >= 0; "unbounded" arrives as s_q + s_k
    int window_right;       // >= 0; likewise
    int diag_offset;        // diag(i) = i + diag_offset (s_k - s_q bottom-right, 0 top-left)
    int vec_ok;             // 1: every row start is 16-byte aligned -> 16-byte cp.async
    int num_m_blocks;       // ceil(s_q / BM)
    int det_sched;          // Hopper deterministic backward: 2 · pairs per draw group + (1:
                            // key tiles descending); plan_bwd_sm90.det_sched
    float scale_log2;       // scale * log2(e)
    float softcap_pre;      // scale / softcap (0 when off)
    float softcap_post;     // softcap * log2(e)
    float pad0;
    // ---- bias / mask / varlen: read by the GENERAL instantiations (flash_fwd, flash_bwd) and by
    //      the Hopper kernels' BIAS / VARLEN variants; a null pointer turns its feature off ----
    const void* bias;       // [b', h', s_q', s_k'] broadcast to [b, h, s_q, s_k] (stride 0 where 1);
                            // elements: E's storage, or float32 when bias_f32
    const unsigned char* mask;   // [b', h', s_q', s_k'] likewise, 1 = attend
    const int* cu_seqlens_q;     // [batch + 1] varlen: sequence z is packed rows cu[z]..cu[z+1]
    const int* cu_seqlens_k;     // [batch + 1]
    float* dbias_accum;     // backward: [slabs, b', h', s_q', s_k'] float32, zeroed by the launcher
    void* dbias;            // flash_bwd_dbias: the output [b', h', s_q, s_k], the bias's element type
                            // (E's storage, or float32 when bias_f32), dbias strides
    i64 bias_stride_b, bias_stride_h, bias_stride_q, bias_stride_k;      // elements, 0 = broadcast
    i64 mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k;      // elements, 0 = broadcast
    i64 dbias_stride_b, dbias_stride_h, dbias_stride_q, dbias_stride_k;  // in one slab, 0 = summed
    i64 dbias_slab;         // elements of one dbias slab
    int bias_f32;           // 1: bias elements are float32; 0: E's storage type
    int dbias_mode;         // DBIAS_* bits below
    int varlen_bottom_right;   // varlen: 1 diag(i) = i + s_k(z) - s_q(z), 0 diag(i) = i
    int bias_pair;          // 1: unit key stride, even s_k, 4-byte aligned pairs (forward pair loads)
    // ---- backward only (portable/bwd.cu, hopper/); the forward never reads these ----
    const void* dout;       // [b, s_q, h, d_v]
    void* dq;               // [b, s_q, h, d]
    void* dk;               // [b, s_k, h_k, d]
    void* dv;               // [b, s_k, h_k, d_v]
    float* dsum;            // [b, h, s_q] contiguous: D = rowsum(dO ∘ O)
    float* dq_accum;        // [b, h, s_q, d] float32 contiguous; dq_slabs such slabs when deterministic
    i64 do_stride_b, do_stride_s, do_stride_h;
    i64 dq_stride_b, dq_stride_s, dq_stride_h;
    i64 dk_stride_b, dk_stride_s, dk_stride_h;
    i64 dv_stride_b, dv_stride_s, dv_stride_h;
    i64 dq_accum_slab;      // elements of one dQ slab: b * h * s_q * d
    int num_n_blocks;       // ceil(s_k / bn); Hopper varlen backward: the longest sequence's key tiles
    int bn;                 // key rows per block of flash_bwd
    int deterministic;      // 1: dQ parts added in program order into dq_slabs slabs; 0: float atomics
    int dq_slabs;           // deterministic: flash_bwd's gridDim.x; block x adds key tiles x, x + dq_slabs, ...
    float scale;            // scale in natural units (the dS multiplier)
    // ---- Hopper kernels only (kernels_cu/hopper/fwd.cu, hopper/bwd.cu) ----
    unsigned int* sched;    // [2] Hopper fwd / bwd work-tile counter, blocks finished: zero before and after
    // Hopper forward, SPLIT variants: the work tiles from split_first on (the grid's last partial
    // wave) run as split_pieces pieces, each a range of the tile's key tiles, whose partial O, m, l
    // the tile's last piece to finish merges (split_ws, split_count)
    const int* split_table; // [split_first + split_pieces][4], one row per work item: its work
                            // tile, first key tile (from the band's first), key tiles, and
                            // 64 * (the tile's first piece, from split_first) + (the tile's pieces);
                            // whole tiles (w, 0, all, 1)
    float* split_ws;        // [split_pieces][NC][D / 8 + 1][128 lanes][4] partial O, m, l (float32)
    unsigned int* split_count;   // [split tiles][NC] pieces finished: zero before and after a launch
    int split_first;        // whole work tiles (the first piece's work item)
    int split_pieces;       // pieces of the split tiles
    // ---- float64 instantiations (E = f64_t) read their scalars here, in double; their lse,
    //      alibi, dsum, dq_accum and dbias_accum point to doubles (Acc<E>) ----
    double scale_log2_f64;  // scale * log2(e)
    double softcap_pre_f64; // scale / softcap (0 when off)
    double softcap_post_f64;   // softcap * log2(e)
    double scale_f64;       // scale in natural units
    // TMA descriptors built by the host (cupyflash/_tma.py); each is a 128-byte CUtensorMap over
    // a rank-4 view (d, s, heads, b) of q / k / v, read through the kernel parameter
    // (__grid_constant__); a box row is 128 bytes: 64 columns of 16-bit elements, 32 of float32
    TmaDesc tma_q;          // q [b, s_q, h, d]: box [64 (float32: 32) columns, BM rows]
    TmaDesc tma_k;          // k [b, s_k, h_k, d]: box [64 (32) columns, BN rows]
    TmaDesc tma_v;          // v [b, s_k, h_k, d_v]: box [64 (32) columns, BN rows]
    TmaDesc tma_do;         // dout [b, s_q, h, d_v] (backward): box [64 columns, BM rows]
    TmaDesc tma_bias;       // bias [b', h', s_q, s_k] (Hopper backward, BIAS_TMA) as (s_k, s_q, h', b'):
                            // box [64 keys, BM queries]; a broadcast dimension has extent 1
    TmaDesc tma_o;          // out [b, s_q, h, d_v] (Hopper forward, O staged in shared memory):
                            // box [64 columns, 64 rows]; zero for variants that store O themselves
};
#ifdef CUPYFLASH_PARAMS_NBYTES   // passed by cupyflash/gpu/compile.py from the Python mirror
static_assert(sizeof(Params) == CUPYFLASH_PARAMS_NBYTES,
              "struct Params differs from its mirror PARAMS_DTYPE in cupyflash/gpu/params.py");
#endif

// GENERAL template bits of flash_fwd (flash_bwd's GENERAL is one flag: both features)
#define GEN_VARLEN 1      // packed sequences: per-block lengths and offsets from cu_seqlens
#define GEN_BIAS_MASK 2   // additive bias and boolean mask

// Params::dbias_mode bits (backward with a bias):
#define DBIAS_ROWS 1      // the bias broadcasts over s_q: each warp sums its rows before writing
#define DBIAS_ATOMIC 2    // other blocks add to the same element: red.global.add.f32
#define DBIAS_SLAB_B 4    // deterministic: one slab per batch entry (bias broadcast over batch)
#define DBIAS_SLAB_H 8    // deterministic: one slab per kv head (bias broadcast over heads)
#define DBIAS_STORE 16    // Hopper backward: each element has one writer over the launch: plain
                          // stores (the portable kernel ignores this bit: it adds, also right)
#define DBIAS_SCHED_B 32  // Hopper backward: work tiles batch-fastest (dbias summed over the batch)

// The Params scalars in the accumulator type A: the float fields, or their *_f64 twins for
// float64
template <typename A> __device__ __forceinline__ A scale_log2_of(const Params& p) {
    if constexpr (sizeof(A) == 8) return p.scale_log2_f64; else return p.scale_log2;
}
template <typename A> __device__ __forceinline__ A softcap_pre_of(const Params& p) {
    if constexpr (sizeof(A) == 8) return p.softcap_pre_f64; else return p.softcap_pre;
}
template <typename A> __device__ __forceinline__ A softcap_post_of(const Params& p) {
    if constexpr (sizeof(A) == 8) return p.softcap_post_f64; else return p.softcap_post;
}
template <typename A> __device__ __forceinline__ A scale_of(const Params& p) {
    if constexpr (sizeof(A) == 8) return p.scale_f64; else return p.scale;
}

// ALiBi slope of (batch, head) in base-2 units, or 0 (slopes: float, or double for float64)
template <typename A> __device__ __forceinline__ A alibi_slope_log2(const Params& p, int batch, int head) {
    if (!p.alibi) return A(0);
    return ((const A*)p.alibi)[batch * p.alibi_stride_b + head] * log2e<A>();
}
