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

namespace sm90bf {

// Per head-dim bucket: hd 64 (design S above), hd 128 (design T, below the hd 64 notes)
template <int D>
struct Shape {
    static constexpr bool T = D == 128;           // design T: consumers own d halves
    static constexpr int BN = T ? 64 : 128;       // keys per work tile (hd 64: two consumers x 64)
    static constexpr int RAW_STAGES = T ? 1 : 2;  // Q, dO landing buffers (hd 64: step j + 1 lands
                                                  // while step j's transposes still read step j's)
};
constexpr int BM = 32;               // query rows per step
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = 224;   // 56·128 + 224·256 = 168·384: the block's own registers
                                     // (setmaxnreg.inc takes only what the block's warps released)
constexpr int PANEL = 32;            // 32 floats = one 128-byte swizzle row
constexpr int CONV_THREADS = 96;     // producer warps 1..3
constexpr int CONV_BAR = 3;          // named barrier of the converters
constexpr int WG_BAR = 4;            // named barriers 4, 5: the 128 threads of consumer 0, 1
// Design T's dSᵀ / dS handoff between its consumers (256 threads: one side arrives, the other
// syncs); its Pᵀ handoff goes through the mbarriers pt_full, pt_empty (in the kernel)
constexpr int DS_FULL = 6;           // c1 wrote the step's dSᵀ, dS (c0 waits)
constexpr int DS_EMPTY = 7;          // c0 is done with the last dSᵀ, dS (c1 waits before the next)
constexpr int TILE_RING = 2;
constexpr int TILE_READERS = 2 * 4 + 3;   // consumer warps + converter warps
constexpr int CONSUMER_WARPS = 2 * 4;

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_bwd_sm90_f32.py: smem_bytes.
template <int D>
struct Layout {
    static constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    static constexpr int KV_PANEL = BN * 128;                // [BN, 32] panel of K / V
    static constexpr int KVT = BN * D * 4;                   // one K / V tile part
    static constexpr int Q_PANEL = BM * 128;                 // [BM, 32] panel of Q / dO
    static constexpr int QT = BM * D * 4;                    // one Q / dO tile part
    static constexpr int T_PANEL = D * 128;                  // [D, 32 queries] panel of Qᵀ / dOᵀ
    static constexpr int DS_PANEL = BM * 128;                // [BM, 32 keys] panel of dS
    static constexpr int DS_PART = 2 * DS_PANEL;             // [BM, 64 keys]: one consumer's part
    static constexpr int KB = 0;                             // k_big [D/32][BN][32] (TMA, then big)
    static constexpr int KS = KB + KVT;                      // k_small [D/32][BN][32]
    static constexpr int VB = KS + KVT;                      // v_big [D/32][BN][32] (TMA, then big)
    static constexpr int QB = VB + KVT;                      // q_big [D/32][BM][32]
    static constexpr int QS = QB + QT;                       // q_small
    static constexpr int DOB = QS + QT;                      // do_big
    static constexpr int DOS = DOB + QT;                     // do_small
    static constexpr int QTB = DOS + QT;                     // qT_big [BM/32][D][32] (queries permuted)
    static constexpr int QTS = QTB + QT;                     // qT_small
    static constexpr int DOTB = QTS + QT;                    // doT_big
    static constexpr int DOTS = DOTB + QT;                   // doT_small
    static constexpr int RAW_STAGE = 2 * QT;                 // one landing stage: q raw, dO raw
    static constexpr int RAWQ = DOTS + QT;                   // [RAW_STAGES] x (q raw [D/32][BM][32],
    static constexpr int RAWDO = RAWQ + QT;                  //   then dO raw) (TMA landing)
    static constexpr int DS = RAWQ + RAW_STAGES * RAW_STAGE; // ds [2 consumers][big, small][2][BM][32]
    static constexpr int ROWS = DS + 2 * 2 * DS_PART;        // [lse·log2 e, D][BM] of the step
    static constexpr int TILE = ROWS + 2 * BM * 4;           // tile_smem [TILE_RING] int (+ pad)
    static constexpr int BARS = TILE + 16;                   // 15 mbarriers (see the kernel)
    static constexpr int BYTES = BARS + 8 * 15;
    static constexpr int K_LAND = KB, V_LAND = VB;           // where TMA lands K, V
};

// Design T (hd 128): byte offsets as Layout's, mirrored by gpu/plan_bwd_sm90_f32.py: smem_bytes.
// K, V stay raw (A operands split on the fly in registers). Q, dO of a step land twice (TMA, the
// second read from L2): in the big halves of their parts, split there in place by the converters
// (B of Sᵀ, dPᵀ; free once those are done, so step j + 1 lands and is split while step j's later
// products run), and raw in rq / rdo (A of dKᵀ_h, dVᵀ_h, split on the fly). Pᵀ, dSᵀ [BN keys, BM
// query slots] and dS [BM queries, BN key slots] in big / small parts are the consumers' handoffs.
template <int D>
struct LayoutT {
    static constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    static constexpr int KV_PANEL = BN * 128;                // [BN, 32] panel of K / V
    static constexpr int KVT = BN * D * 4;                   // K or V raw [BN, D]
    static constexpr int Q_PANEL = BM * 128;                 // [BM, 32] panel of Q / dO
    static constexpr int QT = BM * D * 4;                    // one Q / dO tile part
    static constexpr int PT = BN * BM * 4;                   // one part of Pᵀ / dSᵀ [BN][BM] (one panel)
    static constexpr int DS_PANEL = BM * 128;                // [BM, 32 key slots] panel of dS
    static constexpr int KR = 0;                             // k_raw [D/32][BN][32] (TMA)
    static constexpr int VR = KR + KVT;                      // v_raw [D/32][BN][32] (TMA)
    static constexpr int QB = VR + KVT;                      // q_big [D/32][BM][32] (TMA raw, split in place)
    static constexpr int QS = QB + QT;                       // q_small
    static constexpr int DOB = QS + QT;                      // do_big (TMA raw, split in place)
    static constexpr int DOS = DOB + QT;                     // do_small
    static constexpr int RQ = DOS + QT;                      // q raw copy [D/32][BM][32] (TMA)
    static constexpr int RDO = RQ + QT;                      // dO raw copy (TMA)
    static constexpr int PTB = RDO + QT;                     // pT_big [BN keys][BM query slots] (c0)
    static constexpr int PTS = PTB + PT;                     // pT_small
    static constexpr int DSTB = PTS + PT;                    // dsT_big [BN keys][BM query slots] (c1)
    static constexpr int DSTS = DSTB + PT;                   // dsT_small
    static constexpr int DSB = DSTS + PT;                    // ds_big [BN/32][BM queries][32 key slots] (c1)
    static constexpr int DSS = DSB + BN * BM * 4;            // ds_small
    static constexpr int ROWS = DSS + BN * BM * 4;           // [step % 2][lse·log2 e, D][BM]
    static constexpr int TILE = ROWS + 2 * 2 * BM * 4;       // tile_smem [TILE_RING] int (+ pad)
    static constexpr int BARS = TILE + 16;                   // 15 mbarrier slots: Layout's up to
    static constexpr int BYTES = BARS + 8 * 15;              //   t_empty (13: one landing stage), pt_full, pt_empty
    static constexpr int K_LAND = KR, V_LAND = VR;           // where TMA lands K, V
};
template <int D> struct LayoutOf { using type = Layout<D>; };
template <> struct LayoutOf<128> { using type = LayoutT<128>; };

// Work tile w = n_block + num_n · (kv_head + h_k · batch) (dense; hopper/bwd.cu's order)
struct WorkTile {
    int n0, kv_head, batch;   // keys n0 .. n0 + BN of kv head kv_head in batch `batch`
    int m_first, m_count;     // the BM-row query tiles that see them
    int steps;                // m_count x the query heads of the group
};
template <int D, bool WINDOW>
__device__ __forceinline__ WorkTile work_tile(const Params& p, int w) {
    constexpr int BN = Shape<D>::BN;
    const int num_n = (p.s_k + BN - 1) / BN;
    WorkTile wt;
    wt.n0 = (w % num_n) * BN;
    wt.kv_head = (w / num_n) % p.h_k;
    wt.batch = w / num_n / p.h_k;
    // rows i with i + diag - left <= j <= i + diag + right for some key j of the tile
    const int n_rows = min(BN, p.s_k - wt.n0);
    int i_lo = 0, i_hi = p.s_q - 1;
    if (WINDOW) {
        i_lo = max(0, wt.n0 - p.diag_offset - p.window_right);
        i_hi = min(p.s_q - 1, wt.n0 + n_rows - 1 - p.diag_offset + p.window_left);
    }
    wt.m_first = i_lo / BM;
    wt.m_count = i_hi >= i_lo ? i_hi / BM - i_lo / BM + 1 : 0;
    wt.steps = wt.m_count * p.h_per_hk;
    return wt;
}
__device__ __forceinline__ int step_head(const Params& p, const WorkTile& wt, int st) {
    return wt.kv_head * p.h_per_hk + st / wt.m_count;
}
__device__ __forceinline__ int step_m0(const WorkTile& wt, int st) {
    return (wt.m_first + st % wt.m_count) * BM;
}

// Key order inside each 8-key k-step of dQᵀ = Kᵀ dSᵀ (a contraction: any order both operands
// share). Slot s holds key (s % 2)·4 + s / 2, so a k-step's A fragment columns c and c + 4 of the
// four lanes c = 0..3 are keys {0, 4, 1, 5} and {2, 6, 3, 7}: two per 16-byte-chunk band of K's
// 128-byte swizzle, and the Kᵀ fragment loads below are free of bank conflicts.
__device__ __forceinline__ int key_of_slot(int s) { return 8 * (s / 8) + (s % 2) * 4 + (s % 8) / 2; }
__device__ __forceinline__ int slot_of_key(int k) { return 8 * (k / 8) + 2 * (k % 4) + (k % 8) / 4; }

// Byte offset of element (row, col) in a [rows, 32·k] float tile stored as 128-byte swizzled
// panels of 32 columns, `panel` bytes apart (16-byte chunk index XOR row mod 8)
__device__ __forceinline__ u32 swz(int row, int col, int panel) {
    return (col / PANEL) * panel + row * 128 + ((((col % PANEL) / 4) ^ (row % 8)) << 4) + 4 * (col % 4);
}

// dq rows m0 .. m0 + BM of one (batch, head) (dq_bh: float32 [s_q, D], zeroed by
// flash_bwd_pre_sm90_f32) += one consumer's dQᵀ partial [columns d0, d0 + 1 (relabelled rows),
// BM queries] straight from registers: register i holds (column d0 or d0 + 1 for i % 4 < 2 or
// >= 2, query (i / 4)·8 + 2c + i % 2), so (acc[i], acc[i + 2]) are two adjacent columns: one
// red.global.add.v2.f32 each (rows past s_q skipped)
__device__ __forceinline__ void add_dq(float* dq_bh, i64 stride_s, int m0, int s_q, int d0, int col_in_8,
                                       const float* acc) {
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
        if (i % 4 >= 2) continue;
        const int q = (i / 4) * 8 + col_in_8 + (i % 2);
        if (m0 + q < s_q) sm90b::red_add_v2(dq_bh + (m0 + q) * stride_s + d0, acc[i], acc[i + 2]);
    }
}

