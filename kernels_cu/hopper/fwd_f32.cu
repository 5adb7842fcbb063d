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
// last_turn, the pingpong loop) is written out again here: its products and hand-offs differ.
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
#include "hopper/fwd_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/softmax.cuh"
#include "hopper/wgmma.cuh"

namespace sm90f32 {

constexpr int F32_PANEL_COLS = 32;   // 32 floats = one 128-byte swizzle row
constexpr int CONV_THREADS = 96;     // producer warps 1..3: the converters
constexpr int CONV_BAR = 8;          // named barrier of the 96 converter threads
// (hopper/fwd.cu's named barriers 1 .. NC and 4 .. 3 + NC are the consumers')

// Registers per thread after setmaxnreg, NC = 2: producer·128 + consumer·256 = the block's
// 168·384 (the total may not grow: setmaxnreg.inc only takes what the block's warps gave back).
// 56 / 224 by default; WIDE (hd 128 with O_RN and the window masks, which spill 56 B at 224):
// 40 / 232 (the TMA thread and converters fit 40 without spills, but hd 64 timed -3 to +2 % with
// it against 56 / 224 on the H200). NC = 1 keeps the launch
// allocation: 256 threads x 255 registers fit as they are.
template <int NC, bool WIDE> struct Regs;
template <bool WIDE> struct Regs<2, WIDE> {
    static constexpr int CONSUMER = WIDE ? 232 : 224, PRODUCER = (168 * 384 - 256 * CONSUMER) / 128;
};

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/gpu/plan_fwd_sm90.py: sm90_f32_smem_bytes. QREG: no q_small tile (the consumers keep it in
// registers).
template <int D, int BN, int STAGES, int NC, bool QREG>
struct Layout {
    static constexpr int BM = 64 * NC;                       // query rows per work tile
    static constexpr int Q_PANEL = BM * 128;                 // bytes of one Q panel [BM, 32]
    static constexpr int KV_PANEL = BN * 128;                // one K / raw V panel [BN, 32]
    static constexpr int VT_PANEL = D * 128;                 // one Vᵀ panel [D, 32 keys]
    static constexpr int QT = BM * D * 4;                    // bytes of one Q tile
    static constexpr int KVT = BN * D * 4;                   // bytes of one K / V / Vᵀ tile
    static constexpr int Q = 0;                              // q_smem [D/32][BM][32]: raw, then big
    static constexpr int QS = Q + QT;                        // q_small [D/32][BM][32] (!QREG)
    static constexpr int KB = QS + (QREG ? 0 : QT);          // k_big [STAGES][D/32][BN][32] (TMA, then big)
    static constexpr int KS = KB + STAGES * KVT;             // k_small [STAGES][D/32][BN][32]
    static constexpr int VTB = KS + STAGES * KVT;            // vt_big [STAGES][BN/32][D][32]
    static constexpr int VTS = VTB + STAGES * KVT;           // vt_small [STAGES][BN/32][D][32]
    static constexpr int VRAW = VTS + STAGES * KVT;          // v_raw [STAGES][D/32][BN][32] (TMA)
    static constexpr int BARS = VRAW + STAGES * KVT;         // 3 + 7·STAGES mbarriers
    static constexpr int TILE = BARS + 8 * (3 + 7 * STAGES); // work-tile index, producer -> all
    static constexpr int BYTES = TILE + 8;
};

}  // namespace sm90f32

// QREG: the consumers split their own 64 Q rows (big in place, small kept in registers as the A
// fragments of q_small·k_big, a register-shared product): no q_small tile in shared memory, which
// leaves room for two 64-row consumers at hd 128. Otherwise the converters split Q like K.
template <typename E, int D, int BN, int STAGES, int NC, bool WINDOW, bool QREG>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
flash_fwd_sm90_f32(const __grid_constant__ Params p) {
    using namespace sm90;
    using namespace sm90f32;   // (Regs and Layout exist in both: named with their namespace)
    using L = sm90f32::Layout<D, BN, STAGES, NC, QREG>;
    constexpr int BM = L::BM;
    constexpr bool SPLIT = Elem<E>::split;   // 3xTF32 (f32x3_t) or one TF32 product (tf32_t)
    static_assert(!Elem<E>::is16, "the float32 Hopper kernel takes f32x3_t / tf32_t");
    static_assert(D % 32 == 0 && D <= 128 && BN % 32 == 0 && BN <= 128 && (NC == 1 || NC == 2),
                  "tile shape");
    constexpr int NS = BN / 2;       // S accumulator registers per lane: [64, BN] over 128 lanes
    constexpr int NO = D / 2;        // O accumulator registers per lane: [64, D]
    // O_RN: each key tile's P V goes to a zeroed accumulator added to O in fp32 (round to
    // nearest; the tensor cores' accumulation rounds toward zero, so O summed over s_k keys in
    // one accumulator drifts with s_k). 3xTF32 only (allow_tf32 keeps one accumulator). d <= 64:
    // one [64, D] accumulator (NO registers); d 128: PV_PARTS = 2 column halves through one
    // [64, D / 2] accumulator, the second half issued once the first is added (a whole second
    // [64, 128] fragment spills 324-440 B: these consumers also hold 64 registers of q_small)
    constexpr bool O_RN = SPLIT;
    constexpr int PV_PARTS = O_RN && D > 64 ? 2 : 1;
    constexpr int NPV = NO / PV_PARTS;   // accumulator registers of one P V part
    constexpr bool WIDE_REGS = PV_PARTS > 1 && WINDOW;   // consumers take 232 registers (Regs)

    extern __shared__ unsigned char smem_raw[];
    // The planner (_plan.sm90_f32_smem_bytes) sizes the launch: stop loudly if it disagrees
    u32 smem_given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    // 128-byte swizzled panels need 1024-byte alignment (the swizzle pattern repeats every 8 rows)
    const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 q_smem = smem + L::Q, q_small = smem + L::QS;
    const u32 k_big = smem + L::KB, k_small = smem + L::KS;
    const u32 vt_big = smem + L::VTB, vt_small = smem + L::VTS, v_raw = smem + L::VRAW;
    const u32 q_raw = smem + L::BARS;                  // Q tile (and its work-tile index) landed
    const u32 q_full = q_raw + 8;                      // Q split: consumers may read the tile (!QREG)
    const u32 q_empty = q_full + 8;                    // every consumer is done with the Q tile
                                                       // (QREG: and the converters with its index)
    const u32 k_raw = q_empty + 8;                     // [STAGES]: K tile landed (TMA)
    const u32 v_rawb = k_raw + 8 * STAGES;             // [STAGES]: V tile landed (TMA)
    const u32 k_full = v_rawb + 8 * STAGES;            // [STAGES]: K split: S may read it
    const u32 v_full = k_full + 8 * STAGES;            // [STAGES]: Vᵀ written: O += P V may read it
    const u32 k_empty = v_full + 8 * STAGES;           // [STAGES]: every consumer's S is done with K
    const u32 v_empty = k_empty + 8 * STAGES;          // [STAGES]: every consumer's P V is done with Vᵀ
    const u32 vraw_empty = v_empty + 8 * STAGES;       // [STAGES]: the converters have read raw V
    volatile int* tile_smem = (volatile int*)(smem_raw + (smem - smem_addr(smem_raw)) + L::TILE);
    const int num_work = p.num_m_blocks * p.h * p.b;

    const int wg = threadIdx.x / 128;      // 0 producer, 1 .. NC consumers
    const int t = threadIdx.x % 128;       // lane within the warpgroup

    if (threadIdx.x == 0) {
        mbar_init(q_raw, 1);                   // the TMA thread's expect_tx arrival (+ bytes)
        mbar_init(q_full, 1);                  // the converters' leader
        mbar_init(q_empty, 128 * NC + CONV_THREADS);   // one arrival per consumer and converter thread
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_raw + 8 * s, 1);
            mbar_init(v_rawb + 8 * s, 1);
            mbar_init(k_full + 8 * s, 1);
            mbar_init(v_full + 8 * s, 1);
            mbar_init(k_empty + 8 * s, NC);
            mbar_init(v_empty + 8 * s, NC);
            mbar_init(vraw_empty + 8 * s, 1);
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        if constexpr (NC > 1) regs_release<sm90f32::Regs<NC, WIDE_REGS>::PRODUCER>();
        if (t == 0) {
            // ---- TMA thread: Q, K, V tiles (raw float32) in consumption order
            tma_prefetch_desc(&p.tma_q);
            tma_prefetch_desc(&p.tma_k);
            tma_prefetch_desc(&p.tma_v);
            int kv_it = 0;     // K/V tiles issued so far (ring position)
            int drawn = 0;     // work-tile indices drawn so far (without a counter: i + k·grid)
            // K [BN, D] into k_big and V [BN, D] into v_raw of ring position kv_it: key tile `it`
            // of work tile wt, right to left through the band, STAGES buffers deep
            auto load_kv = [&](const FwdTile& wt, int it) {
                const int n0 = (wt.t_first + wt.n_tiles - 1 - it) * BN;
                const int s = kv_it % STAGES;
                const u32 prev = ((kv_it / STAGES) - 1) & 1;   // phase of the stage's last use
                // one [BN, D] tile of keys n0 .. in its D / 32 panels, landing on barrier `full`
                auto load_tile = [&](u32 dst_smem, const TmaDesc* desc, u32 full) {
                    mbar_arrive_expect_tx(full, BN * D * 4);
#pragma unroll
                    for (int c = 0; c < D / F32_PANEL_COLS; ++c)
                        tma_load_4d(dst_smem + c * L::KV_PANEL, desc, full, c * F32_PANEL_COLS, n0,
                                    wt.kv_head, wt.batch);
                };
                // K into k_big[s] once every consumer's S has read the stage's last K (and so
                // the converters are done with it: S waited for their k_full)
                if (kv_it >= STAGES) mbar_wait(k_empty + 8 * s, prev);
                load_tile(k_big + s * L::KVT, &p.tma_k, k_raw + 8 * s);
                // V into v_raw[s] once the converters have transposed the stage's last V
                if (kv_it >= STAGES) mbar_wait(vraw_empty + 8 * s, prev);
                load_tile(v_raw + s * L::KVT, &p.tma_v, v_rawb + 8 * s);
                ++kv_it;
            };
            // The next work tile w (-1: no work left), drawn before the Q tile of the current one is
            // released: its Q tile [BM, D] prefetched into L2 and its first key tile loaded into
            // the ring (`ahead` = 1) now, while the consumers still have up to STAGES key tiles of
            // the current tile to go. Then only Q's load, from L2, stands between the current
            // tile's last S and the next tile's first (no counter atomic, device-memory Q latency
            // or first K conversion there)
            int w, ahead;
            FwdTile wt;
            auto draw_next = [&]() {
                const int w_drawn = sched_draw(p.sched, drawn);
                ahead = 0;
                w = -1;
                if (w_drawn >= num_work) return;
                // causal / window: the grid's tail longest first
                w = WINDOW ? longest_first_tail(w_drawn, p.num_m_blocks, p.h * p.b, gridDim.x) : w_drawn;
                wt = fwd_work_tile<WINDOW, false, BM, BN>(p, w);
                if (wt.n_tiles == 0) return;              // rows that see no key: nothing to load
#pragma unroll
                for (int c = 0; c < D / F32_PANEL_COLS; ++c)
                    tma_prefetch_l2_4d(&p.tma_q, c * F32_PANEL_COLS, wt.m0, wt.head, wt.batch);
                load_kv(wt, 0);
                ahead = 1;
            };
            draw_next();
            for (int tile_i = 0;; ++tile_i) {
                // the consumers are done with the previous tile's Q (big and small) and index
                if (tile_i > 0) mbar_wait(q_empty, (tile_i - 1) & 1);
                *tile_smem = w;                           // published by the q_raw arrival (release)
                if (w < 0) {                              // no work left: tell everyone, stop
                    mbar_arrive(q_raw);
                    break;
                }
                if (wt.n_tiles == 0) {
                    mbar_arrive(q_raw);
                } else {
                    // Q tile [BM, D]: D / 32 boxes of [BM, 32]
                    mbar_arrive_expect_tx(q_raw, BM * D * 4);
#pragma unroll
                    for (int c = 0; c < D / F32_PANEL_COLS; ++c)
                        tma_load_4d(q_smem + c * L::Q_PANEL, &p.tma_q, q_raw, c * F32_PANEL_COLS,
                                    wt.m0, wt.head, wt.batch);
                    // the tile's other key tiles
                    for (int it = ahead; it < wt.n_tiles; ++it) load_kv(wt, it);
                }
                draw_next();
            }
            if (p.sched) sched_finish(p.sched);   // this block has drawn its last work tile
        } else if (t >= 32) {
            // ---- converters (96 threads): TF32 parts of Q and K, Vᵀ parts, tile by tile
            const int cu = t - 32;
            // Hand a converted tile on: each thread's shared writes fenced for the async proxy,
            // all 96 done (barrier), one arrival on `bar`
            auto release = [&](u32 bar) {
                fence_proxy_async();
                named_bar_sync(CONV_BAR, CONV_THREADS);   // every converter's part is written
                if (cu == 0) mbar_arrive(bar);
            };
            // [rows, D] tile at `big` (raw in, big out, in place) and its small part at `small`:
            // elementwise, so the swizzled layout is kept as it is (16-byte chunks)
            // (two chunks per pass: both loads are in flight before the first store)
            auto split_tile = [&](u32 big, u32 small, int chunks) {
#pragma unroll 1   // (unrolled, the hd 128 window variant's 40-register converters spill 8 B)
                for (int i = cu; i < chunks; i += 2 * CONV_THREADS) {
                    const int j = i + CONV_THREADS;           // the pass's second chunk
                    const bool two = j < chunks;
                    float x[8] = {};
                    u32 b[8], sm[8];
                    lds128(big + 16 * i, x);
                    if (two) lds128(big + 16 * j, x + 4);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        if (SPLIT) split_tf32(x[e], b[e], sm[e]);
                        else b[e] = tf32_rn(x[e]);
                    }
                    sts128(big + 16 * i, b);
                    if (SPLIT) sts128(small + 16 * i, sm);
                    if (two) {
                        sts128(big + 16 * j, b + 4);
                        if (SPLIT) sts128(small + 16 * j, sm + 4);
                    }
                }
            };
            // Vᵀ of stage s: v_raw [D/32][BN][32] (row = key, swizzled) -> vt_big / vt_small
            // [BN/32][D][32] (row = head-dim column d, keys permuted within each 8-key step), item
            // by item (4 keys x 4 columns: hopper/sm90.cuh's TransposeItem)
            auto transpose_v = [&](int s) {
                const u32 src = v_raw + s * L::KVT;
                const u32 dst_b = vt_big + s * L::KVT, dst_s = vt_small + s * L::KVT;
                constexpr int ITEMS = BN * D / 16;
                for (int i = cu; i < ITEMS; i += CONV_THREADS)
                    TransposeItem<BN, D>(i).template move<SPLIT>(src, dst_b, dst_s);
            };
            int kv_it = 0;
            for (int tile_i = 0;; ++tile_i) {
                mbar_wait(q_raw, tile_i & 1);                 // Q landed, tile index published
                // each converter reads the index and releases it itself (q_empty: the producer
                // waits for the consumers' arrivals too, which come after this tile's Q
                // conversion); once per work tile, and fewer registers than a warp broadcast
                const int w = *tile_smem;
                mbar_arrive(q_empty);
                named_bar_sync(CONV_BAR, CONV_THREADS);       // the converters start the tile together
                if (w < 0) {                                  // no work left: tell the consumers
                    if (!QREG && cu == 0) mbar_arrive(q_full);
                    break;
                }
                const FwdTile wt = fwd_work_tile<WINDOW, false, BM, BN>(p, w);
                if (wt.n_tiles == 0) {                        // nothing loaded: pass the index on
                    if (!QREG && cu == 0) mbar_arrive(q_full);
                    continue;
                }
                if constexpr (!QREG) {
                    split_tile(q_smem, q_small, BM * D / 4);
                    release(q_full);
                }
                // the tile's ring positions, bounded by kv_end (with a second counter it = 0 ..
                // n_tiles, the hd 128 window variant's 40-register converters spilled 8 B)
                for (const int kv_end = kv_it + wt.n_tiles; kv_it < kv_end; ++kv_it) {
                    const int s = kv_it % STAGES;
                    const u32 ph = (kv_it / STAGES) & 1;
                    mbar_wait(k_raw + 8 * s, ph);             // K landed (k_small[s] is free:
                                                              // the TMA thread saw k_empty)
                    split_tile(k_big + s * L::KVT, k_small + s * L::KVT, BN * D / 4);
                    release(k_full + 8 * s);
                    mbar_wait(v_rawb + 8 * s, ph);            // V landed
                    if (kv_it >= STAGES) mbar_wait(v_empty + 8 * s, ph ^ 1);   // Vᵀ[s] is free
                    transpose_v(s);
                    release(v_full + 8 * s);                  // (also: every converter has read
                    if (cu == 0) mbar_arrive(vraw_empty + 8 * s);   // v_raw[s]: TMA may refill it)
                }
            }
        }
        return;
    }

    // ================================ consumers ================================
    if constexpr (NC > 1) regs_acquire<sm90f32::Regs<NC, WIDE_REGS>::CONSUMER>();
    const int cw = wg - 1;                                 // consumer 0 .. NC-1: rows 64·cw .. of a tile
    const int next_turn = TURN_BAR + (cw + 1) % NC;        // the consumer whose turn follows ours
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (t % 4);                      // accumulator columns col_in_8, +1 (of 8)
    const float sl2 = p.scale_log2;                        // score -> base-2 exponent factor

    int kv_it = 0;             // K/V ring position of the current key tile (runs on across tiles)
    int tile_i = 0;            // work tiles taken so far (the Q barriers' phase)
    FwdTile wt;               // the current work tile
    float o_acc[NO];           // O [64, D] of this warpgroup, fp32
    float pv_acc[O_RN ? NPV : 1];  // O_RN: P V [64, D / PV_PARTS] of the current key tile, fp32
    float m_run[2] = {-CF_INF, -CF_INF};   // running row max (raw scores)
    float l_run[2] = {0.f, 0.f};           // running denominators (this lane's columns only)
    float alpha[2];            // O rescale factors of the current key tile
    float s_acc[NS];           // S [64, BN] of the current key tile, then P in place
    u32 p_big[NS];             // P of the current key tile, TF32 A fragments (big part)
    u32 p_small[SPLIT ? NS : 1];   // and small part
    u32 qs_frag[QREG && SPLIT ? D / 2 : 1];   // QREG: small part of this warpgroup's Q rows, TF32
                                              // A fragments (4 per 8-column k-step)

    // QREG: split this warpgroup's 64 rows of the landed Q tile: big written back in place (the
    // shared operand of q_big·k_big, q_big·k_small), small kept in qs_frag. Per k-step kk the A
    // fragment is Q(r, 8kk + c), Q(r + 8, 8kk + c), Q(r, 8kk + c + 4), Q(r + 8, 8kk + c + 4)
    // (r = row_in_wg, c = t % 4); in the swizzled panel, column x of row y sits at
    // (x / 32)·Q_PANEL + y·128 + 16·((x % 32 / 4) XOR y % 8) + 4·(x % 4): 8 rows x 4 columns of a
    // warp hit 32 distinct banks.
    auto split_q = [&]() {
        const u32 q_wg = q_smem + cw * WG_ROWS * 128;
#pragma unroll
        for (int kk = 0; kk < D / 8; kk += 2) {   // two k-steps at a time: 8 loads in flight
            u32 a[8];
            float q[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int r = row_in_wg + 8 * (e % 2), x = 8 * (kk + e / 4) + t % 4 + 4 * ((e / 2) % 2);
                a[e] = q_wg + (x / 32) * L::Q_PANEL + r * 128 + 16 * (((x % 32) / 4) ^ (r % 8)) + 4 * (x % 4);
                asm volatile("ld.shared.f32 %0, [%1];" : "=f"(q[e]) : "r"(a[e]) : "memory");
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                u32 big;
                if constexpr (SPLIT) split_tf32(q[e], big, qs_frag[4 * kk + e]);
                else big = tf32_rn(q[e]);
                asm volatile("st.shared.b32 [%0], %1;" :: "r"(a[e]), "r"(big) : "memory");
            }
        }
        fence_proxy_async();                   // the big part is read by wgmma (async proxy)
        named_bar_sync(WG_BAR + cw, 128);      // every warp of the warpgroup has written its rows
    };

    // Wait for work tile tile_i (index published, Q split). Tiles whose rows see no key are
    // finished right here (out = 0, lse = -inf). False when no work is left.
    auto fetch_tile = [&]() -> bool {
        for (;; ++tile_i) {
            mbar_wait(QREG ? q_raw : q_full, tile_i & 1);
            const int w = *tile_smem;   // released by this thread's own arrival on q_empty
            if (w < 0) return false;
            wt = fwd_work_tile<WINDOW, false, BM, BN>(p, w);
            if (wt.n_tiles > 0) {
                if constexpr (QREG) split_q();
                return true;
            }
            store_empty_rows<E, D, false>(p, wt, wt.m0 + cw * WG_ROWS, t);
            mbar_arrive(q_empty);
        }
    };
    auto key0 = [&](int it) { return (wt.t_first + wt.n_tiles - 1 - it) * BN; };   // right to left

    // ---- S = Q Kᵀ  [64, BN], fp32, of the key tile in ring position kv: k-steps of 8 columns
    //      (32 bytes) through the D / 32 panels; per k-step q_small·k_big + q_big·k_small +
    //      q_big·k_big (QREG: q_big·k_big first, q_small from registers) (issued and committed)
    auto issue_s = [&](int kv) {
        const int s = kv % STAGES;
        const u32 qb = q_smem + cw * WG_ROWS * 128;        // this warpgroup's 64 rows of each Q panel
        const u32 qs = q_small + cw * WG_ROWS * 128;
        const u32 kb = k_big + s * L::KVT, ks = k_small + s * L::KVT;
        mbar_wait(k_full + 8 * s, (kv / STAGES) & 1);
        wgmma_fence();   // a pipeline stage of its own: O's product may be waited for alone
#pragma unroll
        for (int kk = 0; kk < D / 8; ++kk) {
            const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
            const u32 k_off = (kk / 4) * L::KV_PANEL + (kk % 4) * 32;
            if constexpr (QREG) {
                wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                  smem_desc(kb + k_off, 16, 1024), kk > 0);
                if constexpr (SPLIT) {
                    wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                      smem_desc(ks + k_off, 16, 1024), 1);
                    wgmma_rs_tf32<BN>(s_acc, qs_frag + 4 * kk, smem_desc(kb + k_off, 16, 1024));
                }
            } else {
                if constexpr (SPLIT) {
                    wgmma_ss_tf32<BN>(s_acc, smem_desc(qs + q_off, 16, 1024),
                                      smem_desc(kb + k_off, 16, 1024), kk > 0);
                    wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                      smem_desc(ks + k_off, 16, 1024), 1);
                }
                wgmma_ss_tf32<BN>(s_acc, smem_desc(qb + q_off, 16, 1024),
                                  smem_desc(kb + k_off, 16, 1024), SPLIT || kk > 0);
            }
        }
        wgmma_commit();
    };
    // ---- O += P V  [64, D] of the key tile in ring position kv (columns of part `part`: D /
    //      PV_PARTS of them): B = Vᵀ [D, BN] K-major, 8 keys (32 bytes) per k-step through the
    //      BN / 32 panels; per k-step p_small·vt_big + p_big·vt_small + p_big·vt_big
    auto issue_pv = [&](int kv, int part) {
        constexpr int N = D / PV_PARTS;                   // output columns of one part
        const int s = kv % STAGES;
        const u32 rows = part * N * 128;                  // the part's Vᵀ rows (1024-aligned)
        const u32 vb = vt_big + s * L::KVT + rows, vs = vt_small + s * L::KVT + rows;
        if (part == 0) mbar_wait(v_full + 8 * s, (kv / STAGES) & 1);
        float* acc = O_RN ? pv_acc : o_acc;               // O_RN: a fresh P V, added by add_pv
        if constexpr (O_RN) {
#pragma unroll
            for (int i = 0; i < NPV; ++i) pv_acc[i] = 0.f;
        }
        fence_regs<O_RN ? NPV : NO>(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 8; ++kk) {
            const u32 off = (kk / 4) * L::VT_PANEL + (kk % 4) * 32;
            if constexpr (SPLIT) {
                wgmma_rs_tf32<N>(acc, p_small + 4 * kk, smem_desc(vb + off, 16, 1024));
                wgmma_rs_tf32<N>(acc, p_big + 4 * kk, smem_desc(vs + off, 16, 1024));
            }
            wgmma_rs_tf32<N>(acc, p_big + 4 * kk, smem_desc(vb + off, 16, 1024));
        }
        wgmma_commit();
    };
    // O_RN: the completed P V of part `part` added to O's columns of that part in fp32
    auto add_pv = [&](int part) {
        if constexpr (O_RN) {
            fence_regs<NPV>(pv_acc);
#pragma unroll
            for (int i = 0; i < NPV; ++i) o_acc[part * NPV + i] += pv_acc[i];   // rounded to nearest
        }
    };
    // S of ring position kv has completed: release its K stage, and, when it was the work tile's
    // last S, the Q tile and the tile index (every consumer thread arrives after its own reads:
    // the producer overwrites them once q_empty completes; once per work tile, and a warp
    // broadcast of the index cost the hd 128 variant 4 bytes of spill)
    auto s_done = [&](int kv, bool last_s) {
        fence_regs<NS>(s_acc);
        if constexpr (QREG && SPLIT) fence_regs<D / 2>(qs_frag);   // read by S until here
        if (t == 0) mbar_arrive(k_empty + 8 * (kv % STAGES));
        if (last_s) mbar_arrive(q_empty);
    };
    // O += P V of ring position kv, part 0 issued (the last wgmma group): with PV_PARTS = 2 wait
    // for it, add it and issue part 1 (the same P, the next D / 2 rows of Vᵀ) into the same
    // accumulator. (Issuing part 0 before the next S, so that part 1 follows it while S runs,
    // timed 0-5 % slower at hd 128 on the H200)
    auto pv_next = [&](int kv) {
#pragma unroll
        for (int part = 1; part < PV_PARTS; ++part) {
            wgmma_wait<0>();
            add_pv(part - 1);
            issue_pv(kv, part);
        }
    };
    // The last part of O += P V of ring position kv: wait for it, add it, release the Vᵀ stage
    auto pv_done = [&](int kv) {
        wgmma_wait<0>();
        fence_regs<NO>(o_acc);
        add_pv(PV_PARTS - 1);
        fence_regs<NS>(p_big);           // P stayed untouched while the product read it
        if constexpr (SPLIT) fence_regs<NS>(p_small);
        if (t == 0) mbar_arrive(v_empty + 8 * (kv % STAGES));
    };

    // Online softmax on the scores of one key tile (keys n0 ..), in place in s_acc: masks,
    // running max m, P = exp2(s·scale·log2e − shift), denominator l, and the factors alpha that
    // rescale O (applied by pack_p, once the previous O += P V has completed): hopper/fwd.cu's
    auto softmax_scores = [&](int n0) {
        online_softmax<NS, BN, WINDOW>(s_acc, m_run, l_run, alpha, p, wt, n0,
                                       wt.m0 + cw * WG_ROWS + row_in_wg, col_in_8, sl2);
    };
    // O rescale by alpha, and P split into the TF32 A fragments of the next O += P V (the
    // previous product, which read O and the old P, has completed). Accumulator registers
    // 4kk .. 4kk + 3 of key step kk hold P(r, 2c), P(r, 2c + 1), P(r + 8, 2c), P(r + 8, 2c + 1);
    // fragment slots c and c + 4 of the step are keys 2c and 2c + 1 (Vᵀ is stored to match), so
    // a = {P(r, 2c), P(r + 8, 2c), P(r, 2c + 1), P(r + 8, 2c + 1)}.
    auto pack_p = [&]() {
        rescale_o<NO>(o_acc, alpha);
#pragma unroll
        for (int kk = 0; kk < BN / 8; ++kk) {
            const float a[4] = {s_acc[4 * kk], s_acc[4 * kk + 2], s_acc[4 * kk + 1], s_acc[4 * kk + 3]};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (SPLIT) split_tf32(a[e], p_big[4 * kk + e], p_small[4 * kk + e]);
                else p_big[4 * kk + e] = tf32_rn(a[e]);
            }
        }
    };
    // The first key tile of work tile wt, whose S has completed: fresh O, m, l, then its softmax
    auto start_tile = [&]() {
        reset_rows<NO>(o_acc, m_run, l_run);
        softmax_scores(key0(0));
        pack_p();
    };
    // ---- final O / l and lse of work tile wt (rows past s_q are not stored): float32 out
    auto store_tile = [&]() {
        store_rows<E, NO, false>(p, wt, o_acc, m_run, l_run, sl2, wt.m0 + cw * WG_ROWS + row_in_wg,
                                 col_in_8, t % 4 == 0);
    };
    // Turn-taking on the tensor cores (NC = 2: named barrier TURN_BAR + c is consumer c's turn;
    // one consumer alone needs none)
    auto turn_begin = [&]() { if constexpr (NC > 1) named_bar_sync(TURN_BAR + cw, 256); };
    auto turn_end = [&]() { if constexpr (NC > 1) named_bar_arrive(next_turn, 256); };
    // A turn with the S of the current tile's first key tile alone (no O += P V in flight)
    auto first_turn = [&]() {
        turn_begin();
        issue_s(kv_it);
        turn_end();
        wgmma_wait<0>();
        s_done(kv_it, wt.n_tiles == 1);
        start_tile();
    };
    // A turn with the last O += P V of the current tile alone
    auto last_turn = [&]() {
        turn_begin();
        issue_pv(kv_it, 0);
        turn_end();
        pv_next(kv_it);
        pv_done(kv_it);
        ++kv_it;
    };

    // Pingpong (NC = 2), as hopper/fwd.cu: consumer 0 takes the very first turn (its own arrival
    // here plus its first sync complete barrier TURN_BAR); every consumer walks the same work
    // tiles and takes the same n_tiles + 1 turns per tile, so the order holds across tiles.
    if constexpr (NC > 1) {
        if (cw == 0) named_bar_arrive(TURN_BAR, 256);
    }

    if (fetch_tile()) {
        first_turn();
        for (;;) {
            // ---- every key tile but the last: in our turn S of key tile it + 1, then O += P V
            //      of key tile it; the softmax of S(it + 1) runs while O += P V is on the tensor
            //      cores (unconditional waits, the last O += P V peeled off: hopper/fwd.cu)
            const int last = wt.n_tiles - 1;
            for (int it = 0; it < last; ++it, ++kv_it) {
                turn_begin();
                issue_s(kv_it + 1);
                issue_pv(kv_it, 0);
                turn_end();
                wgmma_wait<1>();                         // S done (O += P V may still run)
                s_done(kv_it + 1, it + 1 == last);
                pv_next(kv_it);                          // PV_PARTS = 2: part 1 issued
                softmax_scores(key0(it + 1));            // (under the last part)
                pv_done(kv_it);                          // O += P V done (every part)
                pack_p();
            }
            // ---- the tile's last key tile, the epilogue, then the next tile
            last_turn();
            store_tile();
            ++tile_i;
            if (!fetch_tile()) break;
            first_turn();
        }
    }
}
