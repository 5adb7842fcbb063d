// cupyflash: shared device code for the sm_80+ (mma.sync) kernels.
//
// No CUDA toolkit header is included anywhere: NVRTC alone compiles this (pip-only installs,
// CI without a GPU). fp16 / bf16 values travel as raw 16-bit patterns and are converted with
// PTX `cvt`; matrix products, ldmatrix and cp.async are inline PTX.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define CF_INF __int_as_float(0x7f800000)
#define CF_LOG2E 1.4426950408889634f
#define CF_LN2 0.6931471805599453f

// ---------------------------------------------------------------------------------------------
// Params: the whole host-to-kernel interface, passed by value. Mirrored ONCE in
// cupyflash/_plan.py (PARAMS_FIELDS); keep the two in the same order.
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
    int flags;              // reserved
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
    // ---- backward only (kernels_cu/bwd.cu); the forward never reads these ----
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
    // ---- Hopper kernels only (kernels_cu/fwd_sm90.cu, bwd_sm90.cu) ----
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
#ifdef CUPYFLASH_PARAMS_NBYTES   // passed by cupyflash/_modules.py from the Python mirror
static_assert(sizeof(Params) == CUPYFLASH_PARAMS_NBYTES,
              "struct Params differs from its mirror PARAMS_DTYPE in cupyflash/_plan.py");
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

// ---------------------------------------------------------------------------------------------
// Element types. f16_t / bf16_t are stored as 16-bit patterns; the two float32 tags differ only
// in how products are formed: f32x3_t splits each operand into big + small TF32 parts and sums
// three products (float32 accuracy), tf32_t uses one plain TF32 product (fast, ~1e-3 relative).
// ---------------------------------------------------------------------------------------------
struct f16_t {};
struct bf16_t {};
struct f32x3_t {};
struct tf32_t {};

template <typename E> struct Elem;
template <> struct Elem<f16_t>  { typedef u16 storage; static constexpr bool is16 = true;  static constexpr bool split = false; };
template <> struct Elem<bf16_t> { typedef u16 storage; static constexpr bool is16 = true;  static constexpr bool split = false; };
template <> struct Elem<f32x3_t>{ typedef float storage; static constexpr bool is16 = false; static constexpr bool split = true; };
template <> struct Elem<tf32_t> { typedef float storage; static constexpr bool is16 = false; static constexpr bool split = false; };

// float pair -> packed 16-bit pair (lo in the low half). cvt puts its first source in the upper half.
template <typename E> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<f16_t>(float lo, float hi) {
    u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
template <> __device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}

// float -> stored element
template <typename E> __device__ __forceinline__ typename Elem<E>::storage from_float(float x);
template <> __device__ __forceinline__ u16 from_float<f16_t>(float x) {
    u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
template <> __device__ __forceinline__ u16 from_float<bf16_t>(float x) {
    u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
template <> __device__ __forceinline__ float from_float<f32x3_t>(float x) { return x; }
template <> __device__ __forceinline__ float from_float<tf32_t>(float x) { return x; }

// float -> TF32 bit pattern (round to nearest, ties away), kept in a 32-bit register
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x)); return r;
}

// ---------------------------------------------------------------------------------------------
// Special functions
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float fast_exp2(float x) {   // 2^x, ex2.approx (exp2(-inf) = 0)
    float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core products, D = A B + D with fp32 accumulation.
// m16n8k16 (f16/bf16): a[4] (16x16 row-major), b[2] (16x8 col-major), c[4] (16x8).
// m16n8k8 (tf32): a[4] (16x8), b[2] (8x8), c[4].
// ---------------------------------------------------------------------------------------------
template <typename E> __device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma16816<f16_t>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<bf16_t>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma1688_tf32(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// float32 product on TF32 units: SPLIT=true sums big*big + big*small + small*big (3xTF32,
// float32 accuracy); SPLIT=false is one TF32 product.
// LONG_SUM (with SPLIT): c accumulates over many tiles (O over keys, dK / dV over queries). The
// tensor cores' float32 accumulation rounds toward zero, which biases such sums by about
// (products added) · 2⁻²⁴ relative (4e-5 over 4096 rows, three products per 8-wide k-step);
// so the three products go to a zeroed fragment that is added to c in fp32 (round to nearest).
template <bool SPLIT, bool LONG_SUM = false>
__device__ __forceinline__ void mma_f32(float* c, const float* a, float b0, float b1) {
    u32 a_big[4], b_big0 = to_tf32(b0), b_big1 = to_tf32(b1);
#pragma unroll
    for (int i = 0; i < 4; ++i) a_big[i] = to_tf32(a[i]);
    if (SPLIT) {
        u32 a_small[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a_small[i] = to_tf32(a[i] - __uint_as_float(a_big[i]));
        u32 b_small0 = to_tf32(b0 - __uint_as_float(b_big0));
        u32 b_small1 = to_tf32(b1 - __uint_as_float(b_big1));
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        float* acc = LONG_SUM ? part : c;
        mma1688_tf32(acc, a_small, b_big0, b_big1);   // small terms first
        mma1688_tf32(acc, a_big, b_small0, b_small1);
        mma1688_tf32(acc, a_big, b_big0, b_big1);
        if (LONG_SUM) {
#pragma unroll
            for (int i = 0; i < 4; ++i) c[i] += part[i];
        }
        return;
    }
    mma1688_tf32(c, a_big, b_big0, b_big1);
}

// ---------------------------------------------------------------------------------------------
// Shared-memory matrix loads (16-bit elements). Each lane passes one row address.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// ---------------------------------------------------------------------------------------------
// cp.async: 16-byte global -> shared copies; src_bytes < 16 zero-fills the rest (0 = all zero).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Quad (4 lanes sharing an accumulator row) reductions
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// =============================================================================================
// Backward additions (kernels_cu/bwd.cu). Appended; the forward does not use them.
// =============================================================================================

// stored element -> float
template <typename E> __device__ __forceinline__ float to_float(typename Elem<E>::storage x);
template <> __device__ __forceinline__ float to_float<f16_t>(u16 x) {
    float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x)); return r;
}
template <> __device__ __forceinline__ float to_float<bf16_t>(u16 x) { return __uint_as_float((u32)x << 16); }
template <> __device__ __forceinline__ float to_float<f32x3_t>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<tf32_t>(float x) { return x; }

// *addr += v in global memory, no return value (red.global.add.f32)
__device__ __forceinline__ void red_add_f32(float* addr, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(addr), "f"(v) : "memory");
}