// Design T's dq adds (add_dq's values and order, for hd 128): the row pointer formed once and
// stepped (+stride_s, +8·stride_s), rows past s_q skipped by a predicate on the red.add itself
// (add_dq's `if` became a branch around each of its 8 red.adds: ~2 KB of step-loop SASS)
__device__ __forceinline__ void red_add_v2_if(bool pred, float* addr, float x, float y) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p red.global.add.v2.f32 [%0], {%1, %2};\n}\n"
                 :: "l"(addr), "f"(x), "f"(y), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void add_dq_t(float* dq_bh, i64 stride_s, int m0, int s_q, int d0, int col_in_8,
                                         const float* acc) {
    float* row = dq_bh + (m0 + col_in_8) * stride_s + d0;   // query m0 + col_in_8
    const int left = s_q - m0 - col_in_8;                   // query offsets q < left are rows of dq
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {                      // registers 4j, 4j + 1: queries 8j, 8j + 1
        red_add_v2_if(8 * j < left, row, acc[4 * j], acc[4 * j + 2]);
        red_add_v2_if(8 * j + 1 < left, row + stride_s, acc[4 * j + 1], acc[4 * j + 3]);
        row += 8 * stride_s;
    }
}

// Design T's wgmma B descriptors: a swizzled K-major tile (LBO 16, SBO 1024) at base + off, as
// smem_desc(base + off, 16, 1024): the low word of base's descriptor, computed once (desc_lo),
// plus off / 16 (hopper/sm90.cuh's desc_add), so every wgmma's descriptor is one add on uniform
// registers, not smem_desc's mask, shift and or (step-loop code size: see t_first_product)
__device__ __forceinline__ u32 desc_lo(u32 base) { return (u32)smem_desc(base, 16, 1024); }
__device__ __forceinline__ u64 desc_at(u32 lo, u32 off) {
    return desc_add((smem_desc(0, 16, 1024) & 0xFFFFFFFF00000000ull) | lo, off);
}

// Design T's first product of a step, c0: Sᵀ = K Qᵀ, c1: dPᵀ = V dOᵀ  [BN keys, BM] -> x_acc: D / 8
// k-steps of 8 columns; A (K / V rows row_in_wg, +8, from x_raw) loaded raw and split on the fly,
// 4 k-steps per batch, two batches in flight; B = y_big / y_small; per k-step small·big +
// big·small + big·big.
// PARTS (c1's dPᵀ): each batch (12 products) into its own zeroed accumulator (part b % 2), the four
// added in fp32 (round to nearest) as they complete: the tensor cores' accumulation rounds toward
// zero, and 48 products in one accumulator biased dPᵀ by ~48·2⁻²⁴ relative, which dSᵀ = Pᵀ(dPᵀ − D)
// does not cancel (D is summed to nearest): dK 5.05e-5 with one key (P = 1, true dSᵀ ≈ 0, H200).
// !PARTS (c0's Sᵀ): one accumulator, 48 products, as the forward's S that made lse: its bias only
// scales P by a relative ~scale·|S|·48·2⁻²⁴ that nothing downstream cancels (P multiplies
// dPᵀ − D; tools/dp_cancellation_model.py --ordinary).
// Two inlined copies (c0, c1), kept small: B descriptors by desc_at (one uniform add each), A
// addresses from the lane's eight a_off (x_raw, panel b and row + 8 as immediates). The step loop
// is 31-32 KB of SASS with both copies (aed45d9, the same copies with smem_desc and swz per load:
// 40-43 KB; main, one copy: 34-37 KB); past ~40 KB the causal loop lost 17-22 % on the H200.
template <int D, bool PARTS, typename L>
__device__ __forceinline__ void t_first_product(float* x_acc, u32 x_raw, u32 y_big, u32 y_small,
                                                const u32* a_off) {
    constexpr int NS = BM / 2;
    float x_part[2][NS];
    if constexpr (PARTS) {
#pragma unroll
        for (int i = 0; i < NS; ++i) x_part[0][i] = x_part[1][i] = 0.f;
        fence_regs<NS>(x_part[0]);
        fence_regs<NS>(x_part[1]);
    } else {
#pragma unroll
        for (int i = 0; i < NS; ++i) x_acc[i] = 0.f;
        fence_regs<NS>(x_acc);
    }
    u32 a_big[2][16], a_small[2][16];                  // [batch buffer][4 k-steps][4]
    const u32 yb_lo = desc_lo(y_big), ys_lo = desc_lo(y_small);
#pragma unroll
    for (int b = 0; b < D / 32; ++b) {
        u32* fb = a_big[b % 2];
        u32* fs = a_small[b % 2];
        float* pa = PARTS ? x_part[b % 2] : x_acc;
        if (b >= 2) {                                  // batch b − 2 is done (buffers, part)
            wgmma_wait<1>();
            fence_regs<16>(fb);
            fence_regs<16>(fs);
            if constexpr (PARTS) {
                fence_regs<NS>(pa);
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    x_acc[i] = b == 2 ? pa[i] : x_acc[i] + pa[i];
                    pa[i] = 0.f;
                }
                fence_regs<NS>(pa);
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {              // A(r, c), A(r + 8, c), A(r, c + 4), A(r + 8, c + 4)
                // swz(row_in_wg + 8·(e % 2), 32·b + 8·k + c4 + 4·(e / 2), KV_PANEL)
                const u32 addr = x_raw + b * L::KV_PANEL + (e % 2) * 8 * 128 + a_off[2 * k + e / 2];
                split_tf32(lds32(addr), fb[4 * k + e], fs[4 * k + e]);
            }
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 off = b * L::Q_PANEL + 32 * k;
            wgmma_rs_tf32<BM>(pa, fs + 4 * k, desc_at(yb_lo, off));
            wgmma_rs_tf32<BM>(pa, fb + 4 * k, desc_at(ys_lo, off));
            wgmma_rs_tf32<BM>(pa, fb + 4 * k, desc_at(yb_lo, off));
        }
        wgmma_commit();
    }
    static_assert(D / 32 == 4, "four batches: parts 0, 1 folded in before batches 2, 3");
    wgmma_wait<0>();
    if constexpr (PARTS) {
        fence_regs<NS>(x_part[0]);
        fence_regs<NS>(x_part[1]);
#pragma unroll
        for (int i = 0; i < NS; ++i) x_acc[i] = (x_acc[i] + x_part[0][i]) + x_part[1][i];
    } else {
        fence_regs<NS>(x_acc);
    }
    fence_regs<16>(a_big[0]);                          // read by the last batches until here
    fence_regs<16>(a_small[0]);
    fence_regs<16>(a_big[1]);
    fence_regs<16>(a_small[1]);
}

}  // namespace sm90bf

