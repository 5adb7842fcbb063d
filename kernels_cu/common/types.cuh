// cupyflash: element types and scalar helpers shared by every kernel (portable and Hopper).
//
// No CUDA toolkit header is included anywhere: NVRTC alone compiles this (pip-only installs,
// CI without a GPU). fp16 / bf16 values travel as raw 16-bit patterns and are converted with
// PTX `cvt`.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define CF_INF __int_as_float(0x7f800000)
#define CF_LOG2E 1.4426950408889634f
#define CF_LN2 0.6931471805599453f

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

// stored element -> float
template <typename E> __device__ __forceinline__ float to_float(typename Elem<E>::storage x);
template <> __device__ __forceinline__ float to_float<f16_t>(u16 x) {
    float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x)); return r;
}
template <> __device__ __forceinline__ float to_float<bf16_t>(u16 x) { return __uint_as_float((u32)x << 16); }
template <> __device__ __forceinline__ float to_float<f32x3_t>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<tf32_t>(float x) { return x; }

// ---------------------------------------------------------------------------------------------
// Special functions
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float fast_exp2(float x) {   // 2^x, ex2.approx (exp2(-inf) = 0)
    float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
