// cupyflash: the 16-bit Hopper forward's consumer warpgroups, the mainloop's MMA role
// (fwd_consumer): per key tile S = Q Kᵀ and O += P V on wgmma, score transforms (softcap, bias),
// online softmax in registers (hopper/softmax.cuh), the tensor-core turns (pingpong), and each
// work tile's epilogue (final O / l and lse: hopper/epilogue.cuh; SPLIT: merge_pieces).
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/epilogue.cuh"
#include "hopper/fwd_layout.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/softmax.cuh"
#include "hopper/wgmma.cuh"

namespace sm90 {

// One consumer warpgroup of flash_fwd_sm90 (its template arguments), wg = 1 .. NC, thread t of
// its 128: 64 query rows of each work tile the producer hands on, until none is left. Its
// registers hold O, S / P and the rows' running max m and denominator l. (Its pieces are lambdas
// over that state: as functions, inlined earlier, the same code compiled to other SASS.)
template <typename E, int D, int BN, int STAGES, int NC, bool WINDOW, bool SOFTCAP, bool VARLEN, int BIAS,
          bool SPLIT, bool MAXFREE>
__device__ __forceinline__ void fwd_consumer(const Params& p, const FwdSmem<D, BN, STAGES, NC, VARLEN>& sm,
                                             int wg, int t) {
    using L = Layout<D, BN, STAGES, NC, VARLEN>;
    constexpr int BM = L::BM;
    typedef typename Elem<E>::storage S;
    constexpr int NS = BN / 2;       // S accumulator registers per lane: [64, BN] over 128 lanes
    constexpr int NO = D / 2;        // O accumulator registers per lane: [64, D]
    constexpr bool KSPLIT = L::PANELS >= 2;   // K in two halves (FwdSmem::k_full2)
    // Whether a work tile can have rows that see no key: with a causal / window band, or a packed
    // sequence without keys. A dense call without a band has s_k > 0 (the launcher answers s_k = 0
    // itself, _gpu._empty), so every tile sees keys; that path is then compiled out (code in the
    // consumers' tile-to-tile path cost time even untaken: docs/hopper.md, "Dead paths compiled out").
    constexpr bool SOME_EMPTY = WINDOW || VARLEN;
    // Whether a work tile's rows see any key (so that it has key tiles to load and run)
    auto sees_keys = [](const FwdTile& wt) { return !SOME_EMPTY || wt.n_tiles > 0; };
    // Whether the softmax of key tile j + 1 runs beside this consumer's own O += P V of tile j.
    // Written so in the source, but ptxas put the wait for P V (WARPGROUP.DEPBAR) before the
    // softmax's first exp2 in every variant (it is free to hoist a wait within a basic block;
    // there it interleaved O's rescale with the exp2s); a basic block ending between them keeps
    // the order (tests/test_sass_sm90.py). On the H200 that gained up to 2.6 % at hd 128 (most
    // with 176-key tiles) and lost 1.6-5.5 % at hd 64, whose consumers are bound by instruction
    // issue, and 2-9 % at hd 256 (docs/hopper.md, "The softmax beside its own P·V"): hd 128 only.
    constexpr bool SOFTMAX_BESIDE_PV = D == 128;
    // MAXFREE: inside the key-tile loop, P = exp2(s·sl2 − shift) against the running max m of
    // the tiles before, without the tile's own row max (its FMNMX and quad shuffles) and without
    // O's rescale, as long as every lane's row sums of the tile stay at most MAXFREE_T (so every
    // P <= MAXFREE_T: finite, and in range for float16); a warp where some row rose further
    // takes the exact online softmax on S, kept intact for that (online_softmax, O rescaled).
    // softmax(s) is the same for any shift, so only rounding differs. Key tiles after a work
    // tile's first need no masks (no band; the ragged end is the first key tile, right to left);
    // P of the next key tile needs its own registers beside the P that O += P V still reads
    // (0 spills at hd 128 × 128 keys; the planner's SM90_MAXFREE_MIN_KEYS says where it runs).
    constexpr float MAXFREE_T = 256.f;
    const u32 smem = sm.smem, q_smem = sm.q_smem, k_smem = sm.k_smem, v_smem = sm.v_smem;
    const u32 q_full = sm.q_full, q_empty = sm.q_empty, k_full = sm.k_full, v_full = sm.v_full;
    const u32 k_empty = sm.k_empty, v_empty = sm.v_empty, k_full2 = sm.k_full2;
    volatile int* tile_smem = sm.tile_smem;
    // consumer 0 .. NC-1: rows 64·cw .. of a tile (broadcast from lane 0, so that the compiler
    // knows it is warp-uniform and keeps what derives from it, such as the Q descriptor, in
    // uniform registers)
    const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
    const int next_turn = TURN_BAR + (cw + 1) % NC;        // the consumer whose turn follows ours
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (t % 4);                      // accumulator columns col_in_8, +1 (of 8)
    // score -> base-2 exponent factor (softcap and bias variants keep scores in base-2 units)
    const float sl2 = SOFTCAP || BIAS ? 1.f : p.scale_log2;

    int kv_it = 0;             // K/V ring position of the current key tile (runs on across tiles)
    int tile_i = 0;            // work tiles taken so far (the Q barriers' phase)
    FwdTile wt;               // the current work tile
    float o_acc[NO];           // O [64, D] of this warpgroup, fp32
    float m_run[2] = {-CF_INF, -CF_INF};   // running row max (raw scores; base-2: softcap, bias)
    float l_run[2] = {0.f, 0.f};           // running denominators (this lane's columns only)
    float alpha[2];            // O rescale factors of the current key tile
    float s_acc[NS];           // S [64, BN] of the current key tile, then P in place
    u32 p_frag[NS / 2];        // P of the current key tile, 16-bit A fragments
    // MAXFREE: a second P buffer. The softmax of key tile j + 1 writes its P while O += P V of
    // tile j still reads the other, so the loop alternates between the two (unrolled by two: a
    // copy from one to the other let ptxas coalesce them, and then serialize every wgmma, C7513)
    u32 p_frag2[MAXFREE ? NS / 2 : 1];
    // A 16-bit bias without causal / window band or softcap (whose extra registers would then
    // spill): the next key tile's bias pairs of this lane's S columns (j, j + 1), loaded while
    // S runs. Measured on the H200 (bias (1, 16, s, s) bf16 hd 128): +5-9% over the L2 prefetch.
    constexpr bool BIAS_REGS = BIAS == 1 && !WINDOW && !SOFTCAP;
    u32 bias_frag[BIAS_REGS ? NS / 2 : 1];

    // Wait for work tile tile_i (index published, Q tile landed). Tiles whose rows see no key
    // are finished right here (out = 0, lse = -inf). False when no work is left.
    auto fetch_tile = [&]() -> bool {
        for (;; ++tile_i) {
            mbar_wait(q_full, tile_i & 1);
            // lane 0 reads the index for its warp, and is the lane that releases it (q_empty): the
            // read and the release in one thread's program order, which racecheck can follow
            const int w = __shfl_sync(0xffffffffu, t % 32 == 0 ? *tile_smem : 0, 0);
            if (w < 0) return false;
            wt = fwd_work_tile<WINDOW, VARLEN, BM, BN, BIAS != 0, SPLIT, true>(p, w);
            if (sees_keys(wt)) return true;
            store_empty_rows<E, D, VARLEN>(p, wt, wt.m0 + cw * WG_ROWS, t);
            if (t % 32 == 0) mbar_arrive(q_empty);   // the lane that read the index
        }
    };
    auto key0 = [&](int it) { return (wt.t_first + wt.n_tiles - 1 - it) * BN; };   // right to left

    // wgmma descriptors (K-major Q and K tiles, MN-major V) of this warpgroup's 64 rows of Q and of
    // ring stage 0; every product's descriptor is one of these plus a byte offset (desc_add)
    const u64 q_desc = smem_desc(q_smem + cw * WG_ROWS * 128, 16, 1024);   // q_smem [PANELS][BM][64]
    const u64 k_desc = smem_desc(k_smem, 16, 1024);                        // k_smem [STAGES][PANELS][BN][64]
    const u64 v_desc = smem_desc(v_smem, L::KV_PANEL, 1024);               // v_smem [STAGES][PANELS][BN][64]
    // ---- S = Q Kᵀ  [64, BN], fp32, of the key tile in ring position kv: k-steps of 16 columns
    //      through the D / 64 panels (issued and committed)
    auto issue_s = [&](int kv) {
        const int s = kv % STAGES;
        const u64 k_tile = desc_add(k_desc, s * L::KV_TILE);
        mbar_wait(k_full + 8 * s, (kv / STAGES) & 1);
        wgmma_fence();   // a pipeline stage of its own: O's product may be waited for alone
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            if (KSPLIT && kk == D / 32) mbar_wait(k_full2 + 8 * s, (kv / STAGES) & 1);   // K's second half
            const u32 off = (kk % 4) * 32;    // 16 columns = 32 bytes within a 128-byte panel row
            wgmma_ss<E, BN>(s_acc, desc_add(q_desc, (kk / 4) * L::Q_PANEL + off),
                            desc_add(k_tile, (kk / 4) * L::KV_PANEL + off), kk > 0);
        }
        wgmma_commit();
    };
    // ---- O += P V  [64, D] of the key tile in ring position kv: V read MN-major (LBO = bytes
    //      between 64-column panels), 16 keys = 16 rows of 128 bytes per k-step
    auto issue_pv = [&](int kv, const u32* pf) {
        const u64 v_tile = desc_add(v_desc, (kv % STAGES) * L::KV_TILE);
        mbar_wait(v_full + 8 * (kv % STAGES), (kv / STAGES) & 1);
        fence_regs<NO>(o_acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_rs<E, D>(o_acc, pf + 4 * kk, desc_add(v_tile, kk * 2048));
        wgmma_commit();
    };
    // S of ring position kv has completed: release its K stage, and, when it was the work tile's
    // last S, the Q tile and the tile index (one arrival per warp, by the lane that read the
    // index: the producer overwrites it once q_empty completes)
    auto s_done = [&](int kv, bool last_s) {
        fence_regs<NS>(s_acc);
        if (t == 0) mbar_arrive(k_empty + 8 * (kv % STAGES));
        if (last_s && t % 32 == 0) mbar_arrive(q_empty);
    };
    // O += P V of ring position kv has completed: release its V stage
    auto pv_done = [&](int kv, u32* pf) {
        fence_regs<NO>(o_acc);
        fence_regs<NS / 2>(pf);          // P stayed untouched while the product read it
        if (t == 0) mbar_arrive(v_empty + 8 * (kv % STAGES));
    };

    // Bias row r (clamped to the sequence) of the work tile's (batch, head): [s_k] elements, unit
    // key stride (broadcast dimensions have stride 0)
    auto bias_row = [&](int r) -> const char* {
        const i64 e = (i64)wt.batch * p.bias_stride_b + (i64)wt.head * p.bias_stride_h +
                      (i64)min(r, wt.s_q - 1) * p.bias_stride_q;
        return (const char*)p.bias + e * (BIAS == 2 ? 4 : 2);
    };
    // The bias of this lane's rows over key tile n0, fetched while S = Q Kᵀ runs: BIAS_REGS loads
    // its S columns' pairs into bias_frag (0 past s_k); otherwise (float32 bias: twice the
    // registers) the rows go into L2 (each lane of the row's quad takes every fourth 128-byte
    // line) and softmax_scores loads them
    auto fetch_bias = [&](int n0) {
        constexpr int LINE = 128 / (BIAS == 2 ? 4 : 2);   // bias elements per 128-byte line
        const int row0 = wt.m0 + cw * WG_ROWS + row_in_wg;
        const char* rows[2] = {bias_row(row0), bias_row(row0 + 8)};
        if constexpr (BIAS_REGS) {
#pragma unroll
            for (int i = 0; i < NS; i += 2) {
                const int j = n0 + (i / 4) * 8 + col_in_8;
                bias_frag[i / 2] = j < wt.s_k ? *(const u32*)(rows[(i % 4) / 2] + (i64)j * 2) : 0u;
            }
            return;
        }
#pragma unroll
        for (int c = (t % 4) * LINE; c < BN; c += 4 * LINE) {
            if (n0 + c < wt.s_k) {
                asm volatile("prefetch.global.L2 [%0];" :: "l"(rows[0] + (i64)(n0 + c) * (BIAS == 2 ? 4 : 2)));
                asm volatile("prefetch.global.L2 [%0];" :: "l"(rows[1] + (i64)(n0 + c) * (BIAS == 2 ? 4 : 2)));
            }
        }
    };

    // Online softmax on the scores of one key tile (keys n0 ..), in place in s_acc: softcap,
    // masks, running max m, P = exp2(s·scale·log2e − shift), denominator l, and the factors
    // alpha that rescale O (applied by pack_p, once the previous O += P V has completed).
    auto softmax_scores = [&](int n0, bool first) {
        const int row0 = wt.m0 + cw * WG_ROWS + row_in_wg;   // this lane's rows: row0, row0 + 8
        // ---- softcap: s = c·tanh(scale·qk / c), kept in base-2 units (sl2 = 1)
        if (SOFTCAP) {
#pragma unroll
            for (int i = 0; i < NS; ++i) s_acc[i] = p.softcap_post * tanh_fast(s_acc[i] * p.softcap_pre);
        }
        // ---- s += bias, base-2 units: (scale·qk or the softcapped score)·log2 e + bias·log2 e
        //      (columns j, j + 1 in one load: s_k is even, pairs aligned)
        if constexpr (BIAS != 0) {
            const char* rows[2] = {bias_row(row0), bias_row(row0 + 8)};
#pragma unroll
            for (int i = 0; i < NS; i += 2) {
                const int j = n0 + (i / 4) * 8 + col_in_8;
                float b0 = 0.f, b1 = 0.f;
                if constexpr (BIAS_REGS) {          // fetched by fetch_bias (0: bits of +0.0)
                    b0 = to_float<E>((S)(bias_frag[i / 2] & 0xffffu));
                    b1 = to_float<E>((S)(bias_frag[i / 2] >> 16));
                } else if (j < wt.s_k) {
                    if constexpr (BIAS == 1) {
                        const u32 pair = *(const u32*)(rows[(i % 4) / 2] + (i64)j * 2);
                        b0 = to_float<E>((S)(pair & 0xffffu));
                        b1 = to_float<E>((S)(pair >> 16));
                    } else {
                        const float2 bv = *(const float2*)(rows[(i % 4) / 2] + (i64)j * 4);
                        b0 = bv.x;
                        b1 = bv.y;
                    }
                }
                const float q0 = SOFTCAP ? s_acc[i] : s_acc[i] * p.scale_log2;
                const float q1 = SOFTCAP ? s_acc[i + 1] : s_acc[i + 1] * p.scale_log2;
                s_acc[i] = q0 + b0 * CF_LOG2E;
                s_acc[i + 1] = q1 + b1 * CF_LOG2E;
            }
        }
        // ---- masks, running max m, P = exp2(s·sl2 − shift), denominator l, alpha
        // (first: a literal at each call, so each inlined copy holds one of the two; not with
        // softcap and bias together, whose registers then spill)
        if (first && !(SOFTCAP && BIAS != 0))
            online_softmax<NS, BN, WINDOW, true>(s_acc, m_run, l_run, alpha, p, wt, n0, row0, col_in_8, sl2);
        else
            online_softmax<NS, BN, WINDOW, false>(s_acc, m_run, l_run, alpha, p, wt, n0, row0, col_in_8, sl2);
    };
    // O rescale by alpha and P packed to the 16-bit A fragments of the next O += P V (the
    // previous product, which read O and the old P, has completed)
    auto pack_p = [&]() {
        rescale_o<NO>(o_acc, alpha);
#pragma unroll
        for (int i = 0; i < NS; i += 2) p_frag[i / 2] = pack2<E>(s_acc[i], s_acc[i + 1]);
    };
    // MAXFREE: the softmax of key tile n0 inside the loop into pf, without the tile's row max
    // (P = exp2(s·sl2 − shift of the running max), l += the tile's sums, O not rescaled) where
    // every lane's row sums lt of the warp stay at most MAXFREE_T; otherwise (some lt above it,
    // always so when a score rose more than log2 MAXFREE_T above m; P overflowed; or NaN) the
    // exact online softmax of the intact S. Returns whether O must be rescaled by alpha
    // (warp-uniform).
    auto softmax_maxfree = [&](int n0, u32* pf) -> bool {
        const int row0 = wt.m0 + cw * WG_ROWS + row_in_wg;
        float shift[2], lt[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) shift[r] = m_run[r] == -CF_INF ? 0.f : m_run[r] * sl2;
#pragma unroll
        for (int i = 0; i < NS; i += 4) {       // P = exp2(s·sl2 − shift), row sums lt
            const float p0 = fast_exp2(s_acc[i] * sl2 - shift[0]);       // row row0
            const float p1 = fast_exp2(s_acc[i + 1] * sl2 - shift[0]);
            const float p2 = fast_exp2(s_acc[i + 2] * sl2 - shift[1]);   // row row0 + 8
            const float p3 = fast_exp2(s_acc[i + 3] * sl2 - shift[1]);
            lt[0] += p0 + p1;
            lt[1] += p2 + p3;
            pf[i / 2] = pack2<E>(p0, p1);
            pf[i / 2 + 1] = pack2<E>(p2, p3);
        }
        if (__all_sync(0xffffffffu, lt[0] <= MAXFREE_T && lt[1] <= MAXFREE_T)) {
            l_run[0] += lt[0];
            l_run[1] += lt[1];
            return false;
        }
        // ---- some row of the warp rose: running max m, alpha, P and l of the tile, exactly
        // (no masks: MAXFREE runs no band, and only a work tile's first key tile has the ragged end)
        online_softmax<NS, BN, false, false, false>(s_acc, m_run, l_run, alpha, p, wt, n0, row0,
                                                    col_in_8, sl2);
#pragma unroll
        for (int i = 0; i < NS; i += 2) pf[i / 2] = pack2<E>(s_acc[i], s_acc[i + 1]);
        return true;
    };
    // The first key tile of work tile wt, whose S has completed: fresh O, m, l, then its softmax
    auto start_tile = [&]() {
        reset_rows<NO>(o_acc, m_run, l_run);
        softmax_scores(key0(0), true);   // no product in flight
        pack_p();
    };
    // ---- final O / l and lse of work tile wt (rows past s_q are not stored). O_SMEM: O / l goes
    //      to this consumer's o_smem and one TMA store takes it to out, so that no global store
    //      holds up the next tile (the direct stores took ~2000 SM cycles per tile at hd 128 even
    //      as 16-byte stores, 0.7 key-tile steps; benchmarks/fwd_trace.py on the H200). The host
    //      sends an out whose base is not 16-byte aligned (no tensor map) to the portable kernel,
    //      so these variants carry no second epilogue (code never run that cost time at each
    //      tile boundary: docs/hopper.md, "Dead paths compiled out")
    auto store_tile = [&]() {
        const int row0 = wt.m0 + cw * WG_ROWS + row_in_wg;
        if constexpr (L::O_SMEM) {
            float inv_l[2];
            finish_rows<VARLEN>(p, wt, m_run, l_run, sl2, row0, t % 4 == 0, inv_l);
            const u32 o_wg = smem + L::O + cw * L::O_WG;   // [PANELS][64][64] (free: last_turn)
            stage_rows<E, NO>(o_wg, o_acc, inv_l, t / 32, t % 32);
            fence_proxy_async();                  // the rows visible to the TMA unit,
            named_bar_sync(WG_BAR + cw, 128);     // ... all four warps' rows staged
            if (t == 0) {
#pragma unroll
                for (int c = 0; c < L::PANELS; ++c)
                    tma_store_4d(&p.tma_o, o_wg + c * L::O_PANEL, c * PANEL_COLS,
                                 wt.q_row + wt.m0 + cw * WG_ROWS, wt.head, wt.tma_b);
                bulk_commit();
            }
        } else {
            store_rows<E, NO, VARLEN>(p, wt, o_acc, m_run, l_run, sl2, row0, col_in_8, t % 4 == 0);
        }
    };
    // ---- SPLIT, a piece of a split work tile: its partial O, m, l (this lane's registers) go to
    //      its workspace slot split_ws [piece][cw][D / 8 + 1][128 lanes] (float4s, coalesced);
    //      the tile's last piece to finish reads the others' and merges them into its own
    //      (m = max of the pieces' m, O and l of each piece rescaled by exp2((m_piece − m)·sl2)),
    //      then returns true: it stores the tile (store_tile). The others return false.
    auto merge_pieces = [&]() -> bool {
        constexpr int CH = NO / 4 + 1;          // float4s per lane: O [NO], then (m0, m1, l0, l1)
        auto slot = [&](int u) { return (float4*)p.split_ws + (i64)(u * NC + cw) * CH * 128 + t; };
        float4* mine = slot(wt.piece);
#pragma unroll
        for (int c = 0; c < NO / 4; ++c)
            mine[c * 128] = make_float4(o_acc[4 * c], o_acc[4 * c + 1], o_acc[4 * c + 2], o_acc[4 * c + 3]);
        mine[(CH - 1) * 128] = make_float4(m_run[0], m_run[1], l_run[0], l_run[1]);
        __threadfence();                        // this lane's partial visible on the GPU, and
        named_bar_sync(WG_BAR + cw, 128);       // ... every lane's, before the piece is counted
        unsigned int* count = p.split_count + wt.tail * NC + cw;   // pieces of the tile done
        bool last = named_bar_or(WG_BAR + cw, 128, t == 0 && atomicAdd(count, 1u) == wt.parts - 1u);
        // (so that the compiler knows it is warp-uniform: without this, ptxas guarded the
        // epilogue's shuffles and the row reductions against divergence, BRA.DIV)
        last = __reduce_max_sync(0xffffffffu, last);
        if (!last) return false;
        if (t == 0) *count = 0;                 // every piece has counted: zero for the next launch
        __threadfence();                        // the other pieces' partials, counted before ours
        for (int u = wt.piece0; u < wt.piece0 + wt.parts; ++u) {
            if (u == wt.piece) continue;
            const float4* other = slot(u);
            const float4 ml = __ldcg(other + (CH - 1) * 128);   // L2: written by other SMs
            const float m_o[2] = {ml.x, ml.y}, l_o[2] = {ml.z, ml.w};
            float f_me[2], f_o[2];              // rescale factors of our partial and of u's
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float m = fmaxf(m_run[r], m_o[r]);
                f_me[r] = m_run[r] == -CF_INF ? 0.f : fast_exp2((m_run[r] - m) * sl2);
                f_o[r] = m_o[r] == -CF_INF ? 0.f : fast_exp2((m_o[r] - m) * sl2);
                l_run[r] = l_run[r] * f_me[r] + l_o[r] * f_o[r];
                m_run[r] = m;
            }
#pragma unroll
            for (int c = 0; c < NO / 4; ++c) {  // o_acc [4c, 4c + 1]: row row0, [4c + 2, 4c + 3]: row0 + 8
                const float4 o = __ldcg(other + c * 128);
                o_acc[4 * c] = o_acc[4 * c] * f_me[0] + o.x * f_o[0];
                o_acc[4 * c + 1] = o_acc[4 * c + 1] * f_me[0] + o.y * f_o[0];
                o_acc[4 * c + 2] = o_acc[4 * c + 2] * f_me[1] + o.z * f_o[1];
                o_acc[4 * c + 3] = o_acc[4 * c + 3] * f_me[1] + o.w * f_o[1];
            }
        }
        return true;
    };
    // Our turn on the tensor cores (waits for the consumer before us to hand it on), and handing
    // it on to the next consumer once our GEMMs are issued; a lone consumer (NC = 1, several
    // blocks per SM) has no one to take turns with
    auto take_turn = [&]() { if constexpr (NC > 1) named_bar_sync(TURN_BAR + cw, 256); };
    auto pass_turn = [&]() { if constexpr (NC > 1) named_bar_arrive(next_turn, 256); };
    // A turn with the S of the current tile's first key tile alone (no O += P V in flight)
    auto first_turn = [&]() {
        take_turn();
        issue_s(kv_it);
        pass_turn();
        if constexpr (BIAS != 0) fetch_bias(key0(0));
        wgmma_wait<0>();
        s_done(kv_it, wt.n_tiles == 1);
        start_tile();
    };
    // A turn with the last O += P V of the current tile alone
    auto last_turn = [&]() {
        take_turn();
        issue_pv(kv_it, p_frag);
        pass_turn();
        // O_SMEM: the previous tile's TMA store has read o_smem before store_tile overwrites it;
        // waited for here, where the warps wait for the product anyway (+0.4 % at s <= 2k on the
        // H200)
        if constexpr (L::O_SMEM) {
            if (t == 0) bulk_wait_read<0>();
            named_bar_sync(WG_BAR + cw, 128);     // (thread 0's wait holds the warpgroup)
        }
        wgmma_wait<0>();
        pv_done(kv_it, p_frag);
        ++kv_it;
    };

