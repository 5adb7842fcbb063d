// Question: do four DMMA m8n8k4 products on the float32 kernels' m16n8k8 fragments give A Bᵀ?
//
// One warp. A [16, 8] and B [8, 8] (B's rows are keys, as K in S = Q Kᵀ) in global memory,
// row-major. Each lane builds the m16n8k8 fragments the portable kernels build, in one of two
// k orders, and calls mma_k8<f64_t> (common.cuh: four m8n8k4 DMMAs); C [16, 8] is written back
// from the accumulator layout (c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8).
//   ORDER 0: the PTX tf32 layout, k = t (a0, a1, b0) and t + 4 (a2, a3, b1)
//   ORDER 1: the kernels' pair-load order, k = 2t (a0, a1, b0) and 2t + 1 (a2, a3, b1)
// Both must equal A Bᵀ: a k permutation applied to both operands leaves the sum unchanged.
#include "common.cuh"

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
