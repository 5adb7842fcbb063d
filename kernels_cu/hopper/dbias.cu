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
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

namespace sm90d {

constexpr int BM = 128;              // queries per work tile: two consumer warpgroups x 64
constexpr int BN = 128;              // keys per work tile
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;   // 40·128 + 232·256 <= 64K registers per SM
constexpr int PANEL_COLS = 64;       // 64 16-bit columns = one 128-byte swizzle row
constexpr int TILE_RING = 2;         // work-tile indices in flight (tile_smem ring)
constexpr int CONSUMER_WARPS = 8;    // arrivals that free a tile_smem slot or a bias buffer

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_dbias_sm90.py: smem_bytes.
template <int D, bool BIAS_F32, int STAGES, int BIASBUF>
struct Layout {
    static constexpr int PANELS = D / PANEL_COLS;            // 64-column panels of a [rows, D] tile
    static constexpr int Q_PANEL = BM * 128;                 // bytes of a [BM, 64] panel (Q, dO)
    static constexpr int K_PANEL = BN * 128;                 // bytes of a [BN, 64] panel (K, V)
    static constexpr int Q_TILE = PANELS * Q_PANEL;          // q / do tile [PANELS][BM][64]
    static constexpr int K_TILE = PANELS * K_PANEL;          // k / v tile [PANELS][BN][64]
    static constexpr int HALF = Q_TILE + K_TILE;             // one half stage: (Q, K) or (dO, V)
    static constexpr int BIAS_KEYS = BIAS_F32 ? 32 : 64;     // keys per 128-byte bias panel row
    static constexpr int BIAS_PANEL = BM * 128;              // bytes of a [BM, BIAS_KEYS] panel
    static constexpr int BIAS_TILE = (BN / BIAS_KEYS) * BIAS_PANEL;   // [BN / BIAS_KEYS][BM][BIAS_KEYS]
    static constexpr int RING = 0;                           // ring_smem [STAGES][HALF]
    static constexpr int BIAS = RING + STAGES * HALF;        // bias_smem [BIASBUF][BIAS_TILE]
    static constexpr int TILE = BIAS + BIASBUF * BIAS_TILE;  // tile_smem [TILE_RING] int (16 bytes)
    static constexpr int BARS = TILE + 16;                   // ring_full[STAGES], ring_empty[STAGES],
                                                             // bias_full[BIASBUF], bias_empty[BIASBUF],
                                                             // tile_full[TILE_RING], tile_empty[TILE_RING]
    static constexpr int BYTES = BARS + 8 * (2 * STAGES + 2 * BIASBUF + 2 * TILE_RING);
};

// dbias (and bias) element type: float32, or E's 16-bit storage
template <bool F32, typename S> struct BiasElem { typedef S type; };
template <typename S> struct BiasElem<true, S> { typedef float type; };

}  // namespace sm90d