template <typename E, int D, bool WINDOW>
__global__ void __launch_bounds__(sm90bf::THREADS, 1)
flash_bwd_sm90_f32(const __grid_constant__ Params p) {
    using namespace sm90bf;
    // hopper/bwd.cu's red.add; its constants, Layout and WorkTile are named with their namespace
    // where both exist (sm90bf's are used here)
    using sm90b::red_add_v2;
    using L = typename LayoutOf<D>::type;
    constexpr int BN = Shape<D>::BN, RAW_STAGES = Shape<D>::RAW_STAGES;
    static_assert(Elem<E>::split && !Elem<E>::is16, "float32 at float32 accuracy (f32x3_t)");
    static_assert(D == 64 || D == 128, "hd 64 (design S) or hd 128 (design T)");
    constexpr int NS = BM / 2;       // Sᵀ / dPᵀ accumulator registers per lane: [64 keys, BM]
    constexpr int NKV = D / 2;       // dK / dV accumulator registers per lane: [64 keys, D]
    constexpr int NQ = BM / 2;       // dQᵀ accumulator registers per lane: [D, BM]

    extern __shared__ unsigned char smem_raw[];
    u32 smem_given;   // the launcher sizes the launch: stop loudly if it disagrees with Layout
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;   // swizzled panels: 1024-aligned
    unsigned char* smem_gen = smem_raw + (smem - smem_addr(smem_raw));
    float* rows_smem = (float*)(smem_gen + L::ROWS);                  // [2][BM]: lse·log2 e, D
    volatile int* tile_smem = (volatile int*)(smem_gen + L::TILE);   // [TILE_RING], -1: none left
    const u32 tile_full = smem + L::BARS;               // [TILE_RING]: tile_smem slot written
    const u32 tile_empty = tile_full + 8 * TILE_RING;   // [TILE_RING]: every reader has read it
    const u32 kv_raw = tile_empty + 8 * TILE_RING;      // K, V of the tile landed (TMA)
    const u32 kv_full = kv_raw + 8;                     // K split: the consumers may read it
    const u32 kv_empty = kv_full + 8;                   // both consumers are done with K, V
    const u32 raw_full = kv_empty + 8;                  // [RAW_STAGES]: Q, dO of a step landed (TMA)
    const u32 raw_empty = raw_full + 8 * RAW_STAGES;    // [RAW_STAGES]: the converters are done with them
    // A step's buffers in two halves, so the converters prepare step j + 1 while step j runs:
    const u32 nat_full = raw_empty + 8 * RAW_STAGES;    // Q, dO big / small (as stored) and rows written
    const u32 nat_empty = nat_full + 8;                 // every consumer warp is past Sᵀ, dPᵀ, dSᵀ
    const u32 t_full = nat_empty + 8;                   // Qᵀ, dOᵀ big / small written
    const u32 t_empty = t_full + 8;                     // both consumers' dV, dK of the step done
    // Design T (hd 128) in the same slots: raw_full = Q, dO landed in their big halves (TMA); no
    // transposes, so two slots take new names: the raw Q, dO copies landed (TMA) / every consumer
    // warp has loaded its dKᵀ, dVᵀ fragments from them
    const u32 r_full = raw_empty, r_empty = t_full;
    // Design T's Pᵀ handoff between its consumers (slots past t_empty: LayoutT only). Each thread
    // arrives after its own accesses (the rule of docs/reliability.md): pt_full counts c0's 128
    // writers, pt_empty c1's 128 readers (c0's own warps' reads are ordered by the DS_FULL sync
    // each c0 thread makes after its dVᵀ_0, before the next Pᵀ stores)
    const u32 pt_full = t_empty + 8;                    // c0's Pᵀ of the step written
    const u32 pt_empty = pt_full + 8;                   // c1 done with the step's Pᵀ
    const int num_n = (p.s_k + BN - 1) / BN;                  // key tiles per (kv head, batch)
    const int num_work = num_n * p.h_k * p.b;

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < TILE_RING; ++s) {
            mbar_init(tile_full + 8 * s, 1);             // the scheduling thread
            mbar_init(tile_empty + 8 * s, 32 * TILE_READERS);   // every lane of each reading warp
        }
        mbar_init(kv_raw, 1);                            // TMA thread's expect_tx arrival (+ bytes)
        mbar_init(kv_full, 1);                           // converter leader
        mbar_init(kv_empty, Shape<D>::T ? 32 * CONSUMER_WARPS : 2);   // per consumer (T: per consumer thread)
        for (int s = 0; s < RAW_STAGES; ++s) {
            mbar_init(raw_full + 8 * s, 1);              // TMA thread (+ bytes)
            mbar_init(raw_empty + 8 * s, 1);             // converter leader (T: r_full, TMA thread + bytes)
        }
        // converter leader (Q, dO parts) + each row writer after its own writes: racecheck
        // orders a read after the writer's own arrival, not after a named barrier and another
        // thread's arrival
        mbar_init(nat_full, 1 + BM);
        // one arrival per consumer thread, each after its own reads of the rows
        mbar_init(nat_empty, 32 * CONSUMER_WARPS);
        mbar_init(t_full, Shape<D>::T ? 32 * CONSUMER_WARPS : 1);   // converter leader (T: r_empty, per consumer thread)
        mbar_init(t_empty, 2);                           // one arrival per consumer
        if constexpr (Shape<D>::T) {
            static_assert(L::BYTES - L::BARS == 8 * (2 * TILE_RING + 3 + 2 * RAW_STAGES + 4 + 2),
                          "LayoutT holds Layout's slots and the two Pᵀ handoff barriers");
            mbar_init(pt_full, 128);                     // each c0 thread after its Pᵀ stores
            mbar_init(pt_empty, 128);                    // each c1 thread after its read-back and dVᵀ_1
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<PRODUCER_REGS>();
        if (t == 0) {
            // ---- TMA thread: work tiles, K / V per tile, Q / dO per step
            tma_prefetch_desc(&p.tma_q);
            tma_prefetch_desc(&p.tma_k);
            tma_prefetch_desc(&p.tma_v);
            tma_prefetch_desc(&p.tma_do);
            int kv_it = 0, q_it = 0, drawn = 0;
            for (int tile_i = 0;; ++tile_i) {
                const int ts = tile_i % TILE_RING;
                // every reader has taken the slot's previous index
                if (tile_i >= TILE_RING) mbar_wait(tile_empty + 8 * ts, ((tile_i / TILE_RING) - 1) & 1);
                int w = sched_draw(p.sched, drawn);
                // causal / window: the grid's tail longest first (key tile 0 of a (kv head, batch)
                // pair sees the most query rows under a causal mask)
                if (WINDOW && w < num_work) w = longest_first_tail(w, num_n, p.h_k * p.b, gridDim.x);
                tile_smem[ts] = w < num_work ? w : -1;
                mbar_arrive(tile_full + 8 * ts);           // publishes tile_smem[ts] (release)
                if (w >= num_work) break;
                const WorkTile wt = work_tile<D, WINDOW>(p, w);
                int head = wt.kv_head * p.h_per_hk, mi = 0;
                for (int st = 0; st < wt.steps; ++st, ++q_it) {
                    const int m0 = (wt.m_first + mi) * BM;
                    if (++mi == wt.m_count) mi = 0;
                    // Q, dO [BM, D] of the step (D / 32 panels each) to q_dst, do_dst, counted on `full`
                    auto load_q_do = [&](u32 full, u32 q_dst, u32 do_dst) {
                        mbar_arrive_expect_tx(full, 2 * BM * D * 4);
#pragma unroll
                        for (int c = 0; c < D / PANEL; ++c) {
                            tma_load_4d(q_dst + c * L::Q_PANEL, &p.tma_q, full, c * PANEL, m0, head, wt.batch);
                            tma_load_4d(do_dst + c * L::Q_PANEL, &p.tma_do, full, c * PANEL, m0, head,
                                        wt.batch);
                        }
                    };
                    if constexpr (Shape<D>::T) {
                        // into the big halves of the parts (raw_full: landed), once every consumer
                        // warp's Sᵀ / dPᵀ of the last step has read them (nat_empty)
                        if (q_it > 0) mbar_wait(nat_empty, (q_it - 1) & 1);
                        load_q_do(raw_full, smem + L::QB, smem + L::DOB);
                        // the raw copies (r_full: landed), once every consumer warp has loaded the
                        // last step's dKᵀ / dVᵀ fragments from them (r_empty)
                        if (q_it > 0) mbar_wait(r_empty, (q_it - 1) & 1);
                        load_q_do(r_full, smem + L::RQ, smem + L::RDO);
                    } else {
                        // into landing stage q_it % RAW_STAGES, once the converters are done with
                        // the step that used it before
                        const int rs = q_it % RAW_STAGES;
                        const u32 raw = smem + L::RAWQ + rs * L::RAW_STAGE;
                        if (q_it >= RAW_STAGES) mbar_wait(raw_empty + 8 * rs, (q_it / RAW_STAGES - 1) & 1);
                        load_q_do(raw_full + 8 * rs, raw, raw + L::QT);
                    }
                    if (mi == 0) ++head;
                    if (st == 0) {
                        // K, V [BN, D] of the tile, behind its first step's Q / dO, once both
                        // consumers are done with the previous tile's
                        if (kv_it > 0) mbar_wait(kv_empty, (kv_it - 1) & 1);
                        mbar_arrive_expect_tx(kv_raw, 2 * BN * D * 4);
#pragma unroll
                        for (int c = 0; c < D / PANEL; ++c) {
                            tma_load_4d(smem + L::K_LAND + c * L::KV_PANEL, &p.tma_k, kv_raw, c * PANEL,
                                        wt.n0, wt.kv_head, wt.batch);
                            tma_load_4d(smem + L::V_LAND + c * L::KV_PANEL, &p.tma_v, kv_raw, c * PANEL,
                                        wt.n0, wt.kv_head, wt.batch);
                        }
                        ++kv_it;
                    }
                }
            }
            if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
        } else if (t >= 32) {
            // ---- converters (96 threads)
            const int cu = t - 32;
            // Hand converted data on: each thread's shared writes fenced for the async proxy, all
            // 96 done (barrier), one arrival on each barrier given
            auto release = [&](u32 bar, u32 bar2) {
                fence_proxy_async();
                named_bar_sync(CONV_BAR, CONV_THREADS);
                if (cu == 0) {
                    mbar_arrive(bar);
                    if (bar2) mbar_arrive(bar2);
                }
            };
            // Chunks [0, hi) of a run of 16-byte chunks -> big / small parts (elementwise, so the
            // swizzled layout is kept). Chunk i reads src + 16·i and writes big + 16·i, small + 16·i,
            // each shifted by `jump` bytes for i >= hi / 2 when `jump` is set (Q, dO in one run: their
            // big / small parts interleave as q_big, q_small, do_big, do_small). U chunks per
            // iteration, their loads issued together (one shared-memory latency per U chunks)
            auto split_run = [&](u32 src, u32 big, u32 small, int hi, int jump) {
                constexpr int U = 4;
                for (int i0 = cu; i0 < hi; i0 += U * CONV_THREADS) {
                    float x[U][4];
#pragma unroll
                    for (int u = 0; u < U; ++u)
                        if (i0 + u * CONV_THREADS < hi) lds128(src + 16 * (i0 + u * CONV_THREADS), x[u]);
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const int i = i0 + u * CONV_THREADS;
                        if (i >= hi) break;
                        u32 b[4], sm[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) split_tf32(x[u][e], b[e], sm[e]);
                        const u32 off = 16 * i + (jump && 2 * i >= hi ? jump : 0);
                        sts128(big + off, b);
                        sts128(small + off, sm);
                    }
                }
            };
            int kv_it = 0, q_it = 0;
            for (int tile_i = 0;; ++tile_i) {
                const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
                if (w < 0) break;
                const WorkTile wt = work_tile<D, WINDOW>(p, w);
                for (int st = 0; st < wt.steps; ++st, ++q_it) {
                    const int head = step_head(p, wt, st), m0 = step_m0(wt, st);
                    // ---- lse·log2 e and D of the step's rows, loaded first so the global-memory
                    //      latency passes under the waits and the split: rows past s_q and rows that
                    //      saw no key in the forward (lse = -inf) get +inf, so their P is 0
                    const i64 bh_row = ((i64)wt.batch * p.h + head) * p.s_q;
                    const int row = m0 + cu;                  // threads cu < BM: one row each
                    float lse_row = CF_INF, dsum_row = 0.f;
                    if (cu < BM && row < p.s_q) {
                        lse_row = p.lse[bh_row + row];
                        dsum_row = p.dsum[bh_row + row];
                    }
                    if constexpr (Shape<D>::T) {
                        // ---- Q, dO landed raw in their big halves: split in place (B of Sᵀ, dPᵀ);
                        //      the TMA thread waited for the last step's readers (nat_empty). Rows
                        //      in buffer q_it % 2 (the last step's D is read until c1's dSᵀ)
                        mbar_wait(raw_full, q_it & 1);
                        split_run(smem + L::QB, smem + L::QB, smem + L::QS, BM * D / 4, 0);
                        split_run(smem + L::DOB, smem + L::DOB, smem + L::DOS, BM * D / 4, 0);
                        // the rows of two steps back in this buffer are read (their readers arrived
                        // on nat_empty a step later; the TMA thread's wait already saw it)
                        if (q_it > 0) mbar_wait(nat_empty, (q_it - 1) & 1);
                        if (cu < BM) {
                            float* rows_step = rows_smem + (q_it & 1) * 2 * BM;   // [2][BM]
                            rows_step[cu] = lse_row == -CF_INF ? CF_INF : lse_row * CF_LOG2E;
                            rows_step[BM + cu] = dsum_row;
                            mbar_arrive(nat_full);             // this thread's rows written
                        }
                        release(nat_full, 0);
                    } else {
                        const int rs = q_it % RAW_STAGES;
                        const u32 raw = smem + L::RAWQ + rs * L::RAW_STAGE;   // the step's Q, dO raw
                        mbar_wait(raw_full + 8 * rs, (q_it / RAW_STAGES) & 1);   // Q, dO of the step landed
                        if (q_it > 0) mbar_wait(nat_empty, (q_it - 1) & 1);   // the last step's Sᵀ, dPᵀ, rows done
                        // ---- Q, dO: big / small as stored (B of Sᵀ, dPᵀ), one run over both
                        static_assert(L::RAWDO == L::RAWQ + L::QT && L::DOB == L::QS + L::QT &&
                                      L::QS == L::QB + L::QT, "Q, dO landing buffers and parts adjacent");
                        split_run(raw, smem + L::QB, smem + L::QS, 2 * BM * D / 4, L::QT);
                        if (cu < BM) {
                            rows_smem[cu] = lse_row == -CF_INF ? CF_INF : lse_row * CF_LOG2E;
                            rows_smem[BM + cu] = dsum_row;
                            mbar_arrive(nat_full);             // this thread's rows written
                        }
                        release(nat_full, 0);
                        if (st == 0) {
                            // ---- K of the tile: big in place, small (A of Sᵀ; Kᵀ fragments of dQᵀ)
                            mbar_wait(kv_raw, kv_it & 1);
                            split_run(smem + L::KB, smem + L::KB, smem + L::KS, BN * D / 4, 0);
                            release(kv_full, 0);
                            ++kv_it;
                        }
                        // Xᵀ big / small of the raw Q and dO of a step ([BM, D] tiles, query rows, swizzled
                        // [D/32][BM][32], QT bytes apart) -> qT_big, qT_small, doT_big, doT_small, each
                        // [BM/32][D][32] (row = column d, queries permuted inside each 8-query k-step: query
                        // 2c -> slot c, 2c + 1 -> slot c + 4, matching the P / dS A fragments), split as they
                        // are written. Item i of tile i / ITEMS (Q, dO) = 4 queries x 4 columns: hopper/sm90.cuh's
                        // TransposeItem, as hopper/fwd_f32.cu's transpose_v with BN := BM (bank-conflict-free
                        // phases, checked by tests/test_sm90_f32_bwd_layout.py)
                        auto transpose_split = [&](u32 src0) {
                            constexpr int ITEMS = BM * D / 16, ALL = 2 * ITEMS;
                            for (int ia = cu; ia < ALL; ia += CONV_THREADS) {
                                const int part = ia / ITEMS;
                                const TransposeItem<BM, D> it(ia % ITEMS);
                                const u32 src = src0 + part * L::QT;
                                const u32 dst_big = smem + L::QTB + part * 2 * L::QT;
                                it.template move<true>(src, dst_big, dst_big + L::QT);
                            }
                        };
                        // ---- Qᵀ, dOᵀ big / small (B of dK, dV) from the raw Q, dO, once the last
                        //      step's dV, dK are done; then the landing stage may take step q_it + 2
                        if (q_it > 0) mbar_wait(t_empty, (q_it - 1) & 1);
                        static_assert(L::QTS == L::QTB + L::QT && L::DOTB == L::QTS + L::QT &&
                                      L::DOTS == L::DOTB + L::QT, "transposed parts adjacent");
                        transpose_split(raw);
                        release(t_full, raw_empty + 8 * rs);
                    }
                }
            }
        }
        return;
    }

    // ================================ consumers ================================
    regs_acquire<CONSUMER_REGS>();
    if constexpr (Shape<D>::T) {
        // ============================ design T consumers (hd 128) ============================
        // Consumer h = cw owns columns 64h .. 64h + 63 of dK, dV, dQ. Per step (32 queries, the
        // tile's 64 keys) c0 makes Sᵀ and Pᵀ, c1 makes dPᵀ and dSᵀ / dS (the role split); both then
        // make their column halves of dVᵀ, dKᵀ and dQᵀ (transposed products: M = 64 columns d).
        constexpr int DH = D / 2;                              // columns per consumer
        constexpr int NT = BN / 2;                             // dKᵀ_h / dVᵀ_h registers per lane: [DH, BN]
        const int cw = wg - 1;                                 // consumer 0 (Pᵀ) or 1 (dSᵀ, dS)
        const int g = (t % 32) / 4, c4 = t % 4;
        const int row_in_wg = 16 * (t / 32) + g;               // Sᵀ / dPᵀ accumulator rows (keys) row_in_wg, +8
        const int col_in_8 = 2 * c4;                           // accumulator columns col_in_8, +1 (of 8)
        // Rows r, r + 8 of the transposed products' M (this lane's fragment and accumulator rows)
        // are relabelled as columns d0, d0 + 1 of the half: every A fragment pair is one 8-byte load,
        // every accumulator pair one 8-byte store or red.add (undone there)
        const int d0 = DH * cw + 16 * (t / 32) + 2 * g;        // column of D
        // this consumer's first product: c0 Sᵀ = K Qᵀ, c1 dPᵀ = V dOᵀ  [BN keys, BM queries]
        const u32 x_raw = smem + (cw == 0 ? L::KR : L::VR);    // A: K / V raw [D/32][BN][32]
        const u32 y_big = smem + (cw == 0 ? L::QB : L::DOB);   // B: Q / dO big [D/32][BM][32]
        const u32 y_small = y_big + L::QT;                     //    (QS = QB + QT, DOS = DOB + QT)
        static_assert(L::QS == L::QB + L::QT && L::DOS == L::DOB + L::QT, "small parts after big");
        // the first product's A loads: byte offset of (row_in_wg, 4·c + c4) in a K / V panel,
        // chunk c = 0..7 (swizzled: c XOR row_in_wg % 8); rows + 8, other panels are immediates
        u32 a_off[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) a_off[c] = swz(row_in_wg, 4 * c + c4, L::KV_PANEL);
        // accumulator register i's place in the Pᵀ / dSᵀ tiles [BN keys][BM query slots] (one
        // 128-byte swizzled panel): pt_off[2·(i / 4) + i % 2] (+ 8 rows for (i % 4) >= 2), key
        // row_in_wg, query slot slot_of_key((i / 4)·8 + col_in_8 + i % 2); and in the dS tile
        // [BN/32][BM queries][32 key slots]: ds_off[2·((i % 4) >= 2) + i % 2] (+ (i / 4)·8 query
        // rows). Formed once: the swizzle's XOR per store cost ~3 KB of step-loop SASS
        u32 pt_off[8], ds_off[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int par = 0; par < 2; ++par)
                pt_off[2 * j + par] = swz(row_in_wg, slot_of_key(8 * j + col_in_8 + par), 0);
#pragma unroll
        for (int kr = 0; kr < 2; ++kr)
#pragma unroll
            for (int par = 0; par < 2; ++par)
                ds_off[2 * kr + par] = swz(col_in_8 + par, slot_of_key(row_in_wg + 8 * kr), L::DS_PANEL);

        // step_acc [DH columns, BN keys] = Xᵀ_h Y: A = Xᵀ_h loaded from the raw copy X [BM
        // queries][D] (columns d0, d0 + 1: one 8-byte load; queries in key_of_slot order inside
        // each 8-query k-step) and split on the fly, B = Y big / small [BN keys][BM query slots]
        // K-major (8 slots = 32 bytes per k-step); per k-step small·big + big·small + big·big, into
        // a zeroed accumulator (added to dKᵀ_h / dVᵀ_h in fp32 by the caller: section 8 (3)).
        // last_raw_read: once its fragments are in registers this warp is done with the raw
        // copies (r_empty arrival).
        float step_acc[NT];
        auto step_product = [&](u32 x_raw_tile, u32 yb, u32 ys, bool last_raw_read) {
            u32 fb[NS], fs[NS];   // [BM/8 k-steps][A(d0, c), A(d0 + 1, c), A(d0, c + 4), A(d0 + 1, c + 4)]
#pragma unroll
            for (int kk = 0; kk < BM / 8; ++kk) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    u32 x, y;
                    lds64(x_raw_tile + swz(key_of_slot(8 * kk + c4 + 4 * hh), d0, L::Q_PANEL), x, y);
                    split_tf32(__uint_as_float(x), fb[4 * kk + 2 * hh], fs[4 * kk + 2 * hh]);
                    split_tf32(__uint_as_float(y), fb[4 * kk + 2 * hh + 1], fs[4 * kk + 2 * hh + 1]);
                }
            }
            if (last_raw_read) {
                mbar_arrive(r_empty);                          // this lane's fragments loaded
            }
