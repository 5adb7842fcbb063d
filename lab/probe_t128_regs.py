# Question: Does the heaviest consumer of the hd 128 float32 backward design fit its registers? (compile only, ptxas -v)
"""Compile-only probe (NVRTC, sm_90a, ptxas -v) of design T's heaviest consumer at hd 128
(docs/f32-backward-design.md, "Design T (hd 128)"): consumer 1's step with its held dKᵀ_1 / dVᵀ_1
(64 registers), dPᵀ = V dOᵀ with A split on the fly from raw V (16 k-steps, batches of 4 k-steps,
two batches in flight), dSᵀ from a Pᵀ read-back stored in two layouts, dVᵀ_1 / dKᵀ_1 through a
zeroed step accumulator, dQᵀ_1 with Kᵀ_1 split on the fly, red.add. Addresses and descriptors are
placeholders: it is NEVER RUN and computes nothing meaningful; it only asks ptxas whether the
register peak fits setmaxnreg 224 without spills.

    python lab/probe_t128_regs.py
"""
import pathlib

from cupy_backends.cuda.libs import nvrtc

KDIR = pathlib.Path(__file__).resolve().parents[1] / "kernels_cu"

SRC = r'''
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

__device__ __forceinline__ void jit_frag(u32 addr, u32* big, u32* small) {
    float2 a, b;   // A(r, c), A(r, c + 4) adjacent and A(r + 8, ...) after the d-slot relabelling
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(a.x), "=f"(a.y) : "r"(addr));
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(b.x), "=f"(b.y) : "r"(addr + 1024));
    float v[4] = {a.x, b.x, a.y, b.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(v[i], big[i], small[i]);
}

extern "C" __global__ void __launch_bounds__(384, 1)
probe_t128_c1(const float* __restrict__ rows, float* __restrict__ dq, float* __restrict__ dkv,
              int steps, float scale) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 base = (u32)__cvta_generic_to_shared(smem);
    if (threadIdx.x < 128) { regs_release<56>(); return; }
    regs_acquire<224>();
    const int t = threadIdx.x % 128, w = t / 32, l = t % 32;
    const u32 lane_off = (u32)((16 * w + l / 4) * 128 + (l % 4) * 8);
    float dvt[32], dkt[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) { dvt[i] = 0.f; dkt[i] = 0.f; }
    for (int st = 0; st < steps; ++st) {
        // dPᵀ [64 keys, 32 q] = V dOᵀ: A = V raw split on the fly, B = dO big / small
        float dpt[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) dpt[i] = 0.f;
        u32 fb[2][4][4], fs[2][4][4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            if (b >= 2) wgmma_wait<1>();
#pragma unroll
            for (int k = 0; k < 4; ++k)
                jit_frag(base + 32768 + lane_off + (b * 4 + k) * 4096, fb[b & 1][k], fs[b & 1][k]);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 kk = (u32)(b * 4 + k);
                wgmma_rs_tf32<32>(dpt, fs[b & 1][k], smem_desc(base + 65536 + kk * 32, 0, 1024));
                wgmma_rs_tf32<32>(dpt, fb[b & 1][k], smem_desc(base + 81920 + kk * 32, 0, 1024));
                wgmma_rs_tf32<32>(dpt, fb[b & 1][k], smem_desc(base + 65536 + kk * 32, 0, 1024));
            }
            wgmma_commit();
        }
        wgmma_wait<0>();
        fence_regs<16>(dpt);
        // dSᵀ = Pᵀ ∘ (dPᵀ − D)·scale with Pᵀ read back (big + small) from c0's tile
        const float Dv = rows[st * 32 + (t % 4) * 2];
        u32 dsb[16], dss[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 a = base + 147456 + lane_off + i * 512;
            float pb, ps;
            asm volatile("ld.shared.f32 %0, [%1];" : "=f"(pb) : "r"(a));
            asm volatile("ld.shared.f32 %0, [%1];" : "=f"(ps) : "r"(a + 8192));
            split_tf32((pb + ps) * (dpt[i] - Dv) * scale, dsb[i], dss[i]);
            asm volatile("st.shared.v2.b32 [%0], {%1, %2};" :: "r"(a + 16384), "r"(dsb[i]), "r"(dss[i]));
            asm volatile("st.shared.v2.b32 [%0], {%1, %2};" :: "r"(a + 32768), "r"(dsb[i]), "r"(dss[i]));
        }
        named_bar_sync(4, 256);
        // dVᵀ_1 then dKᵀ_1 [64 d, 64 keys], k = 32 queries: A loaded from dO / Q big + small
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            float acc[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[i] = 0.f;
            u32 ab[4][4], as[4][4];
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const u32 a = base + 98304 + which * 16384 + lane_off + k * 1024 + i * 256;
                    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(ab[k][i]) : "r"(a));
                    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(as[k][i]) : "r"(a + 8192));
                }
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 bt = base + 163840 + which * 16384 + k * 32;
                wgmma_rs_tf32<64>(acc, as[k], smem_desc(bt, 0, 1024));
                wgmma_rs_tf32<64>(acc, ab[k], smem_desc(bt + 8192, 0, 1024));
                wgmma_rs_tf32<64>(acc, ab[k], smem_desc(bt, 0, 1024));
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs<32>(acc);
#pragma unroll
            for (int i = 0; i < 32; ++i) { if (which == 0) dvt[i] += acc[i]; else dkt[i] += acc[i]; }
        }
        // dQᵀ_1 [64 d, 32 q] = Kᵀ_1 dSᵀ over 64 keys: A = Kᵀ_1 split on the fly from raw K
        float dqt[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) dqt[i] = 0.f;
        u32 kb[2][4][4], ks[2][4][4];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
#pragma unroll
            for (int k = 0; k < 4; ++k) jit_frag(base + lane_off + 16384 + (b * 4 + k) * 4096, kb[b][k], ks[b][k]);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 bt = base + 196608 + (u32)(b * 4 + k) * 32;
                wgmma_rs_tf32<32>(dqt, ks[b][k], smem_desc(bt, 0, 1024));
                wgmma_rs_tf32<32>(dqt, kb[b][k], smem_desc(bt + 8192, 0, 1024));
                wgmma_rs_tf32<32>(dqt, kb[b][k], smem_desc(bt, 0, 1024));
            }
            wgmma_commit();
        }
        wgmma_wait<0>();
        fence_regs<16>(dqt);
        float* q = dq + (size_t)st * 4096 + t * 2;
#pragma unroll
        for (int i = 0; i < 16; i += 2)
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(q + i * 256), "f"(dqt[i]), "f"(dqt[i + 1]) : "memory");
    }
    float* o = dkv + t * 64;
#pragma unroll
    for (int i = 0; i < 32; ++i) { o[i] = dvt[i]; o[32 + i] = dkt[i]; }
}
'''


def main():
    prog = nvrtc.createProgram(SRC, "probe_t128_regs.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", f"-I{KDIR}", "-arch=sm_90a", "--ptxas-options=-v"])
        finally:
            print(nvrtc.getProgramLog(prog).replace("\0", ""))
    finally:
        nvrtc.destroyProgram(prog)


if __name__ == "__main__":
    main()
