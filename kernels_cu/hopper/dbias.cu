// cupyflash: Hopper (sm_90a) dbias kernel: portable/bwd.cu's flash_bwd_dbias (same math, same output)
// with TMA loads and wgmma products. The launcher (cupyflash/gpu/dbias_sm90.py) runs it after
// the main backward kernels, which then write no dbias, instead of flash_bwd_dbias wherever it
// covers the call:
//
//   dbias[pb, ph, i, j] = Σ over the (batch, head) pairs that plane (pb, ph) broadcasts to
//                         of dS[batch, head, i, j]
//   dS = P ∘ (dP − D)  (natural units, no scale),   S = Q Kᵀ,  dP = dO Vᵀ,  D = rowsum(dO ∘ O)
//   P  = exp2(S·scale·log2 e + bias·log2 e − lse·log2 e)
//
// A work tile is the [BM = 128 queries, BN = 128 keys] tile (m0, n0) of one dbias plane; it
// walks the plane's pairs in a fixed order (batch outer, head inner), recomputes S and dP for
// each, sums dS in float32 registers and stores the tile once, in the bias's element type, into
// p.dbias with the dbias strides: no float32 copy of dbias in memory, deterministic.
// The bias of every pair of a plane is the plane's own bias tile (the pairs are exactly the
// bias's broadcast), so it is staged into shared memory once per work tile, not per pair.
//
// Persistent grid: at most one block per SM; the producer's thread draws work tiles from the
// per-stream counter the other Hopper kernels use (p.sched; the last block zeroes it), query
// tiles fastest: blocks running together work on the same key tile of the same plane and read
// the same K / V tiles (of the same pair, the pairs walk in step) from L2.
// 384 threads = three warpgroups:
//   warpgroup 0, producer (one thread): hands each work tile's index to the consumers through
//     a two-deep ring in shared memory, loads its bias tile (TMA, BIASBUF buffers) and, per pair,
//     two half stages into a STAGES-deep ring (TMA, mbarriers): A = (Q [BM, D], K [BN, D]),
//     B = (dO [BM, D], V [BN, D]). Half stages, not whole pairs: a pair is 128 KB at d = 128
//     (two do not fit beside the bias), and S needs only A: the next pair's A loads while this
//     pair's dP and exponentials run.
//   warpgroups 1 and 2, consumers: 64 query rows each. Per pair:
//     S  = Q Kᵀ    [64, BN] fp32   (wgmma, both operands in shared memory; half A)
//     dP = dO Vᵀ   [64, BN] fp32   (a second wgmma group; half B)
//     P  = exp2(S·scale·log2 e + bias·log2 e − lse·log2 e)   (while dP still runs)
//     acc += P ∘ (dP − D)                                    (acc [64, BN] fp32)
//   lse and D of a lane's two rows come straight from global memory (4 loads per pair).
//
// Registers per consumer lane: acc, S, dP are [64, 128] fp32 accumulators over 128 lanes:
// 64 + 64 + 64 = 192 of the 232 setmaxnreg gives (40·128 + 232·256 <= 64K per SM); BN = 128
// is the most that fits, BM = 2 x 64 the most consumer rows at that register count.
// Shared memory (gpu/plan_dbias_sm90.smem_bytes mirrors Layout): a half stage is BM·D·2 + BN·D·2
// bytes (d = 128: 64 KB; d = 64: 32 KB), a bias tile BM·BN·(2 or 4) (32 / 64 KB):
//   d = 128, 16-bit bias: 3 half stages + 1 bias buffer = 192 + 32 = 224 KB
//   d = 128, float32 bias: 2 + 1 = 128 + 64 = 192 KB (3 + 1 would be 256)
//   d = 64,  16-bit bias: 4 + 2 = 128 + 64 = 192 KB;  float32 bias: 4 + 1 = 192 KB
// of the 227 KB a block may have (plus barriers, the tile ring and 1024 bytes of alignment).
// Arithmetic intensity: per pair a block loads (BM + BN)·D·2·2 bytes for 4·BM·BN·D flops,
// BM·BN / (BM + BN) = 64 flops per byte of L2 traffic (the forward's: BM = 128).
//
// Ragged tails and masks: the tensor maps zero-fill rows past s_q / s_k. Keys past s_k and rows
// past s_q are never stored, so their (finite or not) sums need no mask; rows past s_q and rows
// that saw no key (lse = −inf) get lse = +inf, so their P is exactly 0. WINDOW (causal / sliding
// window, either alignment): tiles no row of which keeps a key of the tile are stored as zeros
// with no pair loaded; tiles crossing a band edge mask P per element.
// Covered (the launcher keeps flash_bwd_dbias for the rest): float16 / bfloat16 q, k, v, dout,
// d = d_v in {64, 128}; the bias in q's 16-bit type (BIAS_F32 = false) or float32 (true) with a
// full query dimension and strides TMA accepts; any scale; GQA / MQA; causal / window. Not:
// softcap, ALiBi, a boolean mask (the portable kernel applies those).
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/dbias_consumer.cuh"
#include "hopper/dbias_layout.cuh"
#include "hopper/dbias_producer.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