#pragma unroll
            for (int i = 0; i < NT; ++i) step_acc[i] = 0.f;
            fence_regs<NT>(step_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 8; ++kk) {
                wgmma_rs_tf32<BN>(step_acc, fs + 4 * kk, desc_at(desc_lo(yb), 32 * kk));
                wgmma_rs_tf32<BN>(step_acc, fb + 4 * kk, desc_at(desc_lo(ys), 32 * kk));
                wgmma_rs_tf32<BN>(step_acc, fb + 4 * kk, desc_at(desc_lo(yb), 32 * kk));
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs<NT>(step_acc);
            fence_regs<NS>(fb);                                // read by the products until here
            fence_regs<NS>(fs);
        };

        float dkt_acc[NT], dvt_acc[NT];   // dKᵀ_h, dVᵀ_h [DH columns (relabelled), BN keys], fp32
        int q_it = 0, kv_it = 0;          // steps and K/V tiles consumed so far (barrier phases)
        for (int tile_i = 0;; ++tile_i) {
            const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
            if (w < 0) break;
            const WorkTile wt = work_tile<D, WINDOW>(p, w);
            const int n0 = wt.n0;
#pragma unroll
            for (int i = 0; i < NT; ++i) dkt_acc[i] = dvt_acc[i] = 0.f;
            // K, V landed (the phase cannot move on before this consumer's warps' kv_empty)
            if (wt.steps > 0) mbar_wait(kv_raw, kv_it & 1);

            // step st's query tile and head (step_m0, step_head as counters: no division per step)
            int mi = 0, head = wt.kv_head * p.h_per_hk;
            for (int st = 0; st < wt.steps; ++st, ++q_it) {
                const int m0 = (wt.m_first + mi) * BM;
                const float* lse_smem = rows_smem + (q_it & 1) * 2 * BM;   // [BM] lse·log2 e of the step
                const float* dsum_smem = lse_smem + BM;                    // [BM] D of the step
                mbar_wait(nat_full, q_it & 1);             // Q, dO parts and rows written

                // ---- c0: Sᵀ = K Qᵀ (one accumulator), c1: dPᵀ = V dOᵀ (four per-batch accumulators)
                //      [BN keys, BM]: t_first_product
                float x_acc[NS];
                if (cw == 0) t_first_product<D, false, L>(x_acc, smem + L::KR, smem + L::QB, smem + L::QS, a_off);
                else t_first_product<D, true, L>(x_acc, smem + L::VR, smem + L::DOB, smem + L::DOS, a_off);
                // this thread's Sᵀ / dPᵀ done, and its reads of the rows of two steps back: the parts
                // may take the next step (TMA, converters). Each thread arrives for its own reads
                // (racecheck orders a later write only after the reader's own arrival)
                mbar_arrive(nat_empty);

                // accumulator register i: key row_in_wg + 8·((i % 4) >= 2), query (i / 4)·8 + col_in_8 + i % 2;
                // its place in the [BN keys][BM query slots] tiles Pᵀ, dSᵀ (one 128-byte swizzled panel)
                auto t_off = [&](int i) { return pt_off[2 * (i / 4) + i % 2] + ((i % 4) >= 2 ? 8 * 128 : 0); };
                if (cw == 0) {
                    // ---- Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e), in place in x_acc
#pragma unroll
                    for (int i = 0; i < NS; ++i) {
                        const int col = (i / 4) * 8 + col_in_8 + (i % 2);   // query row m0 + col
                        x_acc[i] = fast_exp2(x_acc[i] * p.scale_log2 - lse_smem[col]);
                    }
                    // ---- the mask, one branch for the step: P = 0 for keys past s_k and, with a
                    //      window, outside [diag − window_left, diag + window_right] (diag = query row
                    //      + diag_offset), tested on key − diag = rel0 + (key offset) − col. A test per
                    //      value inside the exp loop made ptxas branch around each of the 16 values
                    //      (~3 KB of SASS in the step loop: its size matters, see t_first_product)
                    bool need_mask = n0 + BN > p.s_k;
                    if (WINDOW)
                        need_mask |= n0 + BN - 1 > m0 + p.diag_offset + p.window_right ||
                                     n0 < m0 + BM - 1 + p.diag_offset - p.window_left;
                    if (need_mask) {
                        const int key0 = n0 + row_in_wg, rel0 = key0 - m0 - p.diag_offset;
#pragma unroll
                        for (int i = 0; i < NS; ++i) {
                            const int col = (i / 4) * 8 + col_in_8 + (i % 2);
                            const int kr = (i % 4) >= 2 ? 8 : 0;            // key key0 + kr
                            bool keep = key0 + kr < p.s_k;
                            if (WINDOW) {
                                const int rel = rel0 + kr - col;             // key − diag
                                keep = keep && rel <= p.window_right && rel >= -p.window_left;
                            }
                            if (!keep) x_acc[i] = 0.f;
                        }
                    }
                    // every reader of the last Pᵀ is done with it: each c1 thread's read-back and
                    // dVᵀ_1 (pt_empty); every c0 warp's dVᵀ_0 (its DS_FULL sync)
                    if (q_it > 0) mbar_wait(pt_empty, (q_it - 1) & 1);
                    // ---- Pᵀ big / small -> pT tile [BN keys][BM query slots]: B of dVᵀ_0, dVᵀ_1
#pragma unroll
                    for (int i = 0; i < NS; ++i) {
                        u32 big, small;
                        split_tf32(x_acc[i], big, small);
                        sts32(smem + L::PTB + t_off(i), big);
                        sts32(smem + L::PTS + t_off(i), small);
                    }
                    fence_proxy_async();                       // read by wgmma (async proxy)
                    mbar_arrive(pt_full);                      // this thread's Pᵀ written (for c1)
                    named_bar_sync(WG_BAR, 128);               // every c0 warp's Pᵀ rows, for dVᵀ_0
                } else {
                    // every c0 thread's Pᵀ of the step written
                    mbar_wait(pt_full, q_it & 1);
                    // ---- dSᵀ = Pᵀ ∘ (dPᵀ − D)·scale, Pᵀ read back (big + small) where c0's lane t
                    //      wrote it: the same accumulator position as this lane's dPᵀ register
                    u32 ds_big[NS], ds_small[NS];
#pragma unroll
                    for (int i = 0; i < NS; ++i) {
                        const int col = (i / 4) * 8 + col_in_8 + (i % 2);
                        const float pe = lds32(smem + L::PTB + t_off(i)) + lds32(smem + L::PTS + t_off(i));
                        split_tf32(pe * (x_acc[i] - dsum_smem[col]) * p.scale, ds_big[i], ds_small[i]);
                    }
                    // every reader of the last dSᵀ, dS is done with them: c0 (its arrival after
                    // dQᵀ_0) and every c1 warp (this sync) after its dKᵀ_1, dQᵀ_1
                    if (q_it > 0) named_bar_sync(DS_EMPTY, 256);
                    // ---- dSᵀ [BN keys][BM query slots] (B of dKᵀ_h) and dS [BN/32][BM queries]
                    //      [32 key slots] (B of dQᵀ_h), big / small
#pragma unroll
                    for (int i = 0; i < NS; ++i) {
                        // swz(q, slot_of_key(kl), DS_PANEL), kl = row_in_wg + 8·((i % 4) >= 2),
                        // q = (i / 4)·8 + col_in_8 + i % 2
                        const u32 off = ds_off[2 * ((i % 4) >= 2) + i % 2] + (i / 4) * 8 * 128;
                        sts32(smem + L::DSTB + t_off(i), ds_big[i]);
                        sts32(smem + L::DSTS + t_off(i), ds_small[i]);
                        sts32(smem + L::DSB + off, ds_big[i]);
                        sts32(smem + L::DSS + off, ds_small[i]);
                    }
                    fence_proxy_async();                       // read by wgmma (async proxy)
                    named_bar_arrive(DS_FULL, 256);            // dSᵀ, dS written: c0 may read them
                    named_bar_sync(WG_BAR + 1, 128);           // every c1 warp's rows, for dKᵀ_1, dQᵀ_1
                }

                // ---- dVᵀ_h [DH, BN] += dOᵀ_h P  (A from the raw dO copy, B = Pᵀ)
                mbar_wait(r_full, q_it & 1);                   // the raw Q, dO copies landed
                step_product(smem + L::RDO, smem + L::PTB, smem + L::PTS, false);
#pragma unroll
                for (int i = 0; i < NT; ++i) dvt_acc[i] += step_acc[i];
                if (cw == 1) mbar_arrive(pt_empty);            // this c1 thread is done with the step's Pᵀ
                // c1's dSᵀ, dS of the step written; every c0 warp's dVᵀ_0 done (next Pᵀ may go)
                if (cw == 0) named_bar_sync(DS_FULL, 256);
                // ---- dKᵀ_h [DH, BN] += Qᵀ_h dS  (A from the raw Q copy, B = dSᵀ); once its
                //      fragments are loaded, this warp is done with the raw copies
                step_product(smem + L::RQ, smem + L::DSTB, smem + L::DSTS, true);
#pragma unroll
                for (int i = 0; i < NT; ++i) dkt_acc[i] += step_acc[i];

                // ---- dQᵀ_h [DH, BM] = Kᵀ_h dSᵀ over the BN keys: A = Kᵀ_h split on the fly from
                //      raw K (columns d0, d0 + 1: one 8-byte load per key; keys in slot order),
                //      B = dS [BM][BN key slots] K-major; kt_small·ds_big first (zeroed dq_acc)
                float dq_acc[NS];
                u32 kt_big[NT], kt_small[NT];                  // [BN/8 k-steps][4]
#pragma unroll
                for (int kk = 0; kk < BN / 8; ++kk) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        u32 x, y;
                        lds64(smem + L::KR + swz(key_of_slot(8 * kk + c4 + 4 * hh), d0, L::KV_PANEL), x, y);
                        split_tf32(__uint_as_float(x), kt_big[4 * kk + 2 * hh], kt_small[4 * kk + 2 * hh]);
                        split_tf32(__uint_as_float(y), kt_big[4 * kk + 2 * hh + 1], kt_small[4 * kk + 2 * hh + 1]);
                    }
                }