// E: float16 / bfloat16 (q, k, v, dout); D = d = d_v; BIAS_F32: bias (and dbias) elements float32,
// else E's; STAGES: half stages in the ring; BIASBUF: bias tile buffers; WINDOW: causal / window.
// Params: the backward's record (q, k, v, dout, lse, dsum, bias, dbias, their strides, scale,
// window, sched) plus the tensor maps tma_q / tma_do (box [64 columns, BM rows]), tma_k / tma_v
// (box [64 columns, BN rows]) and tma_bias (bias [b', h', s_q, s_k] as (s_k, s_q, h', b'), box
// [128 bytes of keys, BM queries]), built by the launcher for this kernel's tiles.
template <typename E, int D, bool BIAS_F32, int STAGES, int BIASBUF, bool WINDOW>
__global__ void __launch_bounds__(sm90d::THREADS, 1)
flash_bwd_dbias_sm90(const __grid_constant__ Params p) {
    using namespace sm90d;
    using L = Layout<D, BIAS_F32, STAGES, BIASBUF>;
    typedef typename Elem<E>::storage S;
    static_assert(Elem<E>::is16 && (D == 64 || D == 128), "float16 / bfloat16, head dim 64 or 128");
    static_assert(STAGES >= 2 && BIASBUF >= 1, "both halves of a pair in the ring at once");
    constexpr int NS = BN / 2;       // S / dP / acc accumulator registers per lane: [64, BN]

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
        if (t == 0) {
            tma_prefetch_desc(&p.tma_q);
            tma_prefetch_desc(&p.tma_k);
            tma_prefetch_desc(&p.tma_v);
            tma_prefetch_desc(&p.tma_do);
            tma_prefetch_desc(&p.tma_bias);
            int half_it = 0;   // half stages issued so far (ring position)
            int bias_it = 0;   // bias tiles issued so far
            int drawn = 0;     // work-tile indices drawn so far (without a counter: i + k·grid)
            // Half stage half_it: a [BM, D] tile of q_map (Q or dO) and a [BN, D] tile of k_map
            // (K or V) of one pair into ring slot half_it % STAGES, once both consumers are done
            // with the slot's previous half
            auto load_half = [&](const TmaDesc* q_map, const TmaDesc* k_map, int m0, int n0,
                                 int head, int kv_head, int batch) {
                const int s = half_it % STAGES;
                const u32 full = ring_full + 8 * s, dst = ring_smem + s * L::HALF;
                if (half_it >= STAGES) mbar_wait(ring_empty + 8 * s, ((half_it / STAGES) - 1) & 1);
                mbar_arrive_expect_tx(full, L::HALF);
#pragma unroll
                for (int c = 0; c < L::PANELS; ++c) {
                    tma_load_4d(dst + c * L::Q_PANEL, q_map, full, c * PANEL_COLS, m0, head, batch);
                    tma_load_4d(dst + L::Q_TILE + c * L::K_PANEL, k_map, full, c * PANEL_COLS, n0, kv_head, batch);
                }
                ++half_it;
            };
            for (int tile_i = 0;; ++tile_i) {   // tile_i: work tiles handed to the consumers
                const int ts = tile_i % TILE_RING;
                // every consumer warp has taken the slot's previous index
                if (tile_i >= TILE_RING) mbar_wait(tile_empty + 8 * ts, ((tile_i / TILE_RING) - 1) & 1);
                const int w = sched_draw(p.sched, drawn);
                tile_smem[ts] = w < num_work ? w : -1;
                mbar_arrive(tile_full + 8 * ts);     // publishes tile_smem[ts] (release)
                if (w >= num_work) break;            // no work left: the consumers stop on -1
                const DbiasTile wt = dbias_tile<BM, BN, WINDOW>(p, w);
                for (int it = 0; it < wt.pairs; ++it) {
                    int batch, head;
                    pair_of(p, wt, it, &batch, &head);
                    const int kv_head = head / p.h_per_hk;
                    load_half(&p.tma_q, &p.tma_k, wt.m0, wt.n0, head, kv_head, batch);    // A: S = Q Kᵀ
                    load_half(&p.tma_do, &p.tma_v, wt.m0, wt.n0, head, kv_head, batch);   // B: dP = dO Vᵀ
                    if (it == 0) {
                        // the tile's bias [BM, BN] as BN / BIAS_KEYS panels (zeros past s_q / s_k),
                        // after the first pair's halves (the consumers need it after S), once
                        // every consumer warp has read the buffer's previous tile
                        const int bb = bias_it % BIASBUF;
                        if (bias_it >= BIASBUF) mbar_wait(bias_empty + 8 * bb, ((bias_it / BIASBUF) - 1) & 1);
                        mbar_arrive_expect_tx(bias_full + 8 * bb, L::BIAS_TILE);
#pragma unroll
                        for (int c = 0; c < BN / L::BIAS_KEYS; ++c)
                            tma_load_4d(bias_smem + bb * L::BIAS_TILE + c * L::BIAS_PANEL, &p.tma_bias,
                                        bias_full + 8 * bb, wt.n0 + c * L::BIAS_KEYS, wt.m0, wt.ph, wt.pb);
                        ++bias_it;
                    }
                }
            }
            if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
        }
        return;
    }

    // ================================ consumers ================================
    regs_acquire<CONSUMER_REGS>();
    const int cw = wg - 1;                                 // consumer 0 or 1: rows m0 + 64·cw ..
    const int row_in_wg = (t / 32) * 16 + lane / 4;       // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (lane % 4);                   // accumulator columns col_in_8, +1 (of 8)
    // Accumulator [64, BN] layout (wgmma m64nN fp32): x[i] is row row_in_wg + 8·((i % 4) >= 2),
    // column 8·(i / 4) + col_in_8 + (i % 2).
    float acc[NS];                    // Σ dS over the pairs, fp32

    int half_it = 0, bias_it = 0;     // ring positions consumed so far (as the producer's)
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const DbiasTile wt = dbias_tile<BM, BN, WINDOW>(p, w);
        const int row0 = wt.m0 + cw * 64 + row_in_wg;     // this lane's rows: row0, row0 + 8
        const int bb = bias_it % BIASBUF;
        const u32 bias_tile = bias_smem + bb * L::BIAS_TILE;   // [BN / BIAS_KEYS][BM][BIAS_KEYS]
