// cupyflash: sm_80+ warp-level PTX wrappers: mma.sync tensor-core products, ldmatrix, cp.async,
// quad (accumulator-row) reductions and the float32 global reduction. Inline PTX, no toolkit
// header.
#pragma once

#include "common/types.cuh"

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

// float32 products. Default: each operand split into three bf16 parts, x = hi + mid + lo exactly
// (8 + 8 + 8 significand bits, every part rounded to nearest), and the six products that reach
// float32 accuracy kept: hi·hi, hi·mid, mid·hi, hi·lo, lo·hi, mid·mid (the dropped mid·lo, lo·mid,
// lo·lo are at most about 2⁻²³ relative together, and far smaller typically). Each bf16 product is exact
// in fp32; two products per bf16 m16n8k16 (its two k8 halves), so three instructions per m16n8k8
// step, the count of 3xTF32 at the same rate (bf16 k16 and tf32 k8 are equal work for the tensor
// cores). -DCUPYFLASH_F32_3XTF32 restores the TF32 split (big·big + big·small + small·big, about
// 21 of float32's 24 bits: a median 2-5x the error of plain float32 math).
//
// Fragments: the kernels load the tf32 m16n8k8 layout with the k index permuted (logical k t ->
// physical 2t, t+4 -> 2t+1; a0 = A[g][κ0], a1 = A[g+8][κ0], a2 = A[g][κ1], a3 = A[g+8][κ1],
// b0 = B[κ0][g], b1 = B[κ1][g]). A bf16 m16n8k16 lane holds A rows g (reg 0, 2) and g + 8 (reg 1,
// 3) at k 2t, 2t+1 (regs 0, 1) and 2t+8, 2t+9 (regs 2, 3), B at k 2t, 2t+1 (reg 0) and 2t+8, 2t+9
// (reg 1), C as tf32 (PTX ISA, mma m16n8k16 .bf16). Packing the lane's (κ0, κ1) as one k pair
// maps logical k to physical k by the same bijection for A and B, so each k8 half is the whole
// m16n8k8 product: m16n8k16 with A = [X | Y], B = [U ; V] gives X·U + Y·V.
//
// Sums: the tensor cores' float32 accumulation rounds toward zero, which biases a sum by about
// (products added) · 2⁻²⁴ relative; so the products go to a zeroed fragment, added to c in fp32
// (round to nearest) once per k8 step. With the TF32 split this is done for LONG_SUM only
// (c accumulates over many tiles: O over keys, dK / dV over queries), the others accumulate in
// the tensor cores; -DCUPYFLASH_F32_SHORT_RZ=0 / 1 overrides that for either split (A/B only).
#if !defined(CUPYFLASH_F32_SHORT_RZ)
#if defined(CUPYFLASH_F32_3XTF32)
#define CUPYFLASH_F32_SHORT_RZ 1
#else
#define CUPYFLASH_F32_SHORT_RZ 0
#endif
#endif

// x0, x1 (a k pair) -> three bf16x2 registers, x = hi + mid + lo exactly: x - hi and (x - hi) - mid
// are exact in fp32, and the last remainder has at most 8 significant bits (its upper half is it)
struct Bf16x3 { u32 hi, mid, lo; };
__device__ __forceinline__ Bf16x3 split_bf16x3(float x0, float x1) {
    Bf16x3 s;
    s.hi = pack2<bf16_t>(x0, x1);
    const float r0 = x0 - __uint_as_float(s.hi << 16), r1 = x1 - __uint_as_float(s.hi & 0xffff0000u);
    s.mid = pack2<bf16_t>(r0, r1);
    const float q0 = r0 - __uint_as_float(s.mid << 16), q1 = r1 - __uint_as_float(s.mid & 0xffff0000u);
    s.lo = __byte_perm(__float_as_uint(q0), __float_as_uint(q1), 0x7632);   // upper halves
    return s;
}

