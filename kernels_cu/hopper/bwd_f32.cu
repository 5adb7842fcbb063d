// cupyflash: Hopper (sm_90a) float32 attention backward: dK, dV and dQ (added into the float32 dq
// output itself) at float32 accuracy, 3xTF32 on wgmma (docs/f32-backward-design.md; the planner
// runs it for the float32 calls it covers on compute capability 9.0). Two kernels per call:
// flash_bwd_pre_sm90_f32 (D = rowsum(dO ∘ O), dq zeroed), then flash_bwd_sm90_f32; no dQ
// accumulator and no conversion kernel.
//
//   Every product A·B is small_A·big_B + big_A·small_B + big_A·big_B in fp32, with
//   big = tf32_rn(x), small = tf32_rn(x − big) (hopper/sm90.cuh's split_tf32, as the forward).
//
// Why this shape (docs/f32-backward-design.md, "What does not fit"): wgmma .tf32 reads both
// shared-memory operands K-major only and every operand needs a big and a small copy, so the
// 16-bit kernel's tiles (128 keys x 64-row steps) need 360-410 KB. Here: BN = 128 keys per work
// tile (two consumers of 64 keys), BM = 32 query rows per step, one step buffer (in two halves
// released separately), hd 64 only.
//
// Persistent blocks of 384 threads (one per SM) walk the work tiles (key tile, kv head, batch;
// key tiles fastest, drawn from p.sched as in hopper/bwd.cu; causal / window: the grid's tail
// longest first, hopper/sched.cuh's longest_first_tail); the steps of a tile are every query head of the
// kv head's group x every 32-row query tile that sees the key tile.
//   warpgroup 0, producer (setmaxnreg 56):
//     thread 0 (TMA): draws work tiles (two-deep ring of indices in shared memory); per tile K, V
//       raw [BN, D] into k_big / v_big; per step Q, dO raw [BM, D] into one of two landing
//       stages (step j + 1 lands while the converters still read step j's);
//     warps 1..3 (96 converter threads): per tile, K split in place (k_big) + k_small; per step,
//       once the consumers are past the previous step's Sᵀ, dPᵀ: Q and dO big / small in their
//       own layout (B of Sᵀ, dPᵀ) and the lse·log2 e and D rows; once they are past its dV, dK:
//       Qᵀ and dOᵀ big / small [D, BM] split from the raw tiles (landing stage then free), the
//       queries permuted inside each 8-query k-step (B of dK, dV: hopper/fwd_f32.cu's Vᵀ
//       transposition).
//   warpgroups 1, 2, consumers (setmaxnreg 224): keys n0 + 64·cw .. + 63 each; per tile, split
//     their V rows (big in place, small kept as TF32 A fragments: 32 registers); per step:
//       Sᵀ  = K Qᵀ   [64 keys, BM]    (3 x SS per k-step)
//       dPᵀ = V dOᵀ  [64 keys, BM]    (2 x SS + 1 x RS, v_small from registers)
//       Pᵀ  = exp2(Sᵀ·scale·log2 e − lse·log2 e) (masked), dSᵀ = Pᵀ ∘ (dPᵀ − D)·scale
//       dSᵀ big / small -> this consumer's dS tile [BM queries, 64 key slots] (keys contiguous)
//       dV += Pᵀ dO, dK += dSᵀ Q       (A = P / dS fragments from registers, B = dOᵀ / Qᵀ)
//       dQᵀ_c [D, BM] = Kᵀ_c dSᵀ_c over its 64 keys (A = Kᵀ fragments loaded from k_big /
//         k_small, B = its dS tile), added into dq's rows with red.global.add.v2.f32 from
//         registers (each consumer adds its own partial; dq's rows are 8-byte aligned pairs: the
//         launcher checks).
//
// Covered: float32 (E = f32x3_t), d = d_v = 64, dense (no varlen / bias /
// softcap / ALiBi), causal / window (WINDOW), GQA / MQA, any s_q, s_k, scale > 0, atomic dQ.
// Tensor maps: boxes of 32 float columns x BM rows (q, dout) and x BN rows (k, v).
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"
#include "hopper/bwd_f32_consumer.cuh"
#include "hopper/bwd_f32_layout.cuh"
#include "hopper/bwd_f32_producer.cuh"