#pragma unroll
        for (int i = 0; i < NS; ++i) acc[i] = 0.f;

        for (int it = 0; it < wt.pairs; ++it, half_it += 2) {
            int batch, head;
            pair_of(p, wt, it, &batch, &head);
            // lse·log2 e and D of rows row0, row0 + 8 (past s_q, or lse = −inf: +inf and 0, P = 0)
            float lse2[2], dsum[2];
            const i64 rows = ((i64)batch * p.h + head) * p.s_q;   // [b, h, s_q] index of row 0
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + 8 * r;
                const float l = row < p.s_q ? p.lse[rows + row] : -CF_INF;
                lse2[r] = l == -CF_INF ? CF_INF : l * CF_LOG2E;
                dsum[r] = row < p.s_q ? p.dsum[rows + row] : 0.f;
            }

            // ---- S = Q Kᵀ  [64, BN] (half A) and dP = dO Vᵀ  [64, BN] (half B), fp32: two
            //      groups, so P can start as soon as S is done; k-steps of 16 columns (32 bytes)
            //      within the D / 64 panels
            float s_acc[NS], dp_acc[NS];
            const int sa = half_it % STAGES, sb = (half_it + 1) % STAGES;
            const u32 q_wg = ring_smem + sa * L::HALF + cw * 64 * 128;    // this consumer's 64 Q rows
            const u32 k_tile = ring_smem + sa * L::HALF + L::Q_TILE;      // [BN, D]
            const u32 do_wg = ring_smem + sb * L::HALF + cw * 64 * 128;   // its 64 dO rows
            const u32 v_tile = ring_smem + sb * L::HALF + L::Q_TILE;      // [BN, D]
            mbar_wait(ring_full + 8 * sa, (half_it / STAGES) & 1);        // Q, K of the pair landed
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32, koff = (kk / 4) * L::K_PANEL + (kk % 4) * 32;
                wgmma_ss<E, BN>(s_acc, smem_desc(q_wg + off, 16, 1024), smem_desc(k_tile + koff, 16, 1024), kk > 0);
            }
            wgmma_commit();
            mbar_wait(ring_full + 8 * sb, ((half_it + 1) / STAGES) & 1);  // dO, V of the pair landed
            wgmma_fence();   // a group of its own: S may be waited for alone
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32, koff = (kk / 4) * L::K_PANEL + (kk % 4) * 32;
                wgmma_ss<E, BN>(dp_acc, smem_desc(do_wg + off, 16, 1024), smem_desc(v_tile + koff, 16, 1024), kk > 0);
            }
            wgmma_commit();
            if (it == 0) mbar_wait(bias_full + 8 * bb, (bias_it / BIASBUF) & 1);   // the tile's bias landed
            wgmma_wait<1>();                         // S done (dP may still run)
            fence_regs<NS>(s_acc);
            if (t == 0) mbar_arrive(ring_empty + 8 * sa);   // Q, K no longer read by this consumer

            // ---- P = exp2(S·scale·log2 e + bias·log2 e − lse·log2 e), in place in s_acc; 16 keys
            //      (s_acc[8kb .. 8kb + 7]) per step kb