#pragma unroll
                for (int i = 0; i < NS; ++i) dq_acc[i] = 0.f;
                fence_regs<NS>(dq_acc);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BN / 8; ++kk) {
                    const u32 off = (kk / 4) * L::DS_PANEL + (kk % 4) * 32;
                    wgmma_rs_tf32<BM>(dq_acc, kt_small + 4 * kk, desc_at(desc_lo(smem + L::DSB), off));
                    wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, desc_at(desc_lo(smem + L::DSS), off));
                    wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, desc_at(desc_lo(smem + L::DSB), off));
                }
                wgmma_commit();
                // the tile's last reads of K, V by this thread are done (K, V are only loaded into
                // registers): the next tile's K, V may land
                if (st == wt.steps - 1) mbar_arrive(kv_empty);
                wgmma_wait<0>();
                fence_regs<NS>(dq_acc);
                fence_regs<NT>(kt_big);
                fence_regs<NT>(kt_small);
                if (cw == 0) named_bar_arrive(DS_EMPTY, 256);  // c0 is done with the step's dSᵀ, dS

                // ---- dq rows m0 .. += dQᵀ_hᵀ: this consumer's columns over the tile's keys
                float* dq_bh = (float*)p.dq + wt.batch * p.dq_stride_b + head * p.dq_stride_h;   // [s_q, D]
                add_dq_t(dq_bh, p.dq_stride_s, m0, p.s_q, d0, col_in_8, dq_acc);
                if (++mi == wt.m_count) {
                    mi = 0;
                    ++head;
                }
            }
            if (wt.steps > 0) ++kv_it;

            // ---- dK, dV rows n0 .. n0 + BN, this consumer's columns (GQA: summed over the group's
            //      query heads; zeros for a tile that no query sees): register i holds (column d0
            //      or d0 + 1 for i % 4 < 2 or >= 2, key 8·(i / 4) + col_in_8 + i % 2), float32 pairs
