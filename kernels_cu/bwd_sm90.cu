// cupyflash: Hopper (sm_90a) attention backward, main kernel: dK, dV (and dQ through a float32
// accumulator) with TMA loads and wgmma products. The helper kernel before it, flash_bwd_pre
// (D = rowsum(dO ∘ O), zeroed dQ accumulator), comes from bwd.cu, included here so one module
// holds all three; the one after it, flash_bwd_dq_sm90 (dq = dtype(accumulator)), is at the end.
//
// One block per (key tile of BN = 128 keys, kv head, batch); 384 threads = three warpgroups:
//   warpgroup 0, producer: one thread loads the block's K and V tiles once, then the Q and dO
//     tiles [BM = 64 query rows, D] of every step into a two-deep ring (TMA, mbarriers); a second
//     warp stages the step's lse·log2 e and D rows into the same ring slot; a third adds each
//     step's dQ tile from shared memory into the float32 accumulator (bulk reduce-add, async);
//   warpgroups 1 and 2, consumers: 64 keys each, dK and dV [64, D] in registers over all steps.
// Steps: every query head of the kv head's group x every query tile that can see the key tile.
// Per step, each consumer computes (transposed, so its 64 keys are the M dimension of wgmma):
//   Sᵀ  = K Qᵀ             [64 keys, BM]  (wgmma, both operands in shared memory)
//   dPᵀ = V dOᵀ            [64 keys, BM]
//   Pᵀ  = exp2(Sᵀ·scale·log2 e − lse·log2 e)      (P recomputed from lse, never stored)
//   dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale
//   dV += Pᵀ dO,  dK += dSᵀ Q                     (Pᵀ, dSᵀ straight from registers)
//   dSᵀ -> shared memory; then dQ[BM, 64-column slice] = dS K over all 128 keys of the block
//   (both operands MN-major in shared memory), added to the float32 accumulator:
//     DQ_BULK: stored to dq_smem, which the producer's reduce warp adds with one
//       cp.reduce.async.bulk .add.f32 per step (the tile's rows are contiguous in the accumulator);
//     else: red.global.add.v2.f32 from the consumer's registers.
//   The accumulator rows are chunk-swizzled like dq_smem (16-byte chunk index XOR row mod 8, so
//   the fragment stores hit every bank); flash_bwd_dq_sm90 undoes that when converting.
// Sᵀ and dPᵀ are separate wgmma groups: Pᵀ = exp2(..) runs while dPᵀ is still in the tensor
// cores. The consumers never touch global memory inside the loop.
// Covered (the launcher routes the rest to bwd.cu): float16 / bfloat16, d = d_v in {64, 128},
// causal / window (either alignment), GQA / MQA, any s_q, s_k, scale > 0, no softcap / ALiBi,
// atomic (non-deterministic) dQ, TMA-compatible strides.
#include "bwd.cu"
#include "sm90.cuh"
#include "wgmma.cuh"

namespace sm90b {

constexpr int BN = 128;              // keys per block: two consumer warpgroups x 64
constexpr int BM = 64;               // query rows per step
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;   // 40·128 + 232·256 <= 64K registers per SM
constexpr int DS_BAR = 1;            // named barrier 1: both consumers wrote their dSᵀ rows
constexpr int ROWS_WARP = 1;         // producer warp staging lse·log2 e and D
constexpr int DQ_WARP = 2;           // producer warp adding dq_smem into the accumulator
constexpr int PANEL_COLS = 64;       // 64 16-bit columns = one 128-byte swizzle row
constexpr int NBUF = 2;              // Q / dO ring depth

// Byte offsets inside the (1024-aligned) dynamic shared memory; mirrored by
// cupyflash/_gpu_bwd_sm90.py: smem_bytes.
template <int D>
struct Layout {
    static constexpr int PANELS = D / PANEL_COLS;
    static constexpr int KV_PANEL = BN * 128;                // bytes of k_smem / v_smem [BN, 64]
    static constexpr int Q_PANEL = BM * 128;                 // bytes of q_smem / do_smem [BM, 64]
    static constexpr int Q_TILE = PANELS * Q_PANEL;
    static constexpr int DS_TILE = BN * BM * 2;              // dsT_smem [BN keys, BM queries]
    static constexpr int DQ_PITCH = D * 4;                   // dq_smem row bytes (chunk-swizzled)
    static constexpr int K = 0;                              // k_smem [PANELS][BN][64]
    static constexpr int V = K + PANELS * KV_PANEL;          // v_smem [PANELS][BN][64]
    static constexpr int Q = V + PANELS * KV_PANEL;          // q_smem [NBUF][PANELS][BM][64]
    static constexpr int DO = Q + NBUF * Q_TILE;             // do_smem [NBUF][PANELS][BM][64]
    static constexpr int DS = DO + NBUF * Q_TILE;            // dsT_smem [2][BN][BM]
    static constexpr int DQ = DS + 2 * DS_TILE;              // dq_smem [BM][D] float32 (DQ_BULK)
    static constexpr int ROWS = DQ + BM * DQ_PITCH;          // rows_smem [NBUF][lse·log2 e, D][BM]
    static constexpr int BARS = ROWS + NBUF * 2 * BM * 4;    // kv_full, qdo_full[NBUF], qdo_empty[NBUF],
                                                             // dq_full, dq_empty
    static constexpr int BYTES = BARS + 8 * (3 + 2 * NBUF);
};

// Query tiles a key tile [n0, n0 + n_rows) meets: rows i with i + off - left <= j <= i + off + right
// for some key j of the tile (mirror of _gpu_bwd.query_tiles).
template <bool WINDOW>
__device__ __forceinline__ void query_tile_range(const Params& p, int n0, int* m_first, int* m_count) {
    const int n_rows = min(BN, p.s_k - n0);
    int i_lo = 0, i_hi = p.s_q - 1;
    if (WINDOW) {
        i_lo = max(0, n0 - p.diag_offset - p.window_right);
        i_hi = min(p.s_q - 1, n0 + n_rows - 1 - p.diag_offset + p.window_left);
    }
    *m_first = i_lo / BM;
    *m_count = i_hi >= i_lo ? i_hi / BM - i_lo / BM + 1 : 0;
}

// Float offset of element (row i, column c) in a chunk-swizzled float32 row of D columns:
// 16-byte chunk c / 4 XOR i mod 8 (stays within the row: D / 4 >= 8 chunks)
__device__ __forceinline__ int dq_swizzle(int i, int c) {
    return (((c >> 2) ^ (i & 7)) << 2) | (c & 3);
}

__device__ __forceinline__ void fence_proxy_async() {   // generic smem writes -> visible to wgmma
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// dst_gmem[0 .. bytes/4) += src_smem[..] (float32), done by the TMA unit; counted in this
// thread's bulk group (bulk_commit / bulk_wait*)
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst_gmem, u32 src_smem, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst_gmem), "r"(src_smem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_read() {   // sources read: smem reusable
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {        // writes done too
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
// *addr += (x, y) on two consecutive floats in global memory (sm_90 vector reduction)
__device__ __forceinline__ void red_add_v2(float* addr, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(x), "f"(y) : "memory");
}

}  // namespace sm90b

template <typename E, int D, bool WINDOW, bool DQ_BULK>
__global__ void __launch_bounds__(sm90b::THREADS, 1)
flash_bwd_sm90(const __grid_constant__ Params p) {
    using namespace sm90b;
    using L = Layout<D>;
    typedef typename Elem<E>::storage S;
    static_assert(Elem<E>::is16 && (D == 64 || D == 128), "float16 / bfloat16, head dim 64 or 128");
    constexpr int NS = BM / 2;       // Sᵀ / dPᵀ accumulator registers per lane: [64, BM]
    constexpr int NKV = D / 2;       // dK / dV accumulator registers per lane: [64, D]
    constexpr int NQ = PANEL_COLS / 2;   // dQ slice accumulator registers per lane: [BM, 64]
    constexpr int DQ_THREADS = (D / PANEL_COLS) * 128;   // consumer threads that write a dQ slice

    extern __shared__ unsigned char smem_raw[];
    u32 smem_given;   // the launcher sizes the launch: stop loudly if it disagrees with Layout
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;   // swizzled panels: 1024-aligned
    unsigned char* smem_gen = smem_raw + (smem - smem_addr(smem_raw));
    const u32 k_smem = smem + L::K, v_smem = smem + L::V, q_smem = smem + L::Q;
    const u32 do_smem = smem + L::DO, ds_smem = smem + L::DS, dq_smem = smem + L::DQ;
    float* rows_smem = (float*)(smem_gen + L::ROWS);    // [NBUF][2][BM]: lse·log2 e, D per stage
    const u32 kv_full = smem + L::BARS;                 // K, V tiles landed
    const u32 qdo_full = kv_full + 8;                   // [NBUF]: Q, dO, lse, D of the stage landed
    const u32 qdo_empty = qdo_full + 8 * NBUF;          // [NBUF]: both consumers are done with them
    const u32 dq_full = qdo_empty + 8 * NBUF;           // dq_smem holds the step's dQ tile
    const u32 dq_empty = dq_full + 8;                   // dq_smem read out by the bulk reduce

    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const int n0 = n_block * BN;
    int m_first, m_count;
    query_tile_range<WINDOW>(p, n0, &m_first, &m_count);
    const int steps = m_count * p.h_per_hk;             // (query head of the group, query tile)

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < NBUF; ++s) {
            mbar_init(qdo_full + 8 * s, 1 + 32);  // TMA thread (+ bytes) and the 32 lanes of ROWS_WARP
            mbar_init(qdo_empty + 8 * s, 2);     // one arrival per consumer warpgroup
        }
        mbar_init(dq_full, DQ_THREADS);          // every thread that stored a part of the dQ tile
        mbar_init(dq_empty, 1);                  // the DQ_WARP lane that issued the bulk reduce
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<PRODUCER_REGS>();
        const int warp = t / 32, lane = t % 32;
        if (t == 0) {
            // K, V [BN, D] of this key tile, once
            mbar_arrive_expect_tx(kv_full, 2 * BN * D * 2);
#pragma unroll
            for (int c = 0; c < L::PANELS; ++c) {
                tma_load_4d(k_smem + c * L::KV_PANEL, &p.tma_k, kv_full, c * PANEL_COLS, n0, kv_head, batch);
                tma_load_4d(v_smem + c * L::KV_PANEL, &p.tma_v, kv_full, c * PANEL_COLS, n0, kv_head, batch);
            }
            // Q, dO [BM, D] per step, NBUF deep
            for (int st = 0; st < steps; ++st) {
                const int head = kv_head * p.h_per_hk + st / m_count;
                const int m0 = (m_first + st % m_count) * BM;
                const int s = st % NBUF;
                if (st >= NBUF) mbar_wait(qdo_empty + 8 * s, ((st / NBUF) - 1) & 1);
                mbar_arrive_expect_tx(qdo_full + 8 * s, 2 * BM * D * 2);
#pragma unroll
                for (int c = 0; c < L::PANELS; ++c) {
                    tma_load_4d(q_smem + s * L::Q_TILE + c * L::Q_PANEL, &p.tma_q, qdo_full + 8 * s,
                                c * PANEL_COLS, m0, head, batch);
                    tma_load_4d(do_smem + s * L::Q_TILE + c * L::Q_PANEL, &p.tma_do, qdo_full + 8 * s,
                                c * PANEL_COLS, m0, head, batch);
                }
            }
        } else if (warp == ROWS_WARP) {
            // lse·log2 e and D [BM] per step into the stage's rows_smem (two rows per lane); rows
            // past s_q and rows that saw no key in the forward (lse = -inf) get +inf: P is then 0
            for (int st = 0; st < steps; ++st) {
                const int head = kv_head * p.h_per_hk + st / m_count;
                const int m0 = (m_first + st % m_count) * BM;
                const int s = st % NBUF;
                const i64 bh_row = ((i64)batch * p.h + head) * p.s_q;   // [b, h, s_q] row base
                if (st >= NBUF) mbar_wait(qdo_empty + 8 * s, ((st / NBUF) - 1) & 1);
                float* lse_stage = rows_smem + s * 2 * BM;   // [BM]
                float* dsum_stage = lse_stage + BM;          // [BM]
#pragma unroll
                for (int r = lane; r < BM; r += 32) {
                    const int i = m0 + r;
                    const float lse = i < p.s_q ? p.lse[bh_row + i] : CF_INF;
                    lse_stage[r] = lse == -CF_INF ? CF_INF : lse * CF_LOG2E;
                    dsum_stage[r] = i < p.s_q ? p.dsum[bh_row + i] : 0.f;
                }
                mbar_arrive(qdo_full + 8 * s);   // release: the stores above are seen after the wait
            }
        } else if (DQ_BULK && t == DQ_WARP * 32) {
            // dQ tile of each step: accumulator rows [m0, m0 + rows) += dq_smem (same layout)
            for (int st = 0; st < steps; ++st) {
                const int head = kv_head * p.h_per_hk + st / m_count;
                const int m0 = (m_first + st % m_count) * BM;
                float* dq_bh = p.dq_accum + ((i64)batch * p.h + head) * p.s_q * D;   // [s_q, D]
                const int rows = min(BM, p.s_q - m0);
                mbar_wait(dq_full, st & 1);   // the consumers stored (and fenced) the tile
                bulk_reduce_add_f32(dq_bh + (i64)m0 * D, dq_smem, rows * D * 4);
                bulk_commit();
                bulk_wait_read<0>();          // dq_smem read out: the consumers may overwrite it
                mbar_arrive(dq_empty);
            }
            bulk_wait<0>();                   // the additions landed before the block ends
        }
        return;
    }

