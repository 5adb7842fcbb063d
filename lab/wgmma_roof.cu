// Question: What is the tensor-core roof of the Hopper forward's key-tile products (kernel of wgmma_roof.py)?
// cupyflash: the tensor-core roof of the Hopper forward's products on sm_90a, for
// lab/wgmma_roof.py. Not part of the package's kernels (nothing in cupyflash/ loads it).
//
// One block per SM of NC warpgroups, each repeating `iters` times the products of one key-tile
// step of kernels_cu/hopper/fwd.cu at hd 128 × 128 keys, with no softmax, no loads and no
// synchronization between the warpgroups, on random 16-bit data in shared memory (the card's
// clock under load depends on the data: zeros run faster):
//   MODE 0  S = Q Kᵀ only: 8 k-steps of m64n128k16, Q [64, 128] and K [128, 128] in shared
//           memory (K-major, 128-byte swizzle, 2 panels of 64 columns each)
//   MODE 1  O += P V only: 8 k-steps of m64n128k16, P from registers, V [128, 128] MN-major
//   MODE 2  both, as the forward's turn issues them: S, then O += P V, one commit group
//           per product, at most two groups in flight
//   MODE 3  S = Q Kᵀ at N = 256 (m64n256k16, K [256, 128]): the widest product, the GEMM roof
// Clock counts of each warpgroup go to clocks[block·NC + wg]; the host times the whole grid with
// CUDA events and counts 2·64·N·16 FLOPs per product.
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

template <int MODE, int NC>
__global__ void __launch_bounds__(128 * NC, 1)
wgmma_roof(const uint4* __restrict__ fill, long long* clocks, float* sink, int iters) {
    extern __shared__ unsigned char smem_raw[];
    const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;   // swizzled panels: 1024-aligned
    constexpr int N = MODE == 3 ? 256 : 128;                    // S columns (keys)
    constexpr int Q_BYTES = 2 * 64 * 128;                       // one warpgroup's Q [64, 128]
    constexpr int K_BYTES = 2 * N * 128;                        // K [N, 128]
    constexpr int V_BYTES = 2 * 128 * 128;                      // V [128, 128]
    constexpr int BYTES = NC * Q_BYTES + K_BYTES + V_BYTES;
    // random 16-bit values from global memory into every tile (16-byte stores)
    for (int i = threadIdx.x; i < BYTES / 16; i += blockDim.x) {
        const uint4 x = fill[i];
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
                     :: "r"(smem + 16 * i), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic stores -> wgmma
    __syncthreads();

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    const u32 q = smem + wg * Q_BYTES, k = smem + NC * Q_BYTES, v = k + K_BYTES;
    const u64 q_desc = smem_desc(q, 16, 1024), k_desc = smem_desc(k, 16, 1024);
    const u64 v_desc = smem_desc(v, 128 * 128, 1024);   // MN-major: LBO = bytes between panels
    float s_acc[N / 2];                 // S [64, N] of this warpgroup, fp32
    float o_acc[MODE == 1 || MODE == 2 ? 64 : 1];   // O [64, 128]
    u32 p_frag[32];                     // P [64, 128] as 16-bit A fragments (random bits)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s_acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(o_acc) / 4); ++i) o_acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) p_frag[i] = fill[(t * 32 + i) % (BYTES / 16)].x & 0x3f7f3f7fu;   // in [0, 1)

    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        if constexpr (MODE != 1) {      // S = Q Kᵀ [64, N]
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const u32 off = (kk % 4) * 32;
                // (always accumulating: with a fresh S per step ptxas drops every step's
                // products but the last, whose result alone is read)
                wgmma_ss<bf16_t, N>(s_acc, desc_add(q_desc, (kk / 4) * 64 * 128 + off),
                                    desc_add(k_desc, (kk / 4) * N * 128 + off), 1);
            }
            wgmma_commit();
        }
        if constexpr (MODE == 1 || MODE == 2) {   // O += P V [64, 128]
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk)
                wgmma_rs<bf16_t, 128>(o_acc, p_frag + 4 * kk, desc_add(v_desc, kk * 2048));
            wgmma_commit();
        }
        wgmma_wait<MODE == 2 ? 2 : 1>();   // at most two groups (MODE 2: two steps' S and PV) in flight
    }
    wgmma_wait<0>();
    fence_regs<N / 2>(s_acc);
    fence_regs<(int)(sizeof(o_acc) / 4)>(o_acc);
    const long long t1 = clock64();
    if (t == 0) clocks[blockIdx.x * NC + wg] = t1 - t0;
    float x = s_acc[0] + o_acc[0];      // keeps the products alive
    if (x == 12345.f) sink[threadIdx.x] = x;
}
