// cupyflash: flash_bwd_sm90's epilogue roles (hopper/bwd.cu wires them): DQ_WARP's bulk
// reduce-add of each step's dQ tile (the consumers' dq_smem) into the float32 accumulator, in
// key-tile order where DET. The consumers' dQ slice and dK, dV stores are part of their role
// (hopper/bwd_consumer.cuh).
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90b {

// DQ_WARP's lane 0: the dQ tile of each step, accumulator rows += dq_smem (same layout), at the
// address the consumers left in job_smem; address 0: no more steps
template <bool DET>
__device__ __forceinline__ void reduce_dq(const Smem& sm) {
    for (int j = 0;; ++j) {
        mbar_wait(sm.dq_full, j & 1);    // the consumers stored (and fenced) the tile
        float* dst = (float*)sm.job_smem[0];
        const u32 bytes = (u32)sm.job_smem[1];
        if (dst == nullptr) break;
        int* sem = nullptr;
        int rank = 0;
        if constexpr (DET) {
            // the key tiles before this one that touch the dQ tile have added theirs
            sem = (int*)sm.job_smem[2];
            rank = (int)sm.job_smem[3];
            sem_wait_eq(sem, rank);
            fence_proxy_async_global();   // the acquire above, then the bulk reduce below
        }
        bulk_reduce_add_f32(dst, sm.dq_smem, bytes);
        bulk_commit();
        bulk_wait_read<0>();          // dq_smem read out: the consumers may refill it
        mbar_arrive(sm.dq_empty);
        if constexpr (DET) {
            bulk_wait<0>();               // this tile's additions are done,
            fence_proxy_async_global();   // ordered before the generic release:
            sem_release(sem, rank + 1);   // the next key tile's may start
        }
    }
    bulk_wait<0>();                   // the additions landed before the block ends
}

}  // namespace sm90b