// SPLIT=false: one TF32 product (tf32_t, allow_tf32).
template <bool SPLIT, bool LONG_SUM = false>
__device__ __forceinline__ void mma_f32(float* c, const float* a, float b0, float b1) {
    constexpr bool VIA_PART = LONG_SUM || !CUPYFLASH_F32_SHORT_RZ;
#if !defined(CUPYFLASH_F32_3XTF32)
    if (SPLIT) {
        const Bf16x3 ag = split_bf16x3(a[0], a[2]);    // row g, (κ0, κ1)
        const Bf16x3 ag8 = split_bf16x3(a[1], a[3]);   // row g + 8
        const Bf16x3 b = split_bf16x3(b0, b1);
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        float* acc = VIA_PART ? part : c;
        // two A quads, three B pairs: of the arrangements tried, the fewest register moves in
        // the kernels' SASS (A is split once per k step and shared by a row of calls, B per call)
        const u32 a_lo_hi[4] = {ag.lo, ag8.lo, ag.hi, ag8.hi};
        const u32 a_hi_mid[4] = {ag.hi, ag8.hi, ag.mid, ag8.mid};
        mma16816<bf16_t>(acc, a_lo_hi, b.hi, b.lo);     // lo·hi + hi·lo (small terms first)
        mma16816<bf16_t>(acc, a_hi_mid, b.mid, b.hi);   // hi·mid + mid·hi
        mma16816<bf16_t>(acc, a_hi_mid, b.hi, b.mid);   // hi·hi + mid·mid
        if (VIA_PART) {
#pragma unroll
            for (int i = 0; i < 4; ++i) c[i] += part[i];
        }
        return;
    }
#endif
    u32 a_big[4], b_big0 = to_tf32(b0), b_big1 = to_tf32(b1);
#pragma unroll
    for (int i = 0; i < 4; ++i) a_big[i] = to_tf32(a[i]);
    if (SPLIT) {   // 3xTF32: big·big + big·small + small·big
        u32 a_small[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a_small[i] = to_tf32(a[i] - __uint_as_float(a_big[i]));
        u32 b_small0 = to_tf32(b0 - __uint_as_float(b_big0));
        u32 b_small1 = to_tf32(b1 - __uint_as_float(b_big1));
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        float* acc = VIA_PART ? part : c;
        mma1688_tf32(acc, a_small, b_big0, b_big1);   // small terms first
        mma1688_tf32(acc, a_big, b_small0, b_small1);
        mma1688_tf32(acc, a_big, b_big0, b_big1);
        if (VIA_PART) {
#pragma unroll
            for (int i = 0; i < 4; ++i) c[i] += part[i];
        }
        return;
    }
    mma1688_tf32(c, a_big, b_big0, b_big1);
}

// float64 on the FP64 tensor cores (DMMA, sm_80+): D[8, 8] += A[8, 4] B[4, 8]; lane (g, t):
// a = A[g][t], b = B[t][g], c = D[g][2t], D[g][2t + 1] (PTX ISA, mma m8n8k4 .f64).
__device__ __forceinline__ void dmma884(double* c, double a, double b) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
                 : "+d"(c[0]), "+d"(c[1]) : "d"(a), "d"(b));
}

// One m16n8k8 step in the accumulator type, fragments in the tf32 m16n8k8 layout (a[4] (16x8),
// b0, b1 (8x8), c[4] (16x8)): float -> mma_f32 (bf16x3 split or TF32); double -> four DMMAs, which
// take the same per-lane registers: rows g (a0, a2; c0, c1) and g + 8 (a1, a3; c2, c3), k in
// two halves t (a0, a1, b0) and t + 4 (a2, a3, b1), each half one m8n8k4.
// sm_90 has a one-instruction m16n8k8 .f64 on the same registers: the same sums, bit for bit,
// and 1.3x the forward's speed (H100, hd 64 / 128: 29.7 / 23.9 vs 23.0 / 18.3 TFLOP/s);
// -DCUPYFLASH_F64_MMA884 forces the four m8n8k4 there (benchmarks/bench_f64.py --mma-ab).
template <typename E, bool LONG_SUM = false>
__device__ __forceinline__ void mma_k8(Acc<E>* c, const Acc<E>* a, Acc<E> b0, Acc<E> b1) {
    if constexpr (is_f64<E>) {
#if !defined(CUPYFLASH_F64_MMA884) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                     : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b0), "d"(b1));
#else
        dmma884(c, a[0], b0);       // rows g, k = t
        dmma884(c, a[2], b1);       // rows g, k = t + 4
        dmma884(c + 2, a[1], b0);   // rows g + 8, k = t
        dmma884(c + 2, a[3], b1);   // rows g + 8, k = t + 4
#endif
    } else {
        mma_f32<Elem<E>::split, LONG_SUM>(c, a, b0, b1);
    }
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
// 4-byte variant (one float: lse, D rows); src_bytes 0 zero-fills
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
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
__device__ __forceinline__ double quad_max(double x) {
    x = fmax(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmax(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ double quad_sum(double x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// *addr += v in global memory, no return value (red.global.add.f32 / .f64)
__device__ __forceinline__ void red_add_f32(float* addr, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(addr), "f"(v) : "memory");
}
// addr[0] += x, addr[1] += y (addr 8-byte aligned): one red.global.add.v2.f32 on sm_90+ (the
// pair's 8 bytes in one request), two scalar reductions before
__device__ __forceinline__ void red_add_pair(float* addr, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(x), "f"(y) : "memory");
#else
    red_add_f32(addr, x);
    red_add_f32(addr + 1, y);
#endif
}
// ... in the accumulator type (the portable backward: float, or double for float64)
__device__ __forceinline__ void red_add(float* addr, float v) { red_add_f32(addr, v); }
__device__ __forceinline__ void red_add(double* addr, double v) {
    asm volatile("red.global.add.f64 [%0], %1;" :: "l"(addr), "d"(v) : "memory");
}
