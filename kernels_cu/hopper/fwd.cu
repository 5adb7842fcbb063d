// cupyflash: Hopper (sm_90a) attention forward: TMA loads, wgmma products, warp specialization.
//
//   O = softmax(scale · Q Kᵀ + bias) V per (batch, head), computed BM query rows x BN keys at a
//   time with the online-softmax recurrence (running max m, denominator l, O rescaled, one final
//   O / l).
//
// Persistent blocks of 128·(NC + 1) threads (one per SM; with NC = 1, two or three per SM, each
// on its own tiles: BlocksPerSm) walk the work tiles (BM = 64·NC query rows of one head of one
// batch); each block = NC + 1 warpgroups:
//   warpgroup 0, producer: one thread issues TMA copies of each Q tile and of its K / V tiles
//     into a STAGES-deep ring of shared-memory buffers (K and V on separate mbarriers, so S = Q Kᵀ
//     starts before V has landed); it keeps few registers (setmaxnreg), giving the rest to
//   warpgroups 1 .. NC, consumers: 64 query rows each. Per key tile: S = Q Kᵀ (wgmma, both
//     operands in shared memory), softcap / masks, online softmax in registers, O += P V (wgmma
//     with P straight from registers: the fp32 S accumulator layout packed to 16-bit pairs is the
//     A-fragment layout). The consumers take turns on the tensor cores (named barriers, round
//     robin, "pingpong"): while one runs its softmax, the others' GEMMs run. In its turn a
//     consumer issues S = Q Kᵀ of key tile j + 1 and then O += P V of key tile j, hands the turn
//     on, and runs the softmax of tile j + 1 while its O += P V is still on the tensor cores
//     (at hd 128; at hd 64 / 256 ptxas waits for that product first, which measured faster:
//     SOFTMAX_BESIDE_PV).
//     (A lone consumer, NC = 1, takes no turns: the other blocks on its SM fill the tensor cores.)
//     K and V stages are released separately (a K stage as soon as its S is done). At the end
//     of a work tile each consumer writes its O / l rows to its own o_smem and one of its
//     threads issues a TMA store of them (where o_smem fits; else the lanes store O directly).
//
// MAXFREE (dense hd 128 calls without a band, softcap or bias): the key-tile loop's softmax
// against the running max of the tiles before, without the tile's own row max and O's rescale
// while no P exceeds 256 (exact where a row rises further: softmax_maxfree), its P in a second
// buffer so that the loop alternates between two (unrolled by two key tiles).
//
// SPLIT (dense calls without a band, softcap or bias): the work tiles of the grid's last partial
// wave, which would run on a fraction of the SMs while the rest idle, are drawn as pieces, each a
// range of a tile's key tiles (the planner's table: _plan.sm90_split, sm90_work_items); a piece
// leaves its partial O, m, l in a workspace and the tile's last piece to finish merges them and
// stores the tile.
//
// Shared memory holds 128-byte swizzled panels of 64 columns: a [rows, D] tile is D / 64 panels
// of [rows, 64], each written by one TMA box and read by wgmma through a descriptor.
// Ragged tails come from the rank-4 tensor maps (d, s, heads, b): rows past s_q / s_k read as
// zeros, keys past s_k are masked, rows past s_q are not stored.
// Covered (the planner routes the rest to portable/fwd.cu): float16 / bfloat16, d = d_v in {64, 128, 256},
// causal / sliding window (either alignment), softcap, GQA / MQA, any s_q, s_k, scale > 0 (or any
// scale with softcap), tensors whose strides TMA accepts (16-byte multiples), and (VARLEN) packed
// variable-length sequences: each work tile reads its sequence's rows and lengths from
// cu_seqlens; rows of the next sequence that a tile's TMA box takes in are masked (keys) or not
// stored (queries); and (BIAS) an additive bias broadcast to [b, h, s_q, s_k] with a unit key
// stride, even s_k and even strides (pairs of columns per load), prefetched into L2 while
// S = Q Kᵀ runs and loaded after it (holding it in registers across the product spills).
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/epilogue.cuh"
#include "hopper/fwd_consumer.cuh"
#include "hopper/fwd_layout.cuh"
#include "hopper/fwd_producer.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/softmax.cuh"
#include "hopper/wgmma.cuh"

