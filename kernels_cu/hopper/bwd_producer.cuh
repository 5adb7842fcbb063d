// cupyflash: flash_bwd_sm90's producer roles (warpgroup 0; hopper/bwd.cu wires them): ROWS_WARP
// (lse·log2 e and D per step). The TMA thread's loop is still written in the kernel (as a
// function it changed the SASS); DQ_WARP's bulk reduce-add is in hopper/bwd_epilogue.cuh.
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"

namespace sm90b {

// ROWS_WARP: lse·log2 e and D [BM] per step into the stage's rows_smem (two rows per lane); rows
// past s_q and rows that saw no key in the forward (lse = -inf) get +inf: P is then 0
template <bool WINDOW, bool VARLEN, int BIAS, bool DET>
__device__ __forceinline__ void stage_rows(const Params& p, const Smem& sm, int lane) {
    int q_it = 0;
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(sm.tile_smem, sm.tile_full, sm.tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const KeyTile wt = key_tile<BN, BM, WINDOW, VARLEN, BIAS, DET>(p, w);
        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int head = step_head<DET>(p, wt, st), m0 = step_m0<BM, DET>(p, wt, st);
            const int s = q_it % NBUF;
            const i64 bh_row = head_rows<VARLEN>(p, wt, head);   // row 0 of the sequence's head
            if (q_it >= NBUF) mbar_wait(sm.qdo_empty + 8 * s, ((q_it / NBUF) - 1) & 1);
            float* lse_stage = sm.rows_smem + s * 2 * BM;   // [BM]
            float* dsum_stage = lse_stage + BM;             // [BM]
#pragma unroll
            for (int r = lane; r < BM; r += 32) {
                const int i = m0 + r;
                const float lse = i < wt.s_q ? p.lse[bh_row + i] : CF_INF;
                lse_stage[r] = lse == -CF_INF ? CF_INF : lse * CF_LOG2E;
                dsum_stage[r] = i < wt.s_q ? p.dsum[bh_row + i] : 0.f;
            }
            mbar_arrive(sm.qdo_full + 8 * s);   // release: the stores above are seen after the wait
        }
    }
}

}  // namespace sm90b
