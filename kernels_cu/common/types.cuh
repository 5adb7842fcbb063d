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

struct f64_t {};    // float64: DMMA (mma.sync m8n8k4 f64) products, double accumulators

// storage: the element in memory; acc: the type of accumulators, softmax statistics, lse, D,
// the dQ / dbias accumulators and the score transforms (float, or double for f64_t)
template <typename E> struct Elem;
template <> struct Elem<f16_t>  { typedef u16 storage;    typedef float acc;  static constexpr bool is16 = true;  static constexpr bool split = false; };
template <> struct Elem<bf16_t> { typedef u16 storage;    typedef float acc;  static constexpr bool is16 = true;  static constexpr bool split = false; };
template <> struct Elem<f32x3_t>{ typedef float storage;  typedef float acc;  static constexpr bool is16 = false; static constexpr bool split = true; };
template <> struct Elem<tf32_t> { typedef float storage;  typedef float acc;  static constexpr bool is16 = false; static constexpr bool split = false; };
template <> struct Elem<f64_t>  { typedef double storage; typedef double acc; static constexpr bool is16 = false; static constexpr bool split = false; };
template <typename E> using Acc = typename Elem<E>::acc;
template <typename E> constexpr bool is_f64 = sizeof(typename Elem<E>::storage) == 8;

// Two adjacent elements as one 8-byte (float) or 16-byte (double) access
template <typename T> struct Vec2;
template <> struct Vec2<float>  { typedef float2 type; };
template <> struct Vec2<double> { typedef double2 type; };
template <typename T> __device__ __forceinline__ typename Vec2<T>::type vec2(T x, T y) {
    typename Vec2<T>::type v; v.x = x; v.y = y; return v;
}

// Constants in the accumulator type: log2(e), ln 2
template <typename A> __device__ __forceinline__ A log2e();
template <> __device__ __forceinline__ float log2e<float>() { return CF_LOG2E; }
template <> __device__ __forceinline__ double log2e<double>() { return 1.4426950408889634; }
template <typename A> __device__ __forceinline__ A ln2();
template <> __device__ __forceinline__ float ln2<float>() { return CF_LN2; }
template <> __device__ __forceinline__ double ln2<double>() { return 0.6931471805599453; }
// |x| of an integer distance, in A (ALiBi)
__device__ __forceinline__ float abs_as(int x, float) { return fabsf((float)x); }
__device__ __forceinline__ double abs_as(int x, double) { return fabs((double)x); }

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

// accumulator -> stored element
template <typename E> __device__ __forceinline__ typename Elem<E>::storage from_acc(Acc<E> x) {
    if constexpr (is_f64<E>) return x; else return from_float<E>(x);
}

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

// stored element -> accumulator type
template <typename E> __device__ __forceinline__ Acc<E> to_acc(typename Elem<E>::storage x) {
    if constexpr (is_f64<E>) return x; else return to_float<E>(x);
}

// ---------------------------------------------------------------------------------------------
// Special functions
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float fast_exp2(float x) {   // 2^x, ex2.approx (exp2(-inf) = 0)
    float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
// 2^x in the accumulator type: ex2.approx for float, CUDA's exp2 for double (no fast f64 path)
__device__ __forceinline__ float exp2_acc(float x) { return fast_exp2(x); }
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }
