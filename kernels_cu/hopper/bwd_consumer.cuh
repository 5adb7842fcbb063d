// cupyflash: flash_bwd_sm90's consumer warpgroups, the mainloop's MMA role (bwd_consumer): per
// step Sᵀ = K Qᵀ and dPᵀ = V dOᵀ on wgmma, Pᵀ recomputed from lse (masks, bias), dSᵀ, dV += Pᵀ dO
// and dK += dSᵀ Q from registers, dbias, the dQ slice dS K into the float32 accumulator (via
// dq_smem and DQ_WARP, or red.global.add), and each work tile's dK, dV stores. hopper/bwd.cu
// wires it.
#pragma once

#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/bwd_parts.cuh"
#include "hopper/sched.cuh"
#include "hopper/sm90.cuh"
#include "hopper/wgmma.cuh"

namespace sm90b {

// One consumer warpgroup of flash_bwd_sm90 (its template arguments), wg = 1 or 2, thread t of its
// 128: 64 keys of each work tile the TMA thread hands on, until none is left; its registers hold
// dK, dV [64, D] over the tile's steps. Last, it stops DQ_WARP (DQ_BULK). smem_raw: the kernel's
// dynamic shared memory. The code compiles to the SASS it had written inside the kernel; what that
// takes here (each changed the SASS of some variants otherwise):
//  - its pieces are lambdas over its state (named functions are inlined earlier);
//  - it reads the addresses from the Smem record into locals first, and derives smem_gen from
//    smem_raw as the kernel does (read from the record, the BIAS_TMA bias address folds its
//    constant offset elsewhere);
//  - the window tests of the masks are written with & (not &&): p is a reference here, so the
//    compiler may not load p.window_* unconditionally, and && then stays a branch per element;
//  - the ring counters q_it, kv_it are references to two locals whose declaration order differs
//    with BIAS: it decides the order of their copies at the tile loop's entry, hence registers.
template <typename E, int D, bool WINDOW, bool DQ_BULK, int KVBUF, bool VARLEN, int BIAS, bool DET>
__device__ __forceinline__ void bwd_consumer(const Params& p, const Smem& sm, unsigned char* smem_raw,
                                             int wg, int t) {
    using L = Layout<D, KVBUF, BIAS == BIAS_TMA, DET>;
    static_assert(!L::SPLIT_D, "d = 256: bwd_split_consumer");
    constexpr int BN = L::BN;   // keys per work tile: 64 per consumer
    typedef typename Elem<E>::storage S;
    constexpr bool BIAS_LD = BIAS == BIAS_LD16 || BIAS == BIAS_LD32;   // the consumers load it
    constexpr int BIAS_BYTES = BIAS == BIAS_LD32 ? 4 : 2;   // bytes per bias element
    constexpr int NS = BM / 2;       // Sᵀ / dPᵀ accumulator registers per lane: [64, BM]
    constexpr int NKV = D / 2;       // dK / dV accumulator registers per lane: [64, D]
    constexpr int NQ = PANEL_COLS / 2;   // dQ slice accumulator registers per lane: [BM, 64]
    unsigned char* smem_gen = smem_raw + (sm.smem - smem_addr(smem_raw));   // the generic aligned base
    const u32 k_smem = sm.k_smem, v_smem = sm.v_smem, q_smem = sm.q_smem;
    const u32 do_smem = sm.do_smem, ds_smem = sm.ds_smem, dq_smem = sm.dq_smem;
    float* rows_smem = sm.rows_smem;
    volatile int* tile_smem = sm.tile_smem;
    volatile int* seq_smem = sm.seq_smem;
    volatile u64* job_smem = sm.job_smem;
    const u32 kv_full = sm.kv_full, kv_empty = sm.kv_empty, qdo_full = sm.qdo_full, qdo_empty = sm.qdo_empty;
    const u32 dq_full = sm.dq_full, dq_empty = sm.dq_empty, tile_full = sm.tile_full, tile_empty = sm.tile_empty;
    // consumer 0 or 1: keys n0 + 64·cw .. (broadcast from lane 0: warp-uniform for the compiler,
    // so what derives from it, the descriptors below, stays in uniform registers)
    const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
    // wgmma descriptors of stage / buffer 0 (K-major: LBO 16; MN-major: LBO = bytes between
    // panels); every product's is one of these plus a byte offset (desc_add: one add, not
    // smem_desc's ~10 instructions per product)
    const u64 k_desc = smem_desc(k_smem, 16, 1024), v_desc = smem_desc(v_smem, 16, 1024);     // K-major
    const u64 q_desc = smem_desc(q_smem, 16, 1024), do_desc = smem_desc(do_smem, 16, 1024);
    const u64 q_desc_mn = smem_desc(q_smem, L::Q_PANEL, 1024), do_desc_mn = smem_desc(do_smem, L::Q_PANEL, 1024);
    const u64 ds_desc = smem_desc(ds_smem, L::DS_TILE, 1024), k_desc_mn = smem_desc(k_smem, L::KV_PANEL, 1024);
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (t % 4);                      // accumulator columns col_in_8, +1 (of 8)
    const bool dq_cols = cw * PANEL_COLS < D;              // this consumer computes a dQ slice

    float dk_acc[NKV], dv_acc[NKV];   // dK, dV [64 keys, D], fp32

    // Bias plane [s_q, s_k] (unit key stride) of (batch, query head), as bytes; the dbias plane
    // of the float32 accumulator (null: no dbias wanted)
    auto bias_plane = [&](int batch, int head) -> const char* {
        return (const char*)p.bias + (batch * p.bias_stride_b + head * p.bias_stride_h) * BIAS_BYTES;
    };
    // This consumer's bias block [BM queries, 64 keys] of a step into L1 or L2 (ahead of its loads):
    // thread t takes query row t / 2, half t % 2 of the row's bytes (first and last byte: the
    // block need not be line-aligned)
    auto fetch_bias = [&](int batch, int head, int m0, int n0, bool L1) {
        const char* plane = bias_plane(batch, head);
        const int r = min(m0 + t / 2, p.s_q - 1);
        const int k_lo = min(n0 + cw * 64 + (t % 2) * 32, p.s_k - 1);
        const int k_hi = min(n0 + cw * 64 + (t % 2) * 32 + 31, p.s_k - 1);
        const char* row = plane + (i64)r * p.bias_stride_q * BIAS_BYTES;
        if (L1) {
            asm volatile("prefetch.global.L1 [%0];" :: "l"(row + (i64)k_lo * BIAS_BYTES));
            asm volatile("prefetch.global.L1 [%0];" :: "l"(row + (i64)k_hi * BIAS_BYTES));
        } else {
            asm volatile("prefetch.global.L2 [%0];" :: "l"(row + (i64)k_lo * BIAS_BYTES));
            asm volatile("prefetch.global.L2 [%0];" :: "l"(row + (i64)k_hi * BIAS_BYTES));
        }
    };
    // Q/dO steps and K/V tiles consumed so far (ring positions); two locals behind references
    // (declaration order by BIAS: see above)
    int it_a = 0, it_b = 0;
    int& q_it = BIAS ? it_a : it_b;
    int& kv_it = BIAS ? it_b : it_a;
    for (int tile_i = 0;; ++tile_i) {
        const int w = take_tile(tile_smem, tile_full, tile_empty, tile_i, TILE_RING);
        if (w < 0) break;
        const KeyTile wt = key_tile<BN, BM, WINDOW, VARLEN, BIAS, DET>(p, w);
        const int n0 = wt.n0;
        const int key0 = n0 + cw * 64 + row_in_wg;         // this lane's keys: key0, key0 + 8
        // VARLEN's mask values, kept in shared memory (hd 128 has no registers to spare): nk =
        // s_k − n0 (keys of the tile in the sequence) and nrel = n0 − diag. Only tiles with steps
        // read them; one thread writes them after the DS_BAR of the last tile's last step (every
        // read of the old values is before it), and the DS_BAR after the write publishes them.
        if (VARLEN && wt.steps > 0) {
            if (cw == 0 && t == 0) {
                seq_smem[0] = wt.s_k - n0;
                seq_smem[1] = n0 - wt.diag;
            }
            named_bar_sync(DS_BAR, 256);
        }
        const int kb = kv_it % KVBUF;
        const u32 k_tile = k_smem + kb * L::KV_TILE, v_tile = v_smem + kb * L::KV_TILE;   // [BN, D]
        const u32 k_wg = k_tile + cw * 64 * 128, v_wg = v_tile + cw * 64 * 128;   // this consumer's 64 keys

#pragma unroll
        for (int i = 0; i < NKV; ++i) dk_acc[i] = dv_acc[i] = 0.f;
        if (wt.steps > 0) mbar_wait(kv_full + 8 * kb, (kv_it / KVBUF) & 1);   // K, V of the tile landed

        for (int st = 0; st < wt.steps; ++st, ++q_it) {
            const int m0 = step_m0<BM, DET>(p, wt, st);
            const int s = q_it % NBUF;
            const u32 q_tile = q_smem + s * L::Q_TILE, do_tile = do_smem + s * L::Q_TILE;
            const float* lse_smem = rows_smem + s * 2 * BM;   // [BM] lse·log2 e of the step
            const float* dsum_smem = lse_smem + BM;           // [BM] D of the step
            const int head = step_head<DET>(p, wt, st);
            if constexpr (BIAS_LD) {   // bias blocks: this step's into L1 (loaded after Sᵀ),
                                       // the next step's into L2
                fetch_bias(wt.batch, head, m0, n0, true);
                if (st + 1 < wt.steps) fetch_bias(wt.batch, step_head(p, wt, st + 1), step_m0<BM>(p, wt, st + 1), n0, false);
            }

            // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ  [64 keys, BM], fp32: two groups, so Pᵀ can start
            //      as soon as Sᵀ is done
            float s_acc[NS], dp_acc[NS];
            mbar_wait(qdo_full + 8 * s, (q_it / NBUF) & 1);   // Q, dO, lse, D of the step landed
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (kk % 4) * 32;    // 16 columns = 32 bytes within a 128-byte panel row
                wgmma_ss<E, BM>(s_acc, desc_add(k_desc, k_wg - k_smem + (kk / 4) * L::KV_PANEL + off),
                                desc_add(q_desc, q_tile - q_smem + (kk / 4) * L::Q_PANEL + off), kk > 0);
            }
            wgmma_commit();
            // dPᵀ = V dOᵀ: issued right behind Sᵀ (Pᵀ overlaps it), or after Pᵀ (a bias at d = 128:
            // dK, dV, Sᵀ, dPᵀ in flight and the bias leave too few registers; BIAS_TMA spills
            // 8-40 B with dPᵀ early: tuning builds may pass -DBIAS_TMA_DP_EARLY=1 to compare)
#ifndef BIAS_TMA_DP_EARLY
#define BIAS_TMA_DP_EARLY 0
#endif
            constexpr bool DP_EARLY = BIAS == BIAS_NONE || D == 64 || (BIAS == BIAS_TMA && BIAS_TMA_DP_EARLY);
            auto issue_dp = [&]() {
                if (!DP_EARLY || BIAS_LD) wgmma_fence();   // (else: in the same fence as Sᵀ)
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    const u32 off = (kk % 4) * 32;
                    wgmma_ss<E, BM>(dp_acc, desc_add(v_desc, v_wg - v_smem + (kk / 4) * L::KV_PANEL + off),
                                    desc_add(do_desc, do_tile - do_smem + (kk / 4) * L::Q_PANEL + off), kk > 0);
                }
                wgmma_commit();
            };
            if constexpr (DP_EARLY) {
                issue_dp();
                wgmma_wait<1>();                  // Sᵀ done (dPᵀ may still run)
            } else {
                wgmma_wait<0>();                  // Sᵀ done
            }
            fence_regs<NS>(s_acc);

            // ---- Pᵀ = exp2(Sᵀ·scale·log2 e (+ bias·log2 e) − lse·log2 e), masked, in place in
            //      s_acc (fp32)
            // VARLEN in two per-tile values: nk = s_k − n0 (keys of the tile in the sequence; the
            // next sequence's are masked too) and nrel = n0 − diag (key − diag(row) = nrel +
            // (key − n0) − row)
            const int nk = VARLEN ? seq_smem[0] : 0, nrel = VARLEN && WINDOW ? seq_smem[1] : 0;
            bool need_mask = VARLEN ? nk < BN : n0 + BN > p.s_k;
            if (WINDOW)
                need_mask |= VARLEN ? nrel + BN - 1 > m0 + p.window_right || nrel < m0 + BM - 1 - p.window_left
                                    : n0 + BN - 1 > m0 + p.diag_offset + p.window_right ||
                                      n0 < m0 + BM - 1 + p.diag_offset - p.window_left;
            if constexpr (BIAS == 0) {
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    const int col = (i / 4) * 8 + col_in_8 + (i % 2);   // query row m0 + col
                    const int key = key0 + ((i % 4) >= 2 ? 8 : 0);
                    float pe = fast_exp2(s_acc[i] * p.scale_log2 - lse_smem[col]);
                    if (need_mask) {
                        bool keep;
                        if constexpr (VARLEN) {
                            const int kt = key - n0, rel = nrel + kt - m0 - col;   // key − diag(row)
                            keep = kt < nk;
                            if (WINDOW) keep = keep & (rel <= p.window_right) & (rel >= -p.window_left);
                        } else {
                            const int diag = m0 + col + p.diag_offset;
                            keep = key < p.s_k;
                            if (WINDOW) keep = keep & (key <= diag + p.window_right) & (key >= diag - p.window_left);
                        }
                        if (!keep) pe = 0.f;
                    }
                    s_acc[i] = pe;
                }
            } else {
                // BIAS_LD: the bias [query m0 + col, key] read per pair of queries (clamped into the
                // plane: those P are masked or 0)
                // bias rows m0 + col_in_8 (+ 8 per i / 4, + 1 per i % 2) at keys key0, key0 + 8 (keys
                // clamped into the row; rows past s_q not read: their P is 0 anyway, lse = +inf)
                const char* brow = nullptr;
                i64 b_sq = 0;            // bytes between bias rows
                int b_k8 = 0;            // bytes from key key0 to key0 + 8 (clamped)
                if constexpr (BIAS_LD) {
                    const int k_a = min(key0, p.s_k - 1), k_b = min(key0 + 8, p.s_k - 1);
                    b_sq = p.bias_stride_q * BIAS_BYTES;
                    b_k8 = (k_b - k_a) * BIAS_BYTES;
                    brow = bias_plane(wt.batch, head) + (i64)(m0 + col_in_8) * b_sq + (i64)k_a * BIAS_BYTES;
                }
                // BIAS_TMA: this consumer's panel bias_smem [BM queries, 64 keys] of the stage. One
                // ldmatrix.x4.trans gives a lane the pairs (queries col, col + 1; one key) of 16
                // queries x 16 keys: matrix mt = lane / 8 holds queries 8·(mt / 2) .. + 7 of the 16
                // (rows: lane % 8 gives their addresses) and the warp's keys 8·(mt % 2) .. + 7 (a
                // 16-byte chunk, swizzled: chunk XOR row mod 8); transposed, lane l receives key
                // l / 4 of queries 2(l % 4), + 1: exactly s_acc's pairs (i = 8g + 2·mt)
                const int lane = t % 32, mt = lane / 8;
                const unsigned char* bias_rows = smem_gen + L::BIAS + s * L::BIAS_TILE + cw * L::BIAS_PANEL +
                                                 (8 * (mt / 2) + lane % 8) * 128 +
                                                 (((2 * (t / 32) + mt % 2) ^ (lane % 8)) << 4);
                u32 bias_pairs[4];
#pragma unroll
                for (int i = 0; i < NS; i += 2) {
                    const int col = (i / 4) * 8 + col_in_8;             // query rows m0 + col, + 1
                    const int key = key0 + ((i % 4) >= 2 ? 8 : 0);
                    const float2 l2 = *(const float2*)(lse_smem + col);
                    float x0 = s_acc[i] * p.scale_log2, x1 = s_acc[i + 1] * p.scale_log2;
                    if constexpr (BIAS_LD) {
                        const char* r0 = brow + ((i % 4) >= 2 ? b_k8 : 0);
                        const char* r1 = r0 + b_sq;
                        float b0 = 0.f, b1 = 0.f;
                        if (m0 + col < p.s_q) {
                            if constexpr (BIAS == 1) b0 = to_float<E>(*(const S*)r0);
                            else b0 = *(const float*)r0;
                        }
                        if (m0 + col + 1 < p.s_q) {
                            if constexpr (BIAS == 1) b1 = to_float<E>(*(const S*)r1);
                            else b1 = *(const float*)r1;
                        }
                        x0 = fmaf(b0, CF_LOG2E, x0);
                        x1 = fmaf(b1, CF_LOG2E, x1);
                        if (i % 4 == 2) brow += 8 * b_sq;                // next 8 query rows
                    } else {   // BIAS_TMA: queries 16g .. 16g + 15 of the step per ldmatrix
                        if (i % 8 == 0) ldmatrix_x4_trans(bias_pairs, bias_rows + (i / 8) * 16 * 128);
                        const u32 pr = bias_pairs[(i % 8) / 2];   // query col in the low half
                        x0 = fmaf(to_float<E>((S)(pr & 0xffffu)), CF_LOG2E, x0);
                        x1 = fmaf(to_float<E>((S)(pr >> 16)), CF_LOG2E, x1);
                    }
                    float pe0 = fast_exp2(x0 - l2.x), pe1 = fast_exp2(x1 - l2.y);
                    if (need_mask) {
                        const int diag = m0 + col + p.diag_offset;
                        bool keep0 = key < p.s_k, keep1 = keep0;
                        if (WINDOW) {
                            keep0 = keep0 & (key <= diag + p.window_right) & (key >= diag - p.window_left);
                            keep1 = keep1 & (key <= diag + 1 + p.window_right) & (key >= diag + 1 - p.window_left);
                        }
                        if (!keep0) pe0 = 0.f;
                        if (!keep1) pe1 = 0.f;
                    }
                    s_acc[i] = pe0;
                    s_acc[i + 1] = pe1;
                }
            }

