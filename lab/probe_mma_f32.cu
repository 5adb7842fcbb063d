// Question: do the bf16x3 float32 products (mma_f32, kernels_cu/common/mma.cuh) give A Bᵀ on the kernels' fragments, and how fast are the tensor-core instructions and a whole k8 step (kernels of probe_mma_f32.py)?
//
// Compiled twice by probe_mma_f32.py: as is (the bf16x3 split) and with -DCUPYFLASH_F32_3XTF32
// (the TF32 split), so the same kernel names measure either split.
#include "common/mma.cuh"

// One warp. A [16, K] and B [8, K] (B's rows are keys, as K in S = Q Kᵀ) in global memory,
// row-major, K = 8 · steps. Each lane loads the m16n8k8 fragments as the portable kernels do
// (k pair 2t, 2t + 1 of each 8-column step) and calls mma_f32<true, LONG_SUM> once per step;
// C [16, 8] is written back from the accumulator layout (c0, c1: row g, columns 2t, 2t + 1;
// c2, c3: row g + 8).
template <bool LONG_SUM>
__global__ void probe_f32_product(const float* a_gmem, const float* b_gmem, float* c_gmem, int steps) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, K = 8 * steps;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < steps; ++s) {
        const int k0 = s * 8 + 2 * t, k1 = k0 + 1;
        const float a[4] = {a_gmem[g * K + k0], a_gmem[(g + 8) * K + k0],
                            a_gmem[g * K + k1], a_gmem[(g + 8) * K + k1]};
        mma_f32<true, LONG_SUM>(c, a, b_gmem[g * K + k0], b_gmem[g * K + k1]);
    }
    c_gmem[g * 8 + 2 * t] = c[0];
    c_gmem[g * 8 + 2 * t + 1] = c[1];
    c_gmem[(g + 8) * 8 + 2 * t] = c[2];
    c_gmem[(g + 8) * 8 + 2 * t + 1] = c[3];
}

// Issue rate of one tensor-core instruction, registers only: each warp runs `iters` rounds of
// 8 independent products. SHAPE 0: tf32 m16n8k8; 1: bf16 m16n8k8; 2: bf16 m16n8k16.
// out: one value per thread (keeps the products alive).
template <int SHAPE>
__global__ void mma_rate(float* out, int iters) {
    float c[8][4];
    const u32 a[4] = {0x3f800000u + threadIdx.x, 0x3f000000u, 0x3e800000u, 0x3e000000u};
    const u32 b0 = 0x3a800000u, b1 = 0x3b000000u;
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if constexpr (SHAPE == 0) {
                mma1688_tf32(c[i], a, b0, b1);
            } else if constexpr (SHAPE == 1) {
                asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
                             "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                             : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                             : "r"(a[0]), "r"(a[1]), "r"(b0));
            } else {
                mma16816<bf16_t>(c[i], a, b0, b1);
            }
        }
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// A whole float32 k8 step as the forward's S = Q Kᵀ takes it (MT = 1): per step one A fragment
// (4 floats) from shared memory split once, then 8 key tiles, each a B pair from shared memory
// and one mma_f32 into its own accumulator. Shared memory: 64 rows x 8 floats (pitch 8 + 4),
// refilled by nothing, read at an offset that moves with the step so no load is hoisted.
template <bool LONG_SUM>
__global__ void mma_f32_rate(float* out, int iters) {
    __shared__ float tile[64 * 12];
    for (int i = threadIdx.x; i < 64 * 12; i += blockDim.x) tile[i] = 1.0f + 1e-3f * (float)i;
    __syncthreads();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float c[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
    for (int it = 0; it < iters; ++it) {
        const int row = (it & 3) * 16;
        const float2 lo = *(const float2*)(tile + (row + g) * 12 + 2 * t);
        const float2 hi = *(const float2*)(tile + (row + g + 8) * 12 + 2 * t);
        const float a[4] = {lo.x, hi.x, lo.y, hi.y};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 kb = *(const float2*)(tile + (((it + j) & 7) * 8 + g) * 12 + 2 * t);
            mma_f32<true, LONG_SUM>(c[j], a, kb.x, kb.y);
        }
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
