// cupyflash: the split-KV decode kernel's parts (flash_decode in portable/decode.cu wires them):
// the K / V tile copies into a warp's ring (DecodeSmem, cp_async_kv, load_kv_tile), the L2-only
// loads of other CTAs' partials (ld_cg, ld_cg2), and the fused combine (decode_combine: the split
// that finishes last merges the partials). flash_decode's setup, key loop and warps' merge / store
// stay in the kernel (docs/architecture.md: as parts they compiled to other SASS).
// Included by portable/decode.cu after struct DecodeParams, cache_len and page_of.
#pragma once

#include "common/mma.cuh"
#include "common/types.cuh"

template <int D> struct DecodeSmem {
    static constexpr int P = D + 8;               // row pitch (elements): conflict-free ldmatrix
    static constexpr int TILE = 16 * P;           // one 16-key K or V tile (elements)
};

// The K / V tile copies: cp.async with an L2 prefetch-size hint when KV_L2_PREFETCH is 128 or 256
// (a build option: plan_decode.TUNING["l2_prefetch"]); a cache row of one kv head is d * 2 bytes
// contiguous (256 at hd 128)
#ifndef KV_L2_PREFETCH
#define KV_L2_PREFETCH 0
#endif
__device__ __forceinline__ void cp_async_kv(void* smem, const void* gmem, int src_bytes) {
#if KV_L2_PREFETCH == 256
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
#elif KV_L2_PREFETCH == 128
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
#else
    cp_async_16(smem, gmem, src_bytes);
#endif
}

// Keys [key0, key0 + 16) of K and V (page blk, first row off) into a warp's ring slot (k_smem,
// v_smem: [16, P] each); rows at or past `len` are zero-filled. The tile lies inside one page
// (pages are multiples of 16 keys).
template <int D>
__device__ __forceinline__ void load_kv_tile(u16* k_smem, u16* v_smem, const DecodeParams& p, int blk,
                                             int off, int head_k, int key0, int len, int lane) {
    constexpr int P = DecodeSmem<D>::P;
    constexpr int CPR = D / 8;                    // 16-byte chunks per row
    const u16* k_gmem = (const u16*)p.k_cache + blk * p.k_stride_blk + (long long)off * p.k_stride_s + head_k * p.k_stride_h;   // [16, d]
    const u16* v_gmem = (const u16*)p.v_cache + blk * p.v_stride_blk + (long long)off * p.v_stride_s + head_k * p.v_stride_h;   // [16, d]
#pragma unroll
    for (int i = 0; i < 16 * CPR / 32; ++i) {
        const int c = lane + i * 32;
        const int r = c / CPR, col = (c % CPR) * 8;
        const int ok = key0 + r < len ? 16 : 0;
        cp_async_kv(k_smem + r * P + col, ok ? (const void*)(k_gmem + r * p.k_stride_s + col) : p.k_cache, ok);
        cp_async_kv(v_smem + r * P + col, ok ? (const void*)(v_gmem + r * p.v_stride_s + col) : p.v_cache, ok);
    }
}

// 16-byte loads through L2 only (partials other CTAs wrote during this launch)
__device__ __forceinline__ float ld_cg(const float* ptr) {
    float v; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr)); return v;
}
__device__ __forceinline__ float2 ld_cg2(const float* ptr) {
    float2 v; asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(ptr)); return v;
}

// The fused combine, after a split stored its partial O / lse: the split of this (batch, row
// tile, kv head) that finishes last merges every split's partial into the output.
template <typename E, int D, int MT, int NW>
__device__ __forceinline__ void decode_combine(const DecodeParams& p, float* merge_smem, int tid, int warp, int lane,
                                               int head_k, int batch, int m_tile, int rows, int m0) {
    constexpr int BM = 16 * MT;                   // packed rows per CTA
    constexpr int NT = NW * 32;
    // Fused combine: the last split of this (batch, row tile, kv head) to finish merges every
    // split's partial: lse = log Σ_s exp(lse_s), O = Σ_s exp(lse_s − lse) O_s
    __shared__ int is_last;
    __threadfence();   // this thread's partial stores are visible device-wide before the count
    __syncthreads();   // every thread's stores fenced (and the merge area no longer read)
    const int group = (batch * p.num_m_tiles + m_tile) * p.h_k + head_k;
    if (tid == 0) is_last = atomicAdd(p.split_count + group, 1u) == (unsigned)(p.num_splits - 1);
    __syncthreads();   // is_last visible to every thread
    if (!is_last) return;
    __threadfence();   // the other splits counted after their fences: their partials are visible
    const int S = p.num_splits;
    float* w_smem = merge_smem;                                  // [BM][S] weights exp(lse_s − lse)
    const long long split_lse = (long long)p.b * p.h * p.s_q;    // lse_part stride of one split
    const long long split_o = (long long)p.b * p.s_q * p.h * D;  // o_part stride of one split
    for (int r = warp; r < BM; r += NW) {                        // one warp per row
        const int pr = m0 + r;
        if (pr >= rows) continue;
        const int qi = pr / p.g, head = head_k * p.g + pr % p.g;
        const float* lse_in = p.lse_part + ((long long)batch * p.h + head) * p.s_q + qi;   // [S] (strided)
        float m = -CF_INF;
        for (int sp = lane; sp < S; sp += 32) m = fmaxf(m, ld_cg(lse_in + sp * split_lse));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float m_use = m == -CF_INF ? 0.f : m;
        float sum = 0.f;
        for (int sp = lane; sp < S; sp += 32) {
            const float e = fast_exp2((ld_cg(lse_in + sp * split_lse) - m_use) * CF_LOG2E);
            w_smem[r * S + sp] = e;
            sum += e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int sp = lane; sp < S; sp += 32) w_smem[r * S + sp] *= inv;   // (this lane's own entries)
        if (lane == 0) p.lse[((long long)batch * p.h + head) * p.s_q + qi] = sum > 0.f ? m_use + logf(sum) : -CF_INF;
    }
    __syncthreads();   // the weights are in shared memory
    for (int c = tid; c < BM * (D / 2); c += NT) {
        const int r = c / (D / 2), col = (c % (D / 2)) * 2;
        const int pr = m0 + r;
        if (pr >= rows || col >= p.d) continue;
        const int qi = pr / p.g, head = head_k * p.g + pr % p.g;
        const float* o_in = p.o_part + (((long long)batch * p.s_q + qi) * p.h + head) * D + col;   // [S] (strided)
        float o0 = 0.f, o1 = 0.f;
        for (int sp = 0; sp < S; ++sp) {
            const float wt = w_smem[r * S + sp];
            if (wt == 0.f) continue;          // a split without keys adds nothing
            const float2 v = ld_cg2(o_in + sp * split_o);
            o0 += wt * v.x;
            o1 += wt * v.y;
        }
        u16* dst = (u16*)p.o + batch * p.o_stride_b + qi * p.o_stride_s + head * p.o_stride_h + col;
        *(u32*)dst = pack2<E>(o0, o1);
    }
    if (tid == 0) p.split_count[group] = 0;   // zero again for the next launch
}