// The entry sets up shared memory (BwdF32Smem) and the mbarriers and hands each warpgroup its
// role: the producer's TMA thread bwd_f32_load and converters bwd_f32_convert
// (hopper/bwd_f32_producer.cuh), the consumers bwd_f32_consumer_t (hd 128) or bwd_f32_consumer_s
// (hd 64) (hopper/bwd_f32_consumer.cuh); constants and layouts in hopper/bwd_f32_layout.cuh.
template <typename E, int D, bool WINDOW>
__global__ void __launch_bounds__(sm90bf::THREADS, 1)
flash_bwd_sm90_f32(const __grid_constant__ Params p) {
    using namespace sm90bf;
    using L = typename LayoutOf<D>::type;
    constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    static_assert(Elem<E>::split && !Elem<E>::is16, "float32 at float32 accuracy (f32x3_t)");
    static_assert(D == 64 || D == 128, "hd 64 (design S) or hd 128 (design T)");

    extern __shared__ unsigned char smem_raw[];
    u32 smem_given;   // the launcher sizes the launch: stop loudly if it disagrees with Layout
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    const BwdF32Smem<D> sm(smem_raw);                  // tiles, rows, work-tile ring, mbarriers
    const int num_n = (p.s_k + BN - 1) / BN;                  // key tiles per (kv head, batch)
    const int num_work = num_n * p.h_k * p.b;

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < TILE_RING; ++s) {
            mbar_init(sm.tile_full + 8 * s, 1);          // the scheduling thread
            mbar_init(sm.tile_empty + 8 * s, 32 * TILE_READERS);   // every lane of each reading warp
        }
        mbar_init(sm.kv_raw, 1);                         // TMA thread's expect_tx arrival (+ bytes)
        mbar_init(sm.kv_full, 1);                        // converter leader
        mbar_init(sm.kv_empty, Shape<D>::T ? 32 * CONSUMER_WARPS : 2);   // per consumer (T: per consumer thread)
        for (int s = 0; s < RAW_STAGES; ++s) {
            mbar_init(sm.raw_full + 8 * s, 1);           // TMA thread (+ bytes)
            mbar_init(sm.raw_empty + 8 * s, 1);          // converter leader (T: r_full, TMA thread + bytes)
        }
        // converter leader (Q, dO parts) + each row writer after its own writes: racecheck
        // orders a read after the writer's own arrival, not after a named barrier and another
        // thread's arrival
        mbar_init(sm.nat_full, 1 + BM);
        // one arrival per consumer thread, each after its own reads of the rows
        mbar_init(sm.nat_empty, 32 * CONSUMER_WARPS);
        mbar_init(sm.t_full, Shape<D>::T ? 32 * CONSUMER_WARPS : 1);   // converter leader (T: r_empty, per consumer thread)
        mbar_init(sm.t_empty, 2);                        // one arrival per consumer
        if constexpr (Shape<D>::T) {
            static_assert(L::BYTES - L::BARS == 8 * (2 * TILE_RING + 3 + 2 * RAW_STAGES + 4 + 2),
                          "LayoutT holds Layout's slots and the two Pᵀ handoff barriers");
            mbar_init(sm.pt_full, 128);                  // each c0 thread after its Pᵀ stores
            mbar_init(sm.pt_empty, 128);                 // each c1 thread after its read-back and dVᵀ_1
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<PRODUCER_REGS>();
        if (t == 0) bwd_f32_load<D, WINDOW>(p, sm, num_n, num_work);
        else if (t >= 32) bwd_f32_convert<D, WINDOW>(p, sm, t);
        return;
    }

    // ================================ consumers ================================
    regs_acquire<CONSUMER_REGS>();
    if constexpr (Shape<D>::T) bwd_f32_consumer_t<D, WINDOW>(p, sm, wg, t);
    else bwd_f32_consumer_s<D, WINDOW>(p, sm, wg, t);
}

// ---------------------------------------------------------------------------------------------
// Before the main kernel: D = rowsum(dO ∘ O) [b, h, s_q] and the float32 dq rows zeroed (the main
// kernel adds its dQ partials into dq). Grid (row blocks, h, b) x 256 threads, D / 4 threads per
// query row (consecutive lanes of one warp), summed in common/bwd_pre_dq.cuh's flash_bwd_pre order, so D is the
// same bits as that kernel's: there lane l sums columns l, l + 32, ... in order and the butterfly
// adds lanes l ^ 16, l ^ 8, l ^ 4, l ^ 1, l ^ 2. D = 64: lane j of a row (16 lanes) holds that
// kernel's lanes j, j + 16 (columns j, j + 32 / j + 16, j + 48) and adds them first (its l ^ 16);
// D = 128: one warp per row, lane j = its lane j (columns j, j + 32, j + 64, j + 96). The loads
// and the zero stores are 4-byte and coalesced (any O or dq row alignment).
// ---------------------------------------------------------------------------------------------
template <int D>
__global__ void __launch_bounds__(256)
flash_bwd_pre_sm90_f32(const Params p) {
    static_assert(D == 64 || D == 128, "the summation order mirrors flash_bwd_pre's for 64 / 128 columns");
    constexpr int LANES = D / 4;             // threads per row
    constexpr int ROWS = 256 / LANES;        // rows per block
    const int head = blockIdx.y, batch = blockIdx.z;
    const int i = blockIdx.x * ROWS + threadIdx.x / LANES;   // query row
    const int j = threadIdx.x % LANES;                       // columns j + LANES·e, e = 0..3
    float acc = 0.f;
    if (i < p.s_q) {
        const float* do_row = (const float*)p.dout + batch * p.do_stride_b + (i64)i * p.do_stride_s +
                              head * p.do_stride_h;   // [D]
        const float* o_row = (const float*)p.o + batch * p.o_stride_b + (i64)i * p.o_stride_s +
                             head * p.o_stride_h;     // [D]
        if constexpr (D == 64) {
            // flash_bwd_pre's lanes j and j + 16: columns j, j + 32 / j + 16, j + 48
            const float lo = fmaf(do_row[j + 32], o_row[j + 32], fmaf(do_row[j], o_row[j], 0.f));
            const float hi = fmaf(do_row[j + 48], o_row[j + 48], fmaf(do_row[j + 16], o_row[j + 16], 0.f));
            acc = lo + hi;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc = fmaf(do_row[j + 32 * e], o_row[j + 32 * e], acc);
        }
    }
    // the rest of the butterfly: (D = 128: l ^ 16,) l ^ 8, l ^ 4, l ^ 1, l ^ 2
    if constexpr (D == 128) acc += __shfl_xor_sync(0xffffffffu, acc, 16);
    acc += __shfl_xor_sync(0xffffffffu, acc, 8);
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (i < p.s_q) {
        if (j == 0) p.dsum[((i64)batch * p.h + head) * p.s_q + i] = acc;   // [b, h, s_q]
        float* dq_row = (float*)p.dq + batch * p.dq_stride_b + (i64)i * p.dq_stride_s +
                        head * p.dq_stride_h;         // [D]
#pragma unroll
        for (int e = 0; e < 4; ++e) dq_row[j + LANES * e] = 0.f;
    }
}
