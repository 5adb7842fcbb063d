// Question: do four DMMA m8n8k4 products on the float32 kernels' m16n8k8 fragments give A Bᵀ?
//
// One warp. A [16, 8] and B [8, 8] (B's rows are keys, as K in S = Q Kᵀ) in global memory,
// row-major. Each lane builds the m16n8k8 fragments the portable kernels build, in one of two
// k orders, and calls mma_k8<f64_t> (kernels_cu/common/mma.cuh: four m8n8k4 DMMAs); C [16, 8] is written back
// from the accumulator layout (c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8).
//   ORDER 0: the PTX tf32 layout, k = t (a0, a1, b0) and t + 4 (a2, a3, b1)
//   ORDER 1: the kernels' pair-load order, k = 2t (a0, a1, b0) and 2t + 1 (a2, a3, b1)
// Both must equal A Bᵀ: a k permutation applied to both operands leaves the sum unchanged.
#include "common/mma.cuh"

template <int ORDER>
__global__ void probe_dmma(const double* a_gmem,   // [16, 8]
                           const double* b_gmem,   // [8, 8]
                           double* c_gmem) {       // [16, 8]
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int k0 = ORDER ? 2 * t : t, k1 = ORDER ? 2 * t + 1 : t + 4;
    const double a[4] = {a_gmem[g * 8 + k0], a_gmem[(g + 8) * 8 + k0],
                         a_gmem[g * 8 + k1], a_gmem[(g + 8) * 8 + k1]};
    const double b0 = b_gmem[g * 8 + k0], b1 = b_gmem[g * 8 + k1];
    double c[4] = {0.0, 0.0, 0.0, 0.0};
    mma_k8<f64_t>(c, a, b0, b1);
    c_gmem[g * 8 + 2 * t] = c[0];
    c_gmem[g * 8 + 2 * t + 1] = c[1];
    c_gmem[(g + 8) * 8 + 2 * t] = c[2];
    c_gmem[(g + 8) * 8 + 2 * t + 1] = c[3];
}

// The same check for sm_90's single-instruction m16n8k8 .f64 (PTX ISA 7.8), on the fragments of
// ORDER 1: one instruction in place of mma_k8<f64_t>'s four. (A no-op body below sm_90.)
__global__ void probe_m16n8k8(const double* a_gmem, const double* b_gmem, double* c_gmem) {
#if __CUDA_ARCH__ >= 900
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int k0 = 2 * t, k1 = 2 * t + 1;
    const double a[4] = {a_gmem[g * 8 + k0], a_gmem[(g + 8) * 8 + k0],
                         a_gmem[g * 8 + k1], a_gmem[(g + 8) * 8 + k1]};
    const double b0 = b_gmem[g * 8 + k0], b1 = b_gmem[g * 8 + k1];
    double c[4] = {0.0, 0.0, 0.0, 0.0};
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b0), "d"(b1));
    c_gmem[g * 8 + 2 * t] = c[0];
    c_gmem[g * 8 + 2 * t + 1] = c[1];
    c_gmem[(g + 8) * 8 + 2 * t] = c[2];
    c_gmem[(g + 8) * 8 + 2 * t + 1] = c[3];
#endif
}

// Throughput: each warp runs `iters` rounds of 8 independent m16n8k8 f64 products (registers
// only), as four m8n8k4 DMMAs (SHAPE 0) or one m16n8k8 instruction (SHAPE 1, sm_90). 2048 flop
// per product. out: one value per thread (keeps the products alive).
template <int SHAPE>
__global__ void dmma_rate(double* out, int iters) {
    double c[8][4];
    const double a[4] = {1.0 + threadIdx.x, 0.5, 0.25, 0.125}, b0 = 1e-3, b1 = 2e-3;
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if constexpr (SHAPE == 0) {
                mma_k8<f64_t>(c[i], a, b0, b1);
            } else {
#if __CUDA_ARCH__ >= 900
                asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                             : "+d"(c[i][0]), "+d"(c[i][1]), "+d"(c[i][2]), "+d"(c[i][3])
                             : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b0), "d"(b1));
#endif
            }
        }
    }
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