    // Pingpong: the consumers take turns issuing their GEMMs, round robin (named barrier
    // TURN_BAR + c is "consumer c's turn": c's 128 threads sync on it, the consumer before c
    // arrives on it after issuing). Consumer 0 takes the very first turn: its own arrival here
    // plus its first sync complete barrier TURN_BAR. Every consumer walks the same work tiles
    // and takes the same n_tiles + 1 turns per tile (the first S; S of the next key tile + O += P V
    // per key tile; the last O += P V alone), so the order holds across tiles.
    if (NC > 1 && cw == 0) named_bar_arrive(TURN_BAR, 256);

    if (fetch_tile()) {
        first_turn();
        for (;;) {
            // ---- every key tile but the last: in our turn S of key tile it + 1, then O += P V
            //      of key tile it; the softmax of S(it + 1) runs while O += P V is on the tensor
            //      cores. (Waits are unconditional and the last O += P V is peeled off: ptxas
            //      then keeps the products asynchronous.)
            const int last = wt.n_tiles - 1;
            // One key-tile step: in our turn S of key tile it + 1, then O += P V of key tile it
            // from pf; the softmax of S(it + 1) into s_acc and then P into p_frag (pack_p), or
            // (maxfree, a literal at each call) max-free into pn
            auto step = [&](int it, u32* pf, u32* pn, bool maxfree) {
                take_turn();
                issue_s(kv_it + 1);
                issue_pv(kv_it, pf);
                pass_turn();
                if constexpr (BIAS != 0) fetch_bias(key0(it + 1));
                wgmma_wait<1>();                         // S done (O += P V may still run)
                s_done(kv_it + 1, it + 1 == last);
                bool rescale = true;                     // (max-free: whether O is rescaled)
                if (MAXFREE && maxfree) rescale = softmax_maxfree(key0(it + 1), pn);
                else softmax_scores(key0(it + 1), false);
                // SOFTMAX_BESIDE_PV: V of key tile it + 1 landed (the next turn's O += P V reads
                // it), waited for here because the wait's loop ends a basic block, which keeps the
                // O += P V wait below after the softmax
                if constexpr (SOFTMAX_BESIDE_PV)
                    mbar_wait(v_full + 8 * ((kv_it + 1) % STAGES), ((kv_it + 1) / STAGES) & 1);
                wgmma_wait<0>();                         // O += P V done
                pv_done(kv_it, pf);
                if (!(MAXFREE && maxfree)) pack_p();
                else if (rescale) rescale_o<NO>(o_acc, alpha);   // only where some row's m moved
                ++kv_it;
            };
            // (MAXFREE: one exact step when the loop's count is odd, then pairs of max-free steps
            // from p_frag to p_frag2 and back, so that the last P is in p_frag)
            int it = 0;
            for (; it < (MAXFREE ? last % 2 : last); ++it) step(it, p_frag, p_frag, false);
            if constexpr (MAXFREE) {
                for (; it < last; it += 2) {
                    step(it, p_frag, p_frag2, true);
                    step(it + 1, p_frag2, p_frag, true);
                }
            }
            // ---- the tile's last key tile, the epilogue, then the next tile (its Q loads once
            //      every consumer is done with this one's)
            last_turn();
            if (!SPLIT || wt.parts == 1 || merge_pieces()) store_tile();
            ++tile_i;
            if (!fetch_tile()) break;
            first_turn();
        }
    }
    if (L::O_SMEM && t == 0) bulk_wait<0>();   // the last TMA store done before the block's smem goes
}

}  // namespace sm90