// The entry sets up shared memory (FwdSmem) and the mbarriers and hands each warpgroup its role:
// the producer fwd_load (hopper/fwd_producer.cuh), the consumers fwd_consumer
// (hopper/fwd_consumer.cuh).
// Persistent kernel: gridDim.x blocks (BlocksPerSm per SM) take work tiles from a global counter
// (p.sched[0], in the order w = 0, 1, ...: blocks running at the same time work on neighbouring
// tiles, which share K/V in L2, and a block that drew cheap causal tiles simply draws more); the
// last block to finish zeroes the counter for the next launch on the stream. Without a counter
// (p.sched == null) block i takes tiles i, i + gridDim.x, ... The K/V ring and the barrier phases
// run on across tiles, and the producer draws each next work tile as soon as the current one's
// loads are issued (its Q prefetched into L2, its first K tile into the ring), so that the next
// Q and first K / V tiles are there when the consumers finish the current tile.
// BIAS: 0 none, 1 bias elements in E's storage, 2 float32 bias elements. SPLIT (dense calls
// without a band, bias or softcap): the grid's last partial wave runs as pieces along the keys
// (fwd_work_tile), merged by each tile's last piece to finish (merge_pieces). MAXFREE (dense calls
// without a band, softcap or bias): the key-tile loop's softmax without the tile's row max
// where the running max of the tiles before holds (softmax_maxfree).
template <typename E, int D, int BN, int STAGES, int NC, bool WINDOW, bool SOFTCAP, bool VARLEN, int BIAS,
          bool SPLIT, bool MAXFREE>
__global__ void __launch_bounds__(128 * (NC + 1), BlocksPerSm<D, BN, STAGES, NC, VARLEN>::VALUE)
flash_fwd_sm90(const __grid_constant__ Params p) {
    using namespace sm90;
    using L = Layout<D, BN, STAGES, NC, VARLEN>;
    constexpr int BM = L::BM;
    typedef typename Elem<E>::storage S;
    static_assert(Elem<E>::is16, "the Hopper path takes float16 / bfloat16");
    static_assert(D % PANEL_COLS == 0 && D <= 256 && BN % 16 == 0 && BN <= 256 && BM <= 256, "tile shape");
    static_assert(BIAS == 0 || !VARLEN, "bias: dense batches");
    static_assert(!SPLIT || (!WINDOW && !VARLEN && !SOFTCAP && BIAS == 0), "split: dense, no band");
    static_assert(!MAXFREE || (!WINDOW && !VARLEN && !SOFTCAP && BIAS == 0 && D == 128),
                  "max-free softmax: dense, no band, hd 128 (its second P buffer needs the registers)");
    constexpr bool SOME_EMPTY = WINDOW || VARLEN;   // rows that see no key: fwd_consumer

    extern __shared__ unsigned char smem_raw[];
    // The planner (_plan.sm90_smem_bytes) sizes the launch: stop loudly if it disagrees with Layout
    u32 smem_given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    if (!SOME_EMPTY && p.s_k <= 0) __trap();   // (a launch the launcher never makes: no tile would load)
    if (L::O_SMEM && ((size_t)p.o & 15) != 0) __trap();   // (nor this: out has no tensor map)
    const FwdSmem<D, BN, STAGES, NC, VARLEN> sm(smem_raw);   // tiles and mbarriers
    // work tiles, then (SPLIT) the pieces of those from split_first on
    const int num_work = SPLIT ? p.split_first + p.split_pieces : p.num_m_blocks * p.h * p.b;

    const int wg = threadIdx.x / 128;      // 0 producer, 1 .. NC consumers
    const int t = threadIdx.x % 128;       // lane within the warpgroup

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full, 1);               // the producer's expect_tx arrival (+ bytes)
        mbar_init(sm.q_empty, 4 * NC);         // one arrival per consumer warp
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.k_full + 8 * s, 1);
            mbar_init(sm.k_full2 + 8 * s, 1);
            mbar_init(sm.v_full + 8 * s, 1);
            mbar_init(sm.k_empty + 8 * s, NC);
            mbar_init(sm.v_empty + 8 * s, NC);
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<Regs<NC, BlocksPerSm<D, BN, STAGES, NC, VARLEN>::VALUE>::PRODUCER>();
        if (t == 0) fwd_load<D, BN, STAGES, NC, WINDOW, VARLEN, BIAS, SPLIT>(p, sm, num_work);
        return;
    }

    // ================================ consumers ================================
    regs_acquire<Regs<NC, BlocksPerSm<D, BN, STAGES, NC, VARLEN>::VALUE>::CONSUMER>();
    fwd_consumer<E, D, BN, STAGES, NC, WINDOW, SOFTCAP, VARLEN, BIAS, SPLIT, MAXFREE>(p, sm, wg, t);
}