// E: float16 / bfloat16 (q, k, v, dout); D = d = d_v; BIAS_F32: bias (and dbias) elements float32,
// else E's; STAGES: half stages in the ring; BIASBUF: bias tile buffers; WINDOW: causal / window.
// Params: the backward's record (q, k, v, dout, lse, dsum, bias, dbias, their strides, scale,
// window, sched) plus the tensor maps tma_q / tma_do (box [64 columns, BM rows]), tma_k / tma_v
// (box [64 columns, BN rows]) and tma_bias (bias [b', h', s_q, s_k] as (s_k, s_q, h', b'), box
// [128 bytes of keys, BM queries]), built by the launcher for this kernel's tiles.
// The entry sets up shared memory (DbiasSmem, hopper/dbias_layout.cuh) and the mbarriers and
// hands each warpgroup its role: the TMA thread dbias_load (hopper/dbias_producer.cuh), the
// consumers dbias_consumer (hopper/dbias_consumer.cuh).
template <typename E, int D, bool BIAS_F32, int STAGES, int BIASBUF, bool WINDOW>
__global__ void __launch_bounds__(sm90d::THREADS, 1)
flash_bwd_dbias_sm90(const __grid_constant__ Params p) {
    using namespace sm90d;
    using L = Layout<D, BIAS_F32, STAGES, BIASBUF>;
    static_assert(Elem<E>::is16 && (D == 64 || D == 128), "float16 / bfloat16, head dim 64 or 128");
    static_assert(STAGES >= 2 && BIASBUF >= 1, "both halves of a pair in the ring at once");

    extern __shared__ unsigned char smem_raw[];
    const u32 smem = aligned_smem<L>(smem_raw);   // swizzled panels: 1024-aligned (traps if too small)
    const u32 ring_smem = smem + L::RING;               // [STAGES][HALF]: (Q, K) or (dO, V) of a pair
    const u32 bias_smem = smem + L::BIAS;               // [BIASBUF][BIAS_TILE]: a work tile's bias
    volatile int* tile_smem = (volatile int*)(smem_raw + (smem - smem_addr(smem_raw)) + L::TILE);
    const u32 ring_full = smem + L::BARS;               // [STAGES]: the half stage landed
    const u32 ring_empty = ring_full + 8 * STAGES;      // [STAGES]: both consumers' products read it
    const u32 bias_full = ring_empty + 8 * STAGES;      // [BIASBUF]: the bias tile landed
    const u32 bias_empty = bias_full + 8 * BIASBUF;     // [BIASBUF]: every consumer warp read it
    const u32 tile_full = bias_empty + 8 * BIASBUF;     // [TILE_RING]: tile_smem slot written
    const u32 tile_empty = tile_full + 8 * TILE_RING;   // [TILE_RING]: every consumer warp read it
    // the same, for the role functions
    const DbiasSmem sm = {smem, ring_smem, bias_smem, tile_smem, ring_full, ring_empty, bias_full, bias_empty,
                          tile_full, tile_empty};
    const int num_work = ((p.s_q + BM - 1) / BM) * ((p.s_k + BN - 1) / BN) * num_planes(p);

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128, lane = t % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(ring_full + 8 * s, 1);     // the TMA thread's expect_tx arrival (+ bytes)
            mbar_init(ring_empty + 8 * s, 2);    // one arrival per consumer warpgroup
        }
        for (int b = 0; b < BIASBUF; ++b) {
            mbar_init(bias_full + 8 * b, 1);     // the TMA thread (+ bytes)
            mbar_init(bias_empty + 8 * b, CONSUMER_WARPS);   // read by ldmatrix / ld.shared: per warp
        }
        for (int s = 0; s < TILE_RING; ++s) {
            mbar_init(tile_full + 8 * s, 1);     // the scheduling thread
            mbar_init(tile_empty + 8 * s, 32 * CONSUMER_WARPS);   // every consumer lane
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<PRODUCER_REGS>();
        if (t == 0) dbias_load<D, BIAS_F32, STAGES, BIASBUF, WINDOW>(p, sm, num_work);
        return;
    }

    // ================================ consumers ================================
    regs_acquire<CONSUMER_REGS>();
    dbias_consumer<E, D, BIAS_F32, STAGES, BIASBUF, WINDOW>(p, sm, wg, t, lane);
}
