// cupyflash: Hopper (sm_90a) float32 attention forward: 3xTF32 on wgmma, TMA loads, warp
// specialization.
//
//   O = softmax(scale · Q Kᵀ) V per (batch, head), float32 in and out, computed at float32
//   accuracy: every operand x is split into two TF32 parts, big = tf32_rn(x) and
//   small = tf32_rn(x − big) (nearest even), and each product A·B is summed as small_A·big_B +
//   big_A·small_B + big_A·big_B in fp32 (the small·small term is below float32's rounding).
//   E = tf32_t (allow_tf32) takes big·big alone.
//
// Why a file of its own (and not an element type of hopper/fwd.cu): the 16-bit kernel's operands are
// used as TMA stores them; here every K, V and Q tile must be rewritten in shared memory before
// wgmma can read it (TF32 parts; V transposed, because wgmma .tf32 takes no transposed operand),
// which adds a converter role with its own barriers, a different shared-memory layout and three
// products per k-step. The scheduler, the work tiles and the per-row softmax state (masks and
// online softmax: online_softmax; O rescale, reset, final O / l and lse: rescale_o, reset_rows,
// store_rows) are hopper/fwd.cu's (included below). The consumers' turn-taking loop (first_turn,
// last_turn, the pingpong loop) is written out again (hopper/fwd_f32_consumer.cuh): its products
// and hand-offs differ.
//
// Persistent blocks of 128·(NC + 1) threads (one per SM) walk the work tiles (BM = 64·NC query
// rows of one head of one batch):
//   warpgroup 0, producer:
//     thread 0 (TMA): draws work tiles from the global counter, loads each Q tile [BM, D] and its
//       key tiles' K [BN, D] and V [BN, D] (raw float32) into a STAGES-deep ring; the next tile
//       is drawn once the current one's loads are issued (its Q prefetched into L2, its first K
//       and V loaded), so that only Q's load waits for the current tile's last S;
//     warps 1..3 (96 converter threads): split K in place (big) + k_small, transpose V into
//       Vᵀ big / small [D, BN] (keys contiguous: the K-major B operand of O += P V), and (unless
//       QREG) split Q in place + q_small, then hand each tile to the consumers;
//   warpgroups 1..NC, consumers (64 query rows each): (QREG) split their Q rows in place, Q small
//     kept in registers; S = Q Kᵀ (3 wgmma per k-step: q_big·k_big and q_big·k_small from shared
//     memory, q_small·k_big from registers (QREG) or shared memory), masks, online softmax in
//     registers, P split into TF32 big / small register fragments, O += P V (3 wgmma per
//     k-step, P from registers; with 3xTF32 into a zeroed accumulator added to O in fp32, so
//     O's long sum rounds to nearest: O_RN, hd 128 in two column halves). With NC = 2 the
//     consumers take turns on the tensor cores as in hopper/fwd.cu (pingpong); every consumer
//     issues S of key tile j + 1 with O += P V of key tile j and runs the softmax of j + 1 while
//     O += P V is still on the tensor cores.
//
// Shared memory: 128-byte swizzled panels of 32 float columns (128 bytes per row: the 16-bit
// kernel's byte geometry; one TMA box per panel; 1024-byte aligned). A k-step of 8 TF32 values is
// 32 bytes inside a panel row, so the wgmma descriptors are hopper/fwd.cu's (SBO = 1024 bytes).
// The A fragment of O += P V is the S accumulator with the k index permuted: fragment slot c holds
// key 2c and slot c + 4 key 2c + 1 of each 8-key step (so a lane's accumulator pairs feed it as
// they stand), and the converters store Vᵀ with the same permutation along its keys.
//
// Covered (the planner routes the rest to portable/fwd.cu): float32, d = d_v in {64, 128}, causal / sliding
// window (either alignment), GQA / MQA, any s_q, s_k, scale > 0, strides TMA accepts (16-byte
// multiples). Not covered: softcap, ALiBi, bias / mask, varlen.
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/epilogue.cuh"
#include "hopper/fwd_f32_consumer.cuh"
#include "hopper/fwd_f32_layout.cuh"
#include "hopper/fwd_f32_producer.cuh"
#include "hopper/fwd_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/softmax.cuh"
#include "hopper/wgmma.cuh"

// The entry sets up shared memory (FwdF32Smem) and the mbarriers and hands each warpgroup its
// role: the producer's TMA thread fwd_f32_load and converters fwd_f32_convert
// (hopper/fwd_f32_producer.cuh), the consumers fwd_f32_consumer (hopper/fwd_f32_consumer.cuh).
// QREG: the consumers split their own 64 Q rows (big in place, small kept in registers as the A
// fragments of q_small·k_big, a register-shared product): no q_small tile in shared memory, which
// leaves room for two 64-row consumers at hd 128. Otherwise the converters split Q like K.
template <typename E, int D, int BN, int STAGES, int NC, bool WINDOW, bool QREG>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
flash_fwd_sm90_f32(const __grid_constant__ Params p) {
    using namespace sm90;
    using namespace sm90f32;   // (Regs and Layout exist in both: named with their namespace)
    using L = sm90f32::Layout<D, BN, STAGES, NC, QREG>;
    static_assert(!Elem<E>::is16, "the float32 Hopper kernel takes f32x3_t / tf32_t");
    static_assert(D % 32 == 0 && D <= 128 && BN % 32 == 0 && BN <= 128 && (NC == 1 || NC == 2),
                  "tile shape");
    // consumers take 232 registers (Regs): hd 128 with O_RN (3xTF32: fwd_f32_consumer) and the window
    constexpr bool WIDE_REGS = Elem<E>::split && D > 64 && WINDOW;

    extern __shared__ unsigned char smem_raw[];
    // The planner (_plan.sm90_f32_smem_bytes) sizes the launch: stop loudly if it disagrees
    u32 smem_given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    const FwdF32Smem<D, BN, STAGES, NC, QREG> sm(smem_raw);   // tiles and mbarriers
    const int num_work = p.num_m_blocks * p.h * p.b;

    const int wg = threadIdx.x / 128;      // 0 producer, 1 .. NC consumers
    const int t = threadIdx.x % 128;       // lane within the warpgroup

    if (threadIdx.x == 0) {
        mbar_init(sm.q_raw, 1);                   // the TMA thread's expect_tx arrival (+ bytes)
        mbar_init(sm.q_full, 1);                  // the converters' leader
        mbar_init(sm.q_empty, 128 * NC + CONV_THREADS);   // one arrival per consumer and converter thread
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.k_raw + 8 * s, 1);
            mbar_init(sm.v_rawb + 8 * s, 1);
            mbar_init(sm.k_full + 8 * s, 1);
            mbar_init(sm.v_full + 8 * s, 1);
            mbar_init(sm.k_empty + 8 * s, NC);
            mbar_init(sm.v_empty + 8 * s, NC);
            mbar_init(sm.vraw_empty + 8 * s, 1);
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        if constexpr (NC > 1) regs_release<sm90f32::Regs<NC, WIDE_REGS>::PRODUCER>();
        if (t == 0) fwd_f32_load<D, BN, STAGES, NC, WINDOW, QREG>(p, sm, num_work);
        else if (t >= 32) fwd_f32_convert<E, D, BN, STAGES, NC, WINDOW, QREG>(p, sm, t - 32);
        return;
    }

    // ================================ consumers ================================
    if constexpr (NC > 1) regs_acquire<sm90f32::Regs<NC, WIDE_REGS>::CONSUMER>();
    fwd_f32_consumer<E, D, BN, STAGES, NC, WINDOW, QREG>(p, sm, wg, t);
}