#pragma unroll
            for (int kb = 0; kb < BN / 16; ++kb) {
                float bias[8];   // bias of s_acc[8kb + e]
                if constexpr (!BIAS_F32) {
                    // One ldmatrix.x4 from the [BM, 64]-key panel kb / 4: matrix mt = lane / 8 is
                    // rows 8·(mt % 2) .. + 7 of the warp's 16 and keys 8·(mt / 2) .. + 7 of the 16
                    // (a 16-byte chunk, swizzled: chunk XOR row mod 8; rows: lane % 8 gives their
                    // addresses); lane l receives row l / 4, keys 2(l % 4), + 1 of each matrix:
                    // register j holds s_acc[8kb + 2j], [8kb + 2j + 1]'s pair (low half first)
                    const int mt = lane / 8;
                    const int row = cw * 64 + (t / 32) * 16 + (mt % 2) * 8 + lane % 8;   // tile row
                    const int chunk = (kb % 4) * 2 + mt / 2;
                    u32 pairs[4];
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(pairs[0]), "=r"(pairs[1]), "=r"(pairs[2]), "=r"(pairs[3])
                                 : "r"(bias_tile + (kb / 4) * L::BIAS_PANEL + row * 128 + ((chunk ^ (lane % 8)) << 4)));
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        bias[2 * j] = to_float<E>((S)(pairs[j] & 0xffffu));
                        bias[2 * j + 1] = to_float<E>((S)(pairs[j] >> 16));
                    }
                } else {
                    // float32 panels [BM, 32 keys]: s_acc[8kb + 4h + 2r + e] is row row_in_wg + 8r,
                    // key 16kb + 8h + col_in_8 + e: one 8-byte pair per (h, r), chunk (key % 32) / 4
                    // XOR row mod 8 (= lane / 4)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int row = cw * 64 + row_in_wg + 8 * r, key = 16 * kb + 8 * hh + col_in_8;
                            const u32 addr = bias_tile + (key / 32) * L::BIAS_PANEL + row * 128 +
                                             ((((key % 32) / 4) ^ (row % 8)) << 4) + (key % 4) * 4;
                            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                                         : "=f"(bias[4 * hh + 2 * r]), "=f"(bias[4 * hh + 2 * r + 1]) : "r"(addr));
                        }
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const int i = 8 * kb + e, r = (i % 4) / 2;
                    float pe = fast_exp2(fmaf(s_acc[i], p.scale_log2, fmaf(bias[e], CF_LOG2E, -lse2[r])));
                    if (WINDOW && wt.need_mask) {   // key j kept when diag(i) − left <= j <= diag(i) + right
                        const int key = wt.n0 + 8 * (i / 4) + col_in_8 + (i % 2);
                        const int diag = row0 + 8 * r + p.diag_offset;
                        if (key > diag + p.window_right || key < diag - p.window_left) pe = 0.f;
                    }
                    s_acc[i] = pe;
                }
            }
            if (it == wt.pairs - 1) {   // the tile's last read of its bias: this warp frees the buffer
                __syncwarp();
                if (lane == 0) mbar_arrive(bias_empty + 8 * bb);
            }

            // ---- acc += P ∘ (dP − D)
            wgmma_wait<0>();                         // dP done
            fence_regs<NS>(dp_acc);
            if (t == 0) mbar_arrive(ring_empty + 8 * sb);   // dO, V no longer read by this consumer
#pragma unroll
            for (int i = 0; i < NS; ++i) acc[i] = fmaf(s_acc[i], dp_acc[i] - dsum[(i % 4) / 2], acc[i]);
        }
        if (wt.pairs > 0) ++bias_it;

        // ---- the dbias tile of plane (pb, ph) in the bias's type (zeros for a tile outside the
        //      window), rows row0, row0 + 8; a lane's keys col, col + 1 as one store where dbias
        //      rows are contiguous with an even s_k (pairs aligned: the launcher's dbias is
        //      contiguous, so every row starts at an even element)
        typedef typename BiasElem<BIAS_F32, S>::type BT;
        BT* plane = (BT*)p.dbias + wt.pb * p.dbias_stride_b + wt.ph * p.dbias_stride_h;   // [s_q, s_k] (strided)
        const bool pairs_ok = p.dbias_stride_k == 1 && p.s_k % 2 == 0;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 8 * r;
            if (row >= p.s_q) continue;
            BT* row_gmem = plane + (i64)row * p.dbias_stride_q;   // [s_k] (strided)
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                const int key = wt.n0 + 8 * n + col_in_8;         // even
                const float v0 = acc[4 * n + 2 * r], v1 = acc[4 * n + 2 * r + 1];
                if (pairs_ok) {
                    if (key < p.s_k) {
                        if constexpr (BIAS_F32) *(float2*)(row_gmem + key) = make_float2(v0, v1);
                        else *(u32*)(row_gmem + key) = pack2<E>(v0, v1);
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < 2; ++c)
                        if (key + c < p.s_k) {
                            if constexpr (BIAS_F32) row_gmem[(i64)(key + c) * p.dbias_stride_k] = c ? v1 : v0;
                            else row_gmem[(i64)(key + c) * p.dbias_stride_k] = from_float<E>(c ? v1 : v0);
                        }
                }
            }
        }
    }
}