    // ================================ consumers ================================
    regs_acquire<CONSUMER_REGS>();
    const int cw = wg - 1;                                 // consumer 0 or 1: keys n0 + 64·cw ..
    const int row_in_wg = (t / 32) * 16 + (t % 32) / 4;   // accumulator rows row_in_wg, +8
    const int col_in_8 = 2 * (t % 4);                      // accumulator columns col_in_8, +1 (of 8)
    const int key0 = n0 + cw * 64 + row_in_wg;             // this lane's keys: key0, key0 + 8
    const u32 k_wg = k_smem + cw * 64 * 128, v_wg = v_smem + cw * 64 * 128;   // this consumer's 64 keys
    const bool dq_cols = cw * PANEL_COLS < D;              // this consumer computes a dQ slice

    float dk_acc[NKV], dv_acc[NKV];   // dK, dV [64 keys, D], fp32
#pragma unroll
    for (int i = 0; i < NKV; ++i) dk_acc[i] = dv_acc[i] = 0.f;

    mbar_wait(kv_full, 0);
    for (int st = 0; st < steps; ++st) {
        const int m0 = (m_first + st % m_count) * BM;
        const int s = st % NBUF;
        const u32 q_tile = q_smem + s * L::Q_TILE, do_tile = do_smem + s * L::Q_TILE;
        const float* lse_smem = rows_smem + s * 2 * BM;   // [BM] lse·log2 e of the step
        const float* dsum_smem = lse_smem + BM;           // [BM] D of the step

        // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ  [64 keys, BM], fp32: two groups, so Pᵀ can start
        //      as soon as Sᵀ is done
        float s_acc[NS], dp_acc[NS];
        mbar_wait(qdo_full + 8 * s, (st / NBUF) & 1);     // Q, dO, lse, D of the step landed
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 off = (kk % 4) * 32;    // 16 columns = 32 bytes within a 128-byte panel row
            wgmma_ss<E, BM>(s_acc, smem_desc(k_wg + (kk / 4) * L::KV_PANEL + off, 16, 1024),
                            smem_desc(q_tile + (kk / 4) * L::Q_PANEL + off, 16, 1024), kk > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 off = (kk % 4) * 32;
            wgmma_ss<E, BM>(dp_acc, smem_desc(v_wg + (kk / 4) * L::KV_PANEL + off, 16, 1024),
                            smem_desc(do_tile + (kk / 4) * L::Q_PANEL + off, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<1>();                      // Sᵀ done (dPᵀ may still run)
        fence_regs<NS>(s_acc);

        // ---- Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e), masked, in place in s_acc (fp32)
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

        // ---- dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale; Pᵀ, dSᵀ packed to 16-bit pairs (wgmma A fragments)
        wgmma_wait<0>();                      // dPᵀ done
        fence_regs<NS>(dp_acc);
        u32 p_frag[NS / 2], ds_frag[NS / 2];
#pragma unroll
        for (int i = 0; i < NS; i += 2) {
            const int col = (i / 4) * 8 + col_in_8;
            p_frag[i / 2] = pack2<E>(s_acc[i], s_acc[i + 1]);
            ds_frag[i / 2] = pack2<E>(s_acc[i] * (dp_acc[i] - dsum_smem[col]) * p.scale,
                                      s_acc[i + 1] * (dp_acc[i + 1] - dsum_smem[col + 1]) * p.scale);
        }

        // ---- dSᵀ rows of this consumer -> dsT_smem [BN keys, BM queries] (128-byte swizzle:
        //      16-byte chunk index XOR row mod 8), the A operand of dQ = dS K
        const u32 ds_tile = ds_smem + (st & 1) * L::DS_TILE;   // two buffers: see the barrier below
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
            wgmma_rs<E, D>(dv_acc, p_frag + 4 * kk, smem_desc(do_tile + kk * 2048, L::Q_PANEL, 1024));
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            wgmma_rs<E, D>(dk_acc, ds_frag + 4 * kk, smem_desc(q_tile + kk * 2048, L::Q_PANEL, 1024));
        wgmma_commit();

        // Both consumers' dSᵀ rows are written (and, two steps back, the other buffer's dQ
        // product has completed in both: each passed this barrier one step ago after it).
        named_bar_sync(DS_BAR, 256);
        wgmma_wait<0>();                      // dV, dK done: p_frag, ds_frag free
        fence_regs<NKV>(dv_acc);
        fence_regs<NKV>(dk_acc);
        if (t == 0) mbar_arrive(qdo_empty + 8 * s);   // Q, dO, lse, D of stage s no longer needed here

        // ---- dQ[BM, 64 columns from 64·cw] = dS K over the block's 128 keys; both operands
        //      MN-major: dsT_smem (LBO unused: BM = one panel), K (LBO = bytes between panels)
        float dq_acc[NQ];
        if (dq_cols) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_ss_tt<E, PANEL_COLS>(dq_acc, smem_desc(ds_tile + kk * 2048, L::DS_TILE, 1024),
                                           smem_desc(k_smem + cw * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024),
                                           kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
        }

        // ---- dQ slice (rows row_in_wg, +8; chunk-swizzled columns) -> the accumulator
        if (dq_cols && DQ_BULK) {
            // via dq_smem [BM][D]; DQ_WARP adds the whole tile
            fence_regs<NQ>(dq_acc);
            if (st > 0) mbar_wait(dq_empty, (st - 1) & 1);   // last step's tile was read out
#pragma unroll
            for (int i = 0; i < NQ; i += 4) {
                const int col = cw * PANEL_COLS + (i / 4) * 8 + col_in_8;
                const int r0 = row_in_wg, r1 = row_in_wg + 8;     // r1 mod 8 = r0 mod 8
                const u32 addr0 = dq_smem + r0 * L::DQ_PITCH + 4 * dq_swizzle(r0, col);
                const u32 addr1 = dq_smem + r1 * L::DQ_PITCH + 4 * dq_swizzle(r1, col);
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr0), "f"(dq_acc[i]), "f"(dq_acc[i + 1]) : "memory");
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr1), "f"(dq_acc[i + 2]), "f"(dq_acc[i + 3]) : "memory");
            }
            fence_proxy_async();              // generic stores -> visible to the bulk reduce
            mbar_arrive(dq_full);
        } else if (dq_cols) {
            // straight from registers (m0 is a multiple of 8: row mod 8 = row_in_wg mod 8)
            fence_regs<NQ>(dq_acc);
            const int head = kv_head * p.h_per_hk + st / m_count;
            float* dq_bh = p.dq_accum + ((i64)batch * p.h + head) * p.s_q * D;   // [s_q, D]
            const int r0 = m0 + row_in_wg;
#pragma unroll
            for (int i = 0; i < NQ; i += 4) {
                const int col = cw * PANEL_COLS + (i / 4) * 8 + col_in_8;
                if (r0 < p.s_q) red_add_v2(dq_bh + (i64)r0 * D + dq_swizzle(r0, col), dq_acc[i], dq_acc[i + 1]);
                if (r0 + 8 < p.s_q)
                    red_add_v2(dq_bh + (i64)(r0 + 8) * D + dq_swizzle(r0 + 8, col), dq_acc[i + 2], dq_acc[i + 3]);
            }
        }
    }

    // ---- dK, dV of this consumer's 64 keys (GQA: already summed over the group's query heads)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r;
        if (key < p.s_k) {
            S* dk_row = (S*)p.dk + batch * p.dk_stride_b + key * p.dk_stride_s + kv_head * p.dk_stride_h;
            S* dv_row = (S*)p.dv + batch * p.dv_stride_b + key * p.dv_stride_s + kv_head * p.dv_stride_h;
#pragma unroll
            for (int i = 0; i < NKV; i += 4) {
                const int col = (i / 4) * 8 + col_in_8;
                *(u32*)(dk_row + col) = pack2<E>(dk_acc[i + 2 * r], dk_acc[i + 2 * r + 1]);
                *(u32*)(dv_row + col) = pack2<E>(dv_acc[i + 2 * r], dv_acc[i + 2 * r + 1]);
            }
        }
    }
}

// dq = E(dQ accumulator) for the Hopper main kernel: one thread per element, reading the
// chunk-swizzled accumulator rows (dq_swizzle); flash_bwd_pre zeroed it (layout-blind).
template <typename E>
__global__ void __launch_bounds__(256)
flash_bwd_dq_sm90(const Params p) {
    typedef typename Elem<E>::storage S;
    const i64 total = (i64)p.b * p.h * p.s_q * p.d;
    for (i64 idx = (i64)blockIdx.x * 256 + threadIdx.x; idx < total; idx += (i64)gridDim.x * 256) {
        const int c = (int)(idx % p.d);
        const i64 row = idx / p.d;                     // (batch * h + head) * s_q + i
        const int i = (int)(row % p.s_q);
        const int head = (int)((row / p.s_q) % p.h), batch = (int)(row / ((i64)p.s_q * p.h));
        const float acc = p.dq_accum[row * p.d + sm90b::dq_swizzle(i, c)];
        ((S*)p.dq)[batch * p.dq_stride_b + (i64)i * p.dq_stride_s + head * p.dq_stride_h + c] = from_float<E>(acc);
    }
}
