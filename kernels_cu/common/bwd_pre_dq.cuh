// cupyflash: the backward's helper kernels, shared by the portable backward (portable/bwd.cu)
// and the Hopper 16-bit backward (hopper/bwd.cu): flash_bwd_pre (D = rowsum(dO ∘ O), dQ
// accumulator zeroed) and flash_bwd_dq (dq = E(dQ accumulator)).
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"

// ---------------------------------------------------------------------------------------------
// D = rowsum(dO ∘ O) per query row (Acc<E>: float, double for float64), and the dQ
// accumulator row zeroed (atomic mode).
// One warp per row (b, h, i); 8 rows per 256-thread block.
// ---------------------------------------------------------------------------------------------
template <typename E>
__global__ void __launch_bounds__(256)
flash_bwd_pre(const Params p) {
    typedef typename Elem<E>::storage S;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);           // (batch * h + head) * s_q + i
    if (row >= (i64)p.b * p.h * p.s_q) return;
    const int i = (int)(row % p.s_q);
    const int head = (int)((row / p.s_q) % p.h), batch = (int)(row / ((i64)p.s_q * p.h));
    const S* do_gmem = (const S*)p.dout + batch * p.do_stride_b + head * p.do_stride_h + i * p.do_stride_s;  // [d_v]
    const S* o_gmem = (const S*)p.o + batch * p.o_stride_b + head * p.o_stride_h + i * p.o_stride_s;         // [d_v]
    typedef Acc<E> A;
    A acc = A(0);
    for (int c = lane; c < p.d_v; c += 32) acc += to_acc<E>(do_gmem[c]) * to_acc<E>(o_gmem[c]);
    acc += __shfl_xor_sync(0xffffffffu, acc, 16);
    acc += __shfl_xor_sync(0xffffffffu, acc, 8);
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    acc = quad_sum(acc);
    if (lane == 0) ((A*)p.dsum)[row] = acc;
    if (!p.deterministic) {
        A* dq_row = (A*)p.dq_accum + row * p.d;   // [d]
        for (int c = lane; c < p.d; c += 32) dq_row[c] = A(0);
    }
}

// ---------------------------------------------------------------------------------------------
// dq = E(dQ accumulator): one thread per element. Deterministic mode sums the p.dq_slabs slabs
// in order (zeroed by the launcher; a slab holds nothing for rows its key tiles do not see).
// ---------------------------------------------------------------------------------------------
template <typename E>
__global__ void __launch_bounds__(256)
flash_bwd_dq(const Params p) {
    typedef typename Elem<E>::storage S;
    const i64 total = (i64)p.b * p.h * p.s_q * p.d;
    for (i64 idx = (i64)blockIdx.x * 256 + threadIdx.x; idx < total; idx += (i64)gridDim.x * 256) {
        const int c = (int)(idx % p.d);
        const i64 row = idx / p.d;                     // (batch * h + head) * s_q + i
        const int i = (int)(row % p.s_q);
        const int head = (int)((row / p.s_q) % p.h), batch = (int)(row / ((i64)p.s_q * p.h));
        typedef Acc<E> A;
        A acc;
        if (p.deterministic) {
            acc = A(0);
            for (int slab = 0; slab < p.dq_slabs; ++slab) acc += ((const A*)p.dq_accum)[slab * p.dq_accum_slab + idx];
        } else {
            acc = ((const A*)p.dq_accum)[idx];
        }
        ((S*)p.dq)[batch * p.dq_stride_b + (i64)i * p.dq_stride_s + head * p.dq_stride_h + c] = from_acc<E>(acc);
    }
}
