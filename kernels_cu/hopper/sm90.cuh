// cupyflash: sm_90a (Hopper) building blocks for the hopper/ kernels: mbarriers, TMA tile
// loads, wgmma shared-memory descriptors and fences, shared-memory accesses, TF32 splits, named
// barriers, register reallocation. Inline PTX only (no CUDA toolkit header), like common/.
// Needs -arch=sm_90a.
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"

typedef unsigned long long u64;

// ---------------------------------------------------------------------------------------------
// mbarrier (shared-memory transaction barrier). `bar` is a shared-memory address (u32).
// A phase completes when `count` arrivals happened and every expected byte of TMA traffic landed.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {   // make the inits visible to the async proxy
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// one arrival that also announces `bytes` of incoming TMA traffic for this phase
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// spin until the phase with this parity has completed
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\n"
                 "MBAR_WAIT:\n"   // a label local to this { } scope: each inlined copy has its own
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra MBAR_WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}

// ---------------------------------------------------------------------------------------------
// TMA: one box of a rank-4 tensor map (coordinates innermost first: column, row, head, batch)
// into shared memory; completion is counted in bytes on `bar`. Out-of-bounds elements are zeros.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];"
                 :: "r"(dst), "l"((u64)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// the same box prefetched into L2 only (no shared memory, no barrier): a later tma_load_4d of it
// reads L2 instead of device memory
__device__ __forceinline__ void tma_prefetch_l2_4d(const TmaDesc* map, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];"
                 :: "l"((u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"((u64)map) : "memory");
}
// the reverse: one box of shared memory (the map's swizzled layout) into the tensor, by the TMA
// unit; elements out of bounds are not written. Counted in this thread's bulk group.
__device__ __forceinline__ void tma_store_4d(const TmaDesc* map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 :: "l"((u64)map), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// Bulk groups of this thread's TMA stores / bulk reductions: close one, wait for all but N
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_read() {   // sources read: smem reusable
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {        // writes done too
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
// Four 8 x 8 16-bit matrices from registers into shared memory: register i of each lane holds
// its (row lane / 4, columns 2·(lane % 4), + 1) pair of matrix i (the mma accumulator layout);
// lane l gives the address of row l % 8 of matrix l / 8 (16 contiguous bytes)
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma shared-memory matrix descriptor, 128-byte swizzle: start address >> 4 (bits 0-13),
// leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), swizzle mode 1 (62-63).
// K-major tile (rows of 128 bytes): SBO = 1024 (8 rows); LBO unused. MN-major tile: LBO = bytes
// between 64-column panels, SBO = 1024.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
           (1ull << 62);
}
// The descriptor of the tile at byte offset off (a multiple of 16) from the one desc describes:
// the address field (bits 0-13, in 16-byte units) of a shared address below 256 KB does not
// carry, so it is one add to the low word (smem_desc's mask, shift and or per wgmma took ~10
// instructions each in the forward's key-tile loop)
__device__ __forceinline__ u64 desc_add(u64 desc, u32 off) {
    return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + (off >> 4));
}

__device__ __forceinline__ void wgmma_fence() {      // registers written before -> visible to wgmma
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {        // at most N groups still in flight
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Pin accumulator registers at this point of the program: the compiler must not move their reads
// or writes across an asynchronous wgmma's issue or its wait.
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
// The same for 16-bit-pair A fragments that an in-flight wgmma reads from registers: pinned after
// its wait, they stay allocated (and unmodified) until the product has consumed them.
template <int N>
__device__ __forceinline__ void fence_regs(u32* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

// ---------------------------------------------------------------------------------------------
// Shared memory from the generic proxy (addresses in the shared window), and the fence that makes
// such writes visible to wgmma / TMA (async proxy)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void lds128(u32 addr, float* x) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void sts128(u32 addr, const u32* x) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
}
__device__ __forceinline__ void lds64(u32 addr, u32& x, u32& y) {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(x), "=r"(y) : "r"(addr) : "memory");
}
__device__ __forceinline__ float lds32(u32 addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
    return x;
}
__device__ __forceinline__ void sts32(u32 addr, u32 x) {
    asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(x) : "memory");
}
// float32 to TF32 (an fp32 bit pattern with the low 13 mantissa bits zero), rounded to nearest
// even: cvt.rn.tf32.f32, one F2FP instruction on sm_90 (common/types.cuh's to_tf32, cvt.rna for the
// portable kernels on sm_80, is three: FSETP + IADD + LOP3). Measured: the float32 forward
// +3–24 %, the backward +11–14 % against cvt.rna (docs/hopper.md).
__device__ __forceinline__ u32 tf32_rn(float x) {
    u32 r;
    asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// float32 as two TF32 parts (3xTF32 products): x = big + small, big = tf32_rn(x),
// small = tf32_rn(x − big) (x − big is exact in fp32, and |x − big − small| <= 2^-22 |x|)
__device__ __forceinline__ void split_tf32(float x, u32& big, u32& small) {
    big = tf32_rn(x);
    small = tf32_rn(x - __uint_as_float(big));
}

// One work item of the float32 kernels' transposes (hopper/fwd_f32.cu's Vᵀ, hopper/bwd_f32.cu's Qᵀ /
// dOᵀ): a [R, D] float32 tile of rows (keys or queries; swizzled panels [D/32][R][32]) to
// [R/32][D][32] (row = column d), the rows permuted inside each 8-row k-step (row 2c -> slot c,
// 2c + 1 -> slot c + 4: the order of the P / dS A fragments). Item i = 4 rows 8·kg + par + 2·ii
// (ii = 0..3; slots 4·par + ii: chunk pc of a destination row) x 4 columns 4·dc .. + 3 (dc =
// 8·dcq + dc8: chunk dc8 of a source row in panel dcq). The 8 lanes of a shared-memory phase
// (lane % 8 = par + 2·q4) take par, kg % 4 = q4 and dc8 = dc0 + 2·((q4 + rot) % 4): their loads
// hit 8 distinct chunk positions (dc8 XOR row % 8) and so do their stores (pc XOR d % 8, d % 8
// the same for all 8): no bank conflicts (tests/test_sm90_f32_layout.py).
template <int R, int D>
struct TransposeItem {
    int dcq, dc8, kgq, kg, par, pc;
    __device__ __forceinline__ explicit TransposeItem(int i) {
        const int b = i % 8, o = i / 8;
        const int rot = o % 4, dc0 = (o / 4) % 2;
        kgq = (o / 8) % (R / 32);
        dcq = o / (8 * (R / 32));
        par = b & 1;
        const int q4 = b >> 1;
        dc8 = dc0 + 2 * ((q4 + rot) & 3);   // dc % 8
        kg = 4 * kgq + q4;                  // 8-row step in the tile
        pc = 2 * q4 + par;                  // 16-byte chunk in the destination rows
    }
    // address of source row ii's chunk in the [D/32][R][32] tile at `tile`
    __device__ __forceinline__ u32 src(u32 tile, int ii) const {
        const int r = 8 * kg + par + 2 * ii;
        return tile + dcq * (R * 128) + r * 128 + ((dc8 ^ (r % 8)) * 16);
    }
    // byte offset of destination row d0 + e's chunk in the [R/32][D][32] tile (d0 = 4·dc)
    __device__ __forceinline__ u32 dst(int e) const {
        const int d = 4 * (8 * dcq + dc8) + e;
        return kgq * (D * 128) + d * 128 + ((pc ^ (d % 8)) * 16);
    }
    // The item moved: its 4 x 4 values read from the tile at `src`, written transposed as TF32
    // big / small parts to the tiles at dst_big / dst_small (SPLIT; else big = tf32_rn alone)
    template <bool SPLIT>
    __device__ __forceinline__ void move(u32 src, u32 dst_big, u32 dst_small) const {
        float v[4][4];                                   // v[ii][e] = X[row ii][4·dc + e]
#pragma unroll
        for (int ii = 0; ii < 4; ++ii) lds128(this->src(src, ii), v[ii]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 off = dst(e);                      // destination row 4·dc + e
            u32 big[4], small[4];
#pragma unroll
            for (int ii = 0; ii < 4; ++ii) {
                if (SPLIT) split_tf32(v[ii][e], big[ii], small[ii]);
                else big[ii] = tf32_rn(v[ii][e]);
            }
            sts128(dst_big + off, big);
            if (SPLIT) sts128(dst_small + off, small);
        }
    }
};

// ---------------------------------------------------------------------------------------------
// Named barriers (ids 1..15; 0 is __syncthreads) over `threads` threads, and warpgroup
// register reallocation.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
// bar.sync that also ORs `pred` over the `threads` threads: each gets whether any had it set
__device__ __forceinline__ bool named_bar_or(int id, int threads, bool pred) {
    u32 any;
    asm volatile("{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\t"
                 "bar.red.or.pred q, %2, %3, p;\n\tselp.u32 %0, 1, 0, q;\n\t}"
                 : "=r"(any) : "r"((u32)pred), "r"(id), "r"(threads) : "memory");
    return any != 0;
}
template <int R> __device__ __forceinline__ void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(R));
}
template <int R> __device__ __forceinline__ void regs_acquire() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(R));
}

// tanh(x) = 1 - 2 / (2^(2x·log2 e) + 1): ex2.approx and a fast divide, ~1e-7 absolute error
// (tanh.approx.f32 is ~5e-4, too coarse once multiplied by a softcap of 30 or 50)
__device__ __forceinline__ float tanh_fast(float x) {
    return 1.f - __fdividef(2.f, fast_exp2(x * (2.f * CF_LOG2E)) + 1.f);
}

// The block's dynamic shared memory, 1024-aligned (the swizzled panels need it): the launcher
// sizes the launch, so stop loudly if it gave less than the kernel's layout L needs (L::BYTES
// + 1024 bytes of alignment slack)
template <typename L>
__device__ __forceinline__ u32 aligned_smem(unsigned char* smem_raw) {
    u32 smem_given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    return (smem_addr(smem_raw) + 1023u) & ~1023u;
}