            if constexpr (!DP_EARLY) issue_dp();
            // ---- dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale; Pᵀ, dSᵀ packed to 16-bit pairs (wgmma A fragments)
            wgmma_wait<0>();                      // dPᵀ done
            fence_regs<NS>(dp_acc);
            u32 p_frag[NS / 2], ds_frag[NS / 2];
#pragma unroll
            for (int i = 0; i < NS; i += 2) {
                const int col = (i / 4) * 8 + col_in_8;
                p_frag[i / 2] = pack2<E>(s_acc[i], s_acc[i + 1]);
                if constexpr (BIAS != 0) {   // dp_acc keeps dSᵀ without the scale: dbias
                    dp_acc[i] = s_acc[i] * (dp_acc[i] - dsum_smem[col]);
                    dp_acc[i + 1] = s_acc[i + 1] * (dp_acc[i + 1] - dsum_smem[col + 1]);
                    ds_frag[i / 2] = pack2<E>(dp_acc[i] * p.scale, dp_acc[i + 1] * p.scale);
                } else {
                    ds_frag[i / 2] = pack2<E>(s_acc[i] * (dp_acc[i] - dsum_smem[col]) * p.scale,
                                              s_acc[i + 1] * (dp_acc[i + 1] - dsum_smem[col + 1]) * p.scale);
                }
            }

