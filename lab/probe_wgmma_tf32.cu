// Question: How many clocks does a TF32 wgmma m64nNk8 product take (kernel of probe_wgmma_tf32.py)?
// cupyflash: microbenchmark of TF32 wgmma rates on sm_90a (lab/probe_wgmma_tf32.py), the two
// assumptions behind docs/f32-backward-design.md's budget: an m64nNk8 TF32 product takes N / 2
// clocks, and a shared-memory operand streams at most 128 bytes per clock per SM. Not part of
// the package's kernels.
//
// WGS warpgroups per block (one block per SM) each issue `iters` groups of 8 k-steps of
// m64nNk8 TF32 products into one accumulator: MODE 0 both operands from shared memory (A [64, 32]
// panels, B [N, 32] panels, K-major, 128-byte swizzle), MODE 1 A from registers. Each warpgroup
// keeps at most two groups in flight. Clock counts per warpgroup go to clocks[block·WGS + wg].
// Shared memory: zeros (the rates do not depend on the values).
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

template <int N, int MODE, int WGS>
__global__ void __launch_bounds__(128 * WGS, 1)
probe_wgmma_tf32(long long* clocks, int iters) {
    extern __shared__ unsigned char smem_raw[];
    const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;   // swizzled panels: 1024-aligned
    constexpr int A_BYTES = 2 * 64 * 128;                        // A [64, 64]: two panels of 32
    constexpr int B_BYTES = 2 * N * 128;                         // B [N, 64]: two panels of 32
    // zero every warpgroup's A and the shared B (16-byte stores)
    for (int i = threadIdx.x; i < (WGS * A_BYTES + B_BYTES) / 16; i += blockDim.x)
        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" :: "r"(smem + 16 * i), "r"(0) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic stores -> wgmma
    __syncthreads();

    const int wg = threadIdx.x / 128;
    const u32 a_wg = smem + wg * A_BYTES, b = smem + WGS * A_BYTES;
    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
    u32 a_frag[32];                                              // A [64, 64] as TF32 fragments
#pragma unroll
    for (int i = 0; i < 32; ++i) a_frag[i] = 0u;

    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const u32 a_off = (kk / 4) * 64 * 128 + (kk % 4) * 32;
            const u32 b_off = (kk / 4) * N * 128 + (kk % 4) * 32;
            if constexpr (MODE == 0)
                wgmma_ss_tf32<N>(acc, smem_desc(a_wg + a_off, 16, 1024), smem_desc(b + b_off, 16, 1024), 1);
            else
                wgmma_rs_tf32<N>(acc, a_frag + 4 * kk, smem_desc(b + b_off, 16, 1024));
        }
        wgmma_commit();
        wgmma_wait<1>();                                         // at most two groups in flight
    }
    wgmma_wait<0>();
    fence_regs<N / 2>(acc);
    fence_regs<32>(a_frag);
    const long long t1 = clock64();
    if (threadIdx.x % 128 == 0) clocks[blockIdx.x * WGS + wg] = t1 - t0;
    if (acc[0] != 0.f) clocks[0] = -1;                           // keeps the products alive
}