// One score through the docs/semantics.md §2 pipeline, in base-2 units: s = scale·qk, softcap
// c·tanh(s/c), ALiBi −slope·|diag − col| with diag = row + diag_offset. Masks (and a bias) are
// applied by the caller. *ds_dqk receives
// d s / d(qk) in natural units: scale, times 1 − tanh²(s/c) under softcap.
template <bool SCORE_MOD>
__device__ __forceinline__ float score_log2(float qk, const Params& p, float slope_log2, int row,
                                            int col, int diag_offset, float scale, float* ds_dqk) {
    if (!SCORE_MOD) { *ds_dqk = scale; return qk * p.scale_log2; }
    float s;
    if (p.softcap_post > 0.f) {   // softcap on (softcap_pre may be negative with a negative scale)
        const float th = tanhf(qk * p.softcap_pre);
        s = p.softcap_post * th;
        *ds_dqk = scale * (1.f - th * th);
    } else {
        s = qk * p.scale_log2;
        *ds_dqk = scale;
    }
    return s - slope_log2 * fabsf((float)(row + diag_offset - col));
}

// =============================================================================================
// Shared by flash_fwd (fwd.cu) and flash_bwd_dbias (bwd.cu)
// =============================================================================================

// Scores of one S tile moved to base-2 units in place, in docs/semantics.md §2 order: scale·qk or softcap
// c·tanh(scale·qk / c), + bias (HAS_BIAS; BT = the bias element type), − ALiBi slope·|diag − j|.
// Each step is one pass over the registers behind a block-uniform branch (a step that is off
// costs nothing per score). bias_gmem: the [s_q, s_k] bias plane of this (batch, head) with
// element strides p.bias_stride_q / _k; rows / columns past the sequence are clamped to its last
// ones (their scores are dropped by the caller: rows never stored, columns masked). With
// p.bias_pair (unit key stride, even s_k, 4-byte aligned pairs: set by the launcher) each lane
// reads its two adjacent columns in one load.
template <typename E, bool HAS_BIAS, typename BT, int BN, int MT>
__device__ __forceinline__ void score_mod_tile(float (&s_frag)[MT][BN / 8][4], const Params& p,
                                               const BT* bias_gmem,   // [s_q, s_k] (strided)
                                               float slope_log2, int row0, int n0, int g, int t,
                                               int s_q, int s_k, int diag_offset) {
    // s = softcap·tanh(qk·scale / softcap), or s = qk·scale, in base-2 units
    if (p.softcap_post > 0.f) {   // softcap on (softcap_pre is negative with a negative scale)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_frag[mt][j][e] = p.softcap_post * tanhf(s_frag[mt][j][e] * p.softcap_pre);
    } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_frag[mt][j][e] *= p.scale_log2;
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
                    float b0, b1;
                    if (p.bias_pair) {   // columns col, col + 1 in one load (s_k even: both in the row)
                        const int c = min(col, s_k - 2);
                        if constexpr (sizeof(BT) == 4) {
                            const float2 v = *(const float2*)(row_gmem + c);
                            b0 = v.x; b1 = v.y;
                        } else {
                            const u32 v = *(const u32*)(row_gmem + c);
                            b0 = to_float<E>((BT)(v & 0xffffu)); b1 = to_float<E>((BT)(v >> 16));
                        }
                    } else {
                        const BT v0 = row_gmem[(i64)min(col, s_k - 1) * p.bias_stride_k];
                        const BT v1 = row_gmem[(i64)min(col + 1, s_k - 1) * p.bias_stride_k];
                        if constexpr (sizeof(BT) == 4) { b0 = v0; b1 = v1; }
                        else { b0 = to_float<E>(v0); b1 = to_float<E>(v1); }
                    }
                    s_frag[mt][j][2 * half] = fmaf(b0, CF_LOG2E, s_frag[mt][j][2 * half]);
                    s_frag[mt][j][2 * half + 1] = fmaf(b1, CF_LOG2E, s_frag[mt][j][2 * half + 1]);
                }
            }
    }
    // s −= slope · |diag − col|  (ALiBi, slope in base-2 units)
    if (slope_log2 != 0.f) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + mt * 16 + g + (e >> 1) * 8;
                    const int col = n0 + j * 8 + 2 * t + (e & 1);
                    s_frag[mt][j][e] -= slope_log2 * fabsf((float)(row + diag_offset - col));
                }
    }
}