#pragma unroll
            for (int i = 0; i < NT; ++i) {
                if (i % 4 >= 2) continue;
                const int key = n0 + (i / 4) * 8 + col_in_8 + (i % 2);
                if (key < p.s_k) {
                    float* dk_row = (float*)p.dk + wt.batch * p.dk_stride_b + (i64)key * p.dk_stride_s +
                                    wt.kv_head * p.dk_stride_h;   // [D]
                    float* dv_row = (float*)p.dv + wt.batch * p.dv_stride_b + (i64)key * p.dv_stride_s +
                                    wt.kv_head * p.dv_stride_h;   // [D]
                    *(float2*)(dk_row + d0) = make_float2(dkt_acc[i], dkt_acc[i + 2]);
                    *(float2*)(dv_row + d0) = make_float2(dvt_acc[i], dvt_acc[i + 2]);
                }
            }
        }
        // pt_full / pt_empty need no drain: each thread they count arrives once per step,
        // unconditionally, so each completes one phase per step (parity q_it & 1, q_it running on
        // across work tiles); the last pt_empty phase completes with nobody waiting. DS_EMPTY's
        // last arrivals (c0's) are taken, so the named barrier is left with no generation open
        if (q_it > 0 && cw == 1) named_bar_sync(DS_EMPTY, 256);
    } else {
        const int cw = wg - 1;                                 // consumer 0 or 1: keys n0 + 64·cw ..
        const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
        const int c4 = t % 4;
        const int col_in_8 = 2 * c4;                           // accumulator columns col_in_8, +1 (of 8)
        const u32 k_wg = smem + L::KB + cw * 64 * 128;         // this consumer's 64 rows of k_big
        const u32 ks_wg = smem + L::KS + cw * 64 * 128;        // ... of k_small
        const u32 v_wg = smem + L::VB + cw * 64 * 128;         // ... of v_big
        const u32 ds_big = smem + L::DS + cw * 2 * L::DS_PART; // dS [BM, 64 keys] big, then small
        const u32 ds_small = ds_big + L::DS_PART;
        const float* lse_smem = rows_smem;                     // [BM] lse·log2 e of the step
        const float* dsum_smem = rows_smem + BM;               // [BM] D of the step

        float dk_acc[NKV], dv_acc[NKV];   // dK, dV [64 keys, D], fp32
        u32 vs_frag[D / 2];               // V small [64 keys, D] as TF32 A fragments (4 per k-step)

        int q_it = 0, kv_it = 0;          // steps and K/V tiles consumed so far (barrier phases)
        for (int tile_i = 0;; ++tile_i) {
            const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
            if (w < 0) break;
            const WorkTile wt = work_tile<D, WINDOW>(p, w);
            const int n0 = wt.n0;
            const int key0 = n0 + cw * 64 + row_in_wg;         // this lane's keys: key0, key0 + 8

    #pragma unroll
            for (int i = 0; i < NKV; ++i) dk_acc[i] = dv_acc[i] = 0.f;
            if (wt.steps > 0) {
                mbar_wait(kv_raw, kv_it & 1);                  // V landed (the phase cannot move on
                                                               // before this consumer's kv_empty)
                // ---- V rows of this consumer: big back in place (the shared operand of v_big·do_big,
                //      v_big·do_small), small kept in vs_frag. Per 8-column k-step kk the A fragment is
                //      V(r, 8kk + c), V(r + 8, 8kk + c), V(r, 8kk + c + 4), V(r + 8, 8kk + c + 4)
                //      (r = row_in_wg, c = t % 4)
    #pragma unroll
                for (int kk = 0; kk < D / 8; ++kk) {
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = row_in_wg + 8 * (e % 2), x = 8 * kk + c4 + 4 * (e / 2);
                        const u32 a = v_wg + swz(r, x, L::KV_PANEL);
                        u32 big;
                        split_tf32(lds32(a), big, vs_frag[4 * kk + e]);
                        sts32(a, big);
                    }
                }
                fence_proxy_async();                   // the big part is read by wgmma (async proxy)
                named_bar_sync(WG_BAR + cw, 128);      // every warp of the warpgroup has written its rows
                // K split: waited after the V split, so the two splits overlap
                mbar_wait(kv_full, kv_it & 1);
            }

            for (int st = 0; st < wt.steps; ++st, ++q_it) {
                const int m0 = step_m0(wt, st);
                const int head = step_head(p, wt, st);
                mbar_wait(nat_full, q_it & 1);                 // Q, dO parts and rows written

                // ---- Sᵀ = K Qᵀ  [64 keys, BM]: k-steps of 8 columns (32 bytes) through the D / 32
                //      panels; per k-step k_small·q_big + k_big·q_small + k_big·q_big (all SS)
                float s_acc[NS], dp_acc[NS];
                wgmma_fence();
    #pragma unroll
                for (int kk = 0; kk < D / 8; ++kk) {
                    const u32 k_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;
                    const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
                    wgmma_ss_tf32<BM>(s_acc, smem_desc(ks_wg + k_off, 16, 1024),
                                      smem_desc(smem + L::QB + q_off, 16, 1024), kk > 0);
                    wgmma_ss_tf32<BM>(s_acc, smem_desc(k_wg + k_off, 16, 1024),
                                      smem_desc(smem + L::QS + q_off, 16, 1024), 1);
                    wgmma_ss_tf32<BM>(s_acc, smem_desc(k_wg + k_off, 16, 1024),
                                      smem_desc(smem + L::QB + q_off, 16, 1024), 1);
                }
                wgmma_commit();
                // ---- dPᵀ = V dOᵀ  [64 keys, BM]: v_big·do_big (first: it overwrites), v_big·do_small,
                //      v_small·do_big (registers); its own group, so Pᵀ starts when Sᵀ is done
    #pragma unroll
                for (int kk = 0; kk < D / 8; ++kk) {
                    const u32 v_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;
                    const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
                    wgmma_ss_tf32<BM>(dp_acc, smem_desc(v_wg + v_off, 16, 1024),
                                      smem_desc(smem + L::DOB + q_off, 16, 1024), kk > 0);
                    wgmma_ss_tf32<BM>(dp_acc, smem_desc(v_wg + v_off, 16, 1024),
                                      smem_desc(smem + L::DOS + q_off, 16, 1024), 1);
                    wgmma_rs_tf32<BM>(dp_acc, vs_frag + 4 * kk, smem_desc(smem + L::DOB + q_off, 16, 1024));
                }
                wgmma_commit();
                wgmma_wait<1>();                               // Sᵀ done (dPᵀ may still run)
                fence_regs<NS>(s_acc);

                // ---- Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e), masked, in place in s_acc
                bool need_mask = n0 + BN > p.s_k;
                if (WINDOW)
                    need_mask |= n0 + BN - 1 > m0 + p.diag_offset + p.window_right ||
                                 n0 < m0 + BM - 1 + p.diag_offset - p.window_left;
    #pragma unroll
                for (int i = 0; i < NS; ++i) {
                    const int col = (i / 4) * 8 + col_in_8 + (i % 2);   // query row m0 + col
                    const int key = key0 + ((i % 4) >= 2 ? 8 : 0);
                    float pe = fast_exp2(s_acc[i] * p.scale_log2 - lse_smem[col]);
                    if (need_mask) {
                        const int diag = m0 + col + p.diag_offset;
                        bool keep = key < p.s_k;
                        if (WINDOW) keep = keep && key <= diag + p.window_right && key >= diag - p.window_left;
                        if (!keep) pe = 0.f;
                    }
                    s_acc[i] = pe;
                }
                wgmma_wait<0>();                               // dPᵀ done
                fence_regs<NS>(dp_acc);
                fence_regs<D / 2>(vs_frag);                    // read by dPᵀ until here

                // ---- dSᵀ = Pᵀ ∘ (dPᵀ − D)·scale; Pᵀ and dSᵀ split into TF32 A fragments. Accumulator
                //      registers 4kk .. 4kk + 3 of query step kk hold (key r, query 2c), (r, 2c + 1),
                //      (r + 8, 2c), (r + 8, 2c + 1); fragment slots c, c + 4 are queries 2c, 2c + 1
                //      (Qᵀ / dOᵀ are stored to match): a = {x[4kk], x[4kk + 2], x[4kk + 1], x[4kk + 3]}
                u32 p_big[NS], p_small[NS], ds_bigf[NS], ds_smallf[NS];
    #pragma unroll
                for (int kk = 0; kk < BM / 8; ++kk) {
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = 4 * kk + (e == 1 ? 2 : e == 2 ? 1 : e);
                        const int col = kk * 8 + col_in_8 + (i % 2);
                        const float ds = s_acc[i] * (dp_acc[i] - dsum_smem[col]) * p.scale;
                        split_tf32(s_acc[i], p_big[4 * kk + e], p_small[4 * kk + e]);
                        split_tf32(ds, ds_bigf[4 * kk + e], ds_smallf[4 * kk + e]);
                    }
                }
                // this thread has read its rows (lse, D) and its Sᵀ, dPᵀ are done: Q, dO parts and
                // rows free. One arrival per thread: racecheck orders the next write of the rows
                // only after each reader's own arrival. (s_q > 0 holds in every step; as a branch it
                // keeps ptxas's schedule: unconditional, the hd 64 non-window variant spills 112 B.)
                if (p.s_q > 0) mbar_arrive(nat_empty);

                // ---- dS big / small -> this consumer's dS tile [BM queries, 64 keys] (keys
                //      contiguous in slot order, 128-byte swizzle, panels of 32 keys): the B operand of
                //      dQᵀ = Kᵀ dSᵀ. Slot e of step kk is key row_in_wg + 8(e % 2), query 8kk + 2c + e / 2.
    #pragma unroll
                for (int kk = 0; kk < BM / 8; ++kk) {
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int kl = row_in_wg + 8 * (e % 2), q = 8 * kk + col_in_8 + e / 2;
                        const u32 off = swz(q, slot_of_key(kl), L::DS_PANEL);
                        sts32(ds_big + off, ds_bigf[4 * kk + e]);
                        sts32(ds_small + off, ds_smallf[4 * kk + e]);
                    }
                }
                fence_proxy_async();   // for the dQᵀ product (before the dV / dK group: ptxas 12.9)

                // ---- dV += Pᵀ dO, dK += dSᵀ Q  [64 keys, D]: B = dOᵀ / Qᵀ [D, BM] K-major, 8 queries
                //      (32 bytes) per k-step; per k-step small·big + big·small + big·big. Each step's
                //      product goes to a zeroed step accumulator, added to dV / dK in fp32 (round to
                //      nearest): the tensor cores' accumulation rounds toward zero, and 12 products per
                //      step into dV / dK directly biased them by ~steps·12·2⁻²⁴ relative (2048 rows:
                //      5e-5). dV, then dK, through the one step accumulator (32 registers).
                float step_acc[NKV];
                // step_acc [64 keys, D] += A [64 keys, BM] (big / small TF32 fragments) · B [BM, D]
                // (its transposed parts xt_big / xt_small [D, BM] K-major), issued and committed
                auto issue_step_product = [&](const u32* a_big, const u32* a_small, u32 xt_big, u32 xt_small) {
                    fence_regs<NKV>(step_acc);
                    wgmma_fence();
    #pragma unroll
                    for (int kk = 0; kk < BM / 8; ++kk) {
                        const u32 off = (kk / 4) * L::T_PANEL + (kk % 4) * 32;
                        wgmma_rs_tf32<D>(step_acc, a_small + 4 * kk, smem_desc(xt_big + off, 16, 1024));
                        wgmma_rs_tf32<D>(step_acc, a_big + 4 * kk, smem_desc(xt_small + off, 16, 1024));
                        wgmma_rs_tf32<D>(step_acc, a_big + 4 * kk, smem_desc(xt_big + off, 16, 1024));
                    }
                    wgmma_commit();
                };
                mbar_wait(t_full, q_it & 1);                   // Qᵀ, dOᵀ parts written
    #pragma unroll
                for (int i = 0; i < NKV; ++i) step_acc[i] = 0.f;
                issue_step_product(p_big, p_small, smem + L::DOTB, smem + L::DOTS);   // dV
                // every warp of this consumer has stored its dS rows (for dQᵀ below)
                named_bar_sync(WG_BAR + cw, 128);
                wgmma_wait<0>();                               // dV's step product done
                fence_regs<NKV>(step_acc);
                fence_regs<NS>(p_big);
                fence_regs<NS>(p_small);
    #pragma unroll
                for (int i = 0; i < NKV; ++i) {
                    dv_acc[i] += step_acc[i];
                    step_acc[i] = 0.f;
                }
                issue_step_product(ds_bigf, ds_smallf, smem + L::QTB, smem + L::QTS);   // dK
                wgmma_wait<0>();                               // dK's step product done: fragments free
                fence_regs<NKV>(step_acc);
                fence_regs<NS>(ds_bigf);
                fence_regs<NS>(ds_smallf);
    #pragma unroll
                for (int i = 0; i < NKV; ++i) dk_acc[i] += step_acc[i];
                if (t == 0) mbar_arrive(t_empty);              // Qᵀ, dOᵀ parts no longer needed

                // ---- dQᵀ_c [D, BM] = Kᵀ_c dSᵀ_c over this consumer's 64 keys: A = Kᵀ fragments from
                //      k_big / k_small, B = its dS tile [BM, 64 key slots] K-major (k-steps of 8 slots =
                //      32 bytes); kt_small·ds_big first (dq_acc zeroed: register-A products always
                //      accumulate), kt_big·ds_small, kt_big·ds_big. The fragment rows r, r + 8 are
                //      columns d0, d0 + 1 of K (d0 = 16·warp + 2·(lane / 4): a permutation of dQᵀ's rows,
                //      undone at the store), so each pair is one 8-byte load; columns c, c + 4 are the
                //      keys in slots c, c + 4.
                float dq_acc[NQ];
    #pragma unroll
                for (int i = 0; i < NQ; ++i) dq_acc[i] = 0.f;
                const int d0 = 16 * (t / 32) + 2 * ((t % 32) / 4);
                u32 kt_big[D / 2], kt_small[D / 2];
    #pragma unroll
                for (int kk = 0; kk < 64 / 8; ++kk) {
    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 off = swz(key_of_slot(8 * kk + c4 + 4 * h), d0, L::KV_PANEL);
                        lds64(k_wg + off, kt_big[4 * kk + 2 * h], kt_big[4 * kk + 2 * h + 1]);
                        lds64(ks_wg + off, kt_small[4 * kk + 2 * h], kt_small[4 * kk + 2 * h + 1]);
                    }
                }
                fence_regs<NQ>(dq_acc);
                wgmma_fence();
    #pragma unroll
                for (int kk = 0; kk < 64 / 8; ++kk) {
                    const u32 off = (kk / 4) * L::DS_PANEL + (kk % 4) * 32;
                    wgmma_rs_tf32<BM>(dq_acc, kt_small + 4 * kk, smem_desc(ds_big + off, 16, 1024));
                    wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, smem_desc(ds_small + off, 16, 1024));
                    wgmma_rs_tf32<BM>(dq_acc, kt_big + 4 * kk, smem_desc(ds_big + off, 16, 1024));
                }
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs<NQ>(dq_acc);
                fence_regs<D / 2>(kt_big);
                fence_regs<D / 2>(kt_small);
                // every warp's dQᵀ product has read its dS tile before the next step's stores (and,
                // in the last step, its Kᵀ fragments: K, V free)
                named_bar_sync(WG_BAR + cw, 128);
                // the tile's last reads of K (Sᵀ, Kᵀ fragments) and V (dPᵀ) have completed: the next
                // tile's K, V may land while this one's dQ is added and dK, dV are stored
                if (st == wt.steps - 1 && t == 0) mbar_arrive(kv_empty);

                // ---- dq rows m0 .. += dQᵀ_cᵀ: this consumer's partial over its keys
                float* dq_bh = (float*)p.dq + wt.batch * p.dq_stride_b + head * p.dq_stride_h;   // [s_q, D]
                add_dq(dq_bh, p.dq_stride_s, m0, p.s_q, d0, col_in_8, dq_acc);
            }
            if (wt.steps > 0) ++kv_it;

            // ---- dK, dV of this consumer's 64 keys (GQA: summed over the group's query heads;
            //      zeros for a tile that no query sees), float32 pairs
    #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int key = key0 + 8 * r;
                if (key < p.s_k) {
                    float* dk_row = (float*)p.dk + wt.batch * p.dk_stride_b + (i64)key * p.dk_stride_s +
                                    wt.kv_head * p.dk_stride_h;
                    float* dv_row = (float*)p.dv + wt.batch * p.dv_stride_b + (i64)key * p.dv_stride_s +
                                    wt.kv_head * p.dv_stride_h;
    #pragma unroll
                    for (int i = 0; i < NKV; i += 4) {
                        const int col = (i / 4) * 8 + col_in_8;
                        *(float2*)(dk_row + col) = make_float2(dk_acc[i + 2 * r], dk_acc[i + 2 * r + 1]);
                        *(float2*)(dv_row + col) = make_float2(dv_acc[i + 2 * r], dv_acc[i + 2 * r + 1]);
                    }
                }
            }
        }
    }
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