            // ---- dSᵀ rows of this consumer -> dsT_smem [BN keys, BM queries] (128-byte swizzle:
            //      16-byte chunk index XOR row mod 8), the A operand of dQ = dS K
            const u32 ds_tile = ds_smem + (q_it & 1) * L::DS_TILE;   // two buffers: see the barrier below
#pragma unroll
            for (int i = 0; i < NS; i += 2) {
                const int r = cw * 64 + row_in_wg + ((i % 4) >= 2 ? 8 : 0);
                const u32 addr = ds_tile + r * 128 + ((((i / 4)) ^ (r & 7)) << 4) + 4 * (t % 4);
                asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(ds_frag[i / 2]) : "memory");
            }
            fence_proxy_async();   // before the wgmma below, which reads shared memory too
            // ---- dV += Pᵀ dO, dK += dSᵀ Q  [64 keys, D]: dO, Q read MN-major (k-step = 16 rows)
            fence_regs<NKV>(dv_acc);
            fence_regs<NKV>(dk_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_rs<E, D>(dv_acc, p_frag + 4 * kk, desc_add(do_desc_mn, do_tile - do_smem + kk * 2048));
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_rs<E, D>(dk_acc, ds_frag + 4 * kk, desc_add(q_desc_mn, q_tile - q_smem + kk * 2048));
            wgmma_commit();

            // Both consumers' dSᵀ rows are written (and, two steps back, the other buffer's dQ
            // product has completed in both: each passed this barrier one step ago after it).
            named_bar_sync(DS_BAR, 256);
            wgmma_wait<0>();                      // dV, dK done: p_frag, ds_frag free
            fence_regs<NKV>(dv_acc);
            fence_regs<NKV>(dk_acc);
            // Q, dO, lse, D of stage s no longer needed here. Every thread arrives after its own
            // reads of lse / D: ROWS_WARP overwrites them once qdo_empty completes, and racecheck
            // orders a write after a read only through the reading thread's own arrival
            mbar_arrive(qdo_empty + 8 * s);

            // ---- dbias (+)= dSᵀ transposed to [query, key] (after dV, dK: registers)
            if constexpr (BIAS != 0) {
                if (p.dbias_accum) {
                    // [s_q', s_k'] float32 plane of (batch, head) (0-stride dimensions summed)
                    float* db = p.dbias_accum + wt.batch * p.dbias_stride_b + head * p.dbias_stride_h;
                    if (p.dbias_mode & DBIAS_ROWS) {
                        // bias broadcast over queries: one sum per key over the step's queries
                        // (0 past s_q: P = 0), the quad's 4 lanes hold the key's other queries
                        float sk[2] = {0.f, 0.f};
#pragma unroll
                        for (int i = 0; i < NS; ++i) sk[(i % 4) / 2] += dp_acc[i];
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const float v = quad_sum(sk[r]);
                            if (t % 4 == 0 && key0 + 8 * r < p.s_k) red_add_f32(db + key0 + 8 * r, v);
                        }
                    } else {
                        // keys in pairs (key, key + 1) from lanes t, t ^ 4 (one shuffle per pair):
                        // the lane of an even key writes query col, the odd one query col + 1;
                        // s_k and the accumulator's row stride are even (launcher), so the pair
                        // is 8-byte aligned and both keys are in range or neither
                        const int odd = (row_in_wg & 1);
                        const bool store = p.dbias_mode & DBIAS_STORE;
#pragma unroll
                        for (int i = 0; i < NS; i += 2) {
                            const float a = dp_acc[i], b = dp_acc[i + 1];   // queries col, col + 1
                            const float got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 4);
                            const int q = m0 + (i / 4) * 8 + col_in_8 + odd;
                            const int k = key0 + ((i % 4) >= 2 ? 8 : 0) - odd;
                            if (q < p.s_q && k < p.s_k) {
                                float* dst = db + (i64)q * p.dbias_stride_q + k;
                                const float x = odd ? got : a, y = odd ? b : got;
                                if (store)
                                    asm volatile("st.global.v2.f32 [%0], {%1, %2};" :: "l"(dst), "f"(x), "f"(y) : "memory");
                                else
                                    red_add_v2(dst, x, y);
                            }
                        }
                    }
                }
            }


            // ---- dQ[BM, 64 columns from 64·cw] = dS K over the tile's 128 keys; both operands
            //      MN-major: dsT_smem (LBO unused: BM = one panel), K (LBO = bytes between panels)
            float dq_acc[NQ];
            if (dq_cols) {
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk)
                    wgmma_ss_tt<E, PANEL_COLS>(dq_acc, desc_add(ds_desc, ds_tile - ds_smem + kk * 2048),
                                               desc_add(k_desc_mn, k_tile - k_smem + cw * L::KV_PANEL + kk * 2048),
                                               kk > 0);
                wgmma_commit();
                wgmma_wait<0>();
            }

            // ---- dQ slice (rows row_in_wg, +8; chunk-swizzled columns) -> the accumulator
            // The sequence's accumulator rows [s_q, D] (dq_rows); their chunk swizzle is by the row's
            // index in the (batch, head) slab: varlen rows start at q_row, so the tile's rows are
            // offset by sw = q_row mod 8.
            if (dq_cols && DQ_BULK) {
                // via dq_smem [BM][D]; DQ_WARP adds the whole tile
                fence_regs<NQ>(dq_acc);
                if (q_it > 0) mbar_wait(dq_empty, (q_it - 1) & 1);   // last step's tile was read out
                const int sw = VARLEN ? ld_seq(p.cu_seqlens_q + wt.batch) & 7 : 0;
                if (cw == 0 && t == 0) {                             // where DQ_WARP adds it
                    int s_q;
                    float* dq_bh = dq_rows<VARLEN, D>(p, wt, head, &s_q);
                    job_smem[0] = (u64)(dq_bh + (i64)m0 * D);
                    job_smem[1] = (u64)(min(BM, s_q - m0) * D * 4);   // this sequence's rows only
                    if constexpr (DET) {   // after the earlier key tiles' additions (bwd_parts.cuh)
                        const int diag = VARLEN ? n0 - seq_smem[1] : p.diag_offset;
                        const int s_k = VARLEN ? n0 + seq_smem[0] : p.s_k;
                        job_smem[2] = (u64)dq_sem<VARLEN, BM>(p, wt, head, m0);
                        job_smem[3] = (u64)dq_rank<WINDOW, BM, BN>(p, n0, s_q, s_k, diag, m0);
                    }
                }
#pragma unroll
                for (int i = 0; i < NQ; i += 4) {
                    const int col = cw * PANEL_COLS + (i / 4) * 8 + col_in_8;
                    const int r0 = row_in_wg, r1 = row_in_wg + 8;     // r1 mod 8 = r0 mod 8
                    const u32 addr0 = dq_smem + r0 * L::DQ_PITCH + 4 * dq_swizzle(r0 + sw, col);
                    const u32 addr1 = dq_smem + r1 * L::DQ_PITCH + 4 * dq_swizzle(r1 + sw, col);
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr0), "f"(dq_acc[i]), "f"(dq_acc[i + 1]) : "memory");
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr1), "f"(dq_acc[i + 2]), "f"(dq_acc[i + 3]) : "memory");
                }
                fence_proxy_async();              // generic stores -> visible to the bulk reduce
                mbar_arrive(dq_full);
            } else if (dq_cols) {
                // straight from registers (m0 is a multiple of 8: row mod 8 = row_in_wg mod 8)
                fence_regs<NQ>(dq_acc);
                int s_q;
                float* dq_bh = dq_rows<VARLEN, D>(p, wt, head, &s_q);
                const int sw = VARLEN ? ld_seq(p.cu_seqlens_q + wt.batch) & 7 : 0;
                red_dq_slice<PANEL_COLS, D>(dq_bh, m0 + row_in_wg, s_q, sw, cw * PANEL_COLS, col_in_8, dq_acc);
            }
        }
        if (wt.steps > 0) {
            // this consumer's last reads of K (dQ product) and V (dPᵀ) have completed (waited above)
            if (t == 0) mbar_arrive(kv_empty + 8 * kb);
            ++kv_it;
        }

        // ---- dK, dV of this consumer's 64 keys (GQA: already summed over the group's query
        //      heads; zeros for a tile that no query sees); the next tile's loads are in flight
        const int k_row = VARLEN ? ld_seq(p.cu_seqlens_k + wt.batch) : 0;   // packed row of key 0
        const int s_k = VARLEN ? ld_seq(p.cu_seqlens_k + wt.batch + 1) - k_row : p.s_k;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 8 * r;
            if (key < s_k) {   // varlen: never a row of the next sequence
                const i64 row = k_row + key;
                S* dk_row = (S*)p.dk + wt.tma_b * p.dk_stride_b + row * p.dk_stride_s + wt.kv_head * p.dk_stride_h;
                S* dv_row = (S*)p.dv + wt.tma_b * p.dv_stride_b + row * p.dv_stride_s + wt.kv_head * p.dv_stride_h;
#pragma unroll
                for (int i = 0; i < NKV; i += 4) {
                    const int col = (i / 4) * 8 + col_in_8;
                    *(u32*)(dk_row + col) = pack2<E>(dk_acc[i + 2 * r], dk_acc[i + 2 * r + 1]);
                    *(u32*)(dv_row + col) = pack2<E>(dv_acc[i + 2 * r], dv_acc[i + 2 * r + 1]);
                }
            }
        }
    }

    // ---- no work left: stop DQ_WARP (after it has read out the last tile)
    if (DQ_BULK && dq_cols) {
        if (q_it > 0) mbar_wait(dq_empty, (q_it - 1) & 1);
        if (cw == 0 && t == 0) job_smem[0] = 0;
        mbar_arrive(dq_full);
    }
}

}  // namespace sm90b
