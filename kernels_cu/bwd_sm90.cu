// cupyflash: Hopper (sm_90a) attention backward, main kernel: dK, dV (and dQ through a float32
// accumulator) with TMA loads and wgmma products. The helper kernels flash_bwd_pre (D = rowsum(dO ∘ O),
// zeroed dQ accumulator) and flash_bwd_dq (dq = dtype(accumulator)) come from bwd.cu, included here
// so one module holds all three.
//
// One block per (key tile of BN = 128 keys, kv head, batch); 384 threads = three warpgroups:
//   warpgroup 0, producer: one thread loads the block's K and V tiles once, then the Q and dO
//     tiles [BM = 64 query rows, D] of every step into a two-deep ring (TMA, mbarriers);
//   warpgroups 1 and 2, consumers: 64 keys each, dK and dV [64, D] in registers over all steps.
// Steps: every query head of the kv head's group x every query tile that can see the key tile.
// Per step, each consumer computes (transposed, so its 64 keys are the M dimension of wgmma):
//   Sᵀ  = K Qᵀ             [64 keys, BM]  (wgmma, both operands in shared memory)
//   dPᵀ = V dOᵀ            [64 keys, BM]
//   Pᵀ  = exp2(Sᵀ·scale·log2 e − lse·log2 e)      (P recomputed from lse, never stored)
//   dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale
//   dV += Pᵀ dO,  dK += dSᵀ Q                     (Pᵀ, dSᵀ straight from registers)
//   dSᵀ -> shared memory; then dQ[BM, 64-column slice] = dS K over all 128 keys of the block
//   (both operands MN-major in shared memory), added to the float32 accumulator (red.global.add).
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
constexpr int WG_BAR = 2;            // named barriers 2, 3: the 128 threads of consumer 0 / 1
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
    static constexpr int K = 0;                              // k_smem [PANELS][BN][64]
    static constexpr int V = K + PANELS * KV_PANEL;          // v_smem [PANELS][BN][64]
    static constexpr int Q = V + PANELS * KV_PANEL;          // q_smem [NBUF][PANELS][BM][64]
    static constexpr int DO = Q + NBUF * Q_TILE;             // do_smem [NBUF][PANELS][BM][64]
    static constexpr int DS = DO + NBUF * Q_TILE;            // dsT_smem [2][BN][BM]
    static constexpr int ROWS = DS + 2 * DS_TILE;            // lse·log2 e, D [2 consumers][BM] each
    static constexpr int BARS = ROWS + 2 * 2 * BM * 4;       // kv_full, qdo_full[NBUF], qdo_empty[NBUF]
    static constexpr int BYTES = BARS + 8 * (1 + 2 * NBUF);
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

__device__ __forceinline__ void fence_proxy_async() {   // generic smem writes -> visible to wgmma
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// *addr += (x, y) on two consecutive floats in global memory (sm_90 vector reduction)
__device__ __forceinline__ void red_add_v2(float* addr, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(addr), "f"(x), "f"(y) : "memory");
}

}  // namespace sm90b

template <typename E, int D, bool WINDOW>
__global__ void __launch_bounds__(sm90b::THREADS, 1)
flash_bwd_sm90(const __grid_constant__ Params p) {
    using namespace sm90b;
    using L = Layout<D>;
    typedef typename Elem<E>::storage S;
    static_assert(Elem<E>::is16 && (D == 64 || D == 128), "float16 / bfloat16, head dim 64 or 128");
    constexpr int NS = BM / 2;       // Sᵀ / dPᵀ accumulator registers per lane: [64, BM]
    constexpr int NKV = D / 2;       // dK / dV accumulator registers per lane: [64, D]
    constexpr int NQ = PANEL_COLS / 2;   // dQ slice accumulator registers per lane: [BM, 64]

    extern __shared__ unsigned char smem_raw[];
    u32 smem_given;   // the launcher sizes the launch: stop loudly if it disagrees with Layout
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    if (smem_given < L::BYTES + 1024) __trap();
    const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;   // swizzled panels: 1024-aligned
    unsigned char* smem_gen = smem_raw + (smem - smem_addr(smem_raw));
    const u32 k_smem = smem + L::K, v_smem = smem + L::V, q_smem = smem + L::Q;
    const u32 do_smem = smem + L::DO, ds_smem = smem + L::DS;
    const u32 kv_full = smem + L::BARS;                 // K, V tiles landed
    const u32 qdo_full = kv_full + 8;                   // [NBUF]: Q and dO tiles of the stage landed
    const u32 qdo_empty = qdo_full + 8 * NBUF;          // [NBUF]: both consumers are done with them

    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const int n0 = n_block * BN;
    int m_first, m_count;
    query_tile_range<WINDOW>(p, n0, &m_first, &m_count);
    const int steps = m_count * p.h_per_hk;             // (query head of the group, query tile)

    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < NBUF; ++s) {
            mbar_init(qdo_full + 8 * s, 1);
            mbar_init(qdo_empty + 8 * s, 2);     // one arrival per consumer warpgroup
        }
        mbar_fence_init();
    }
    __syncthreads();   // barriers initialised before anyone waits on them

    if (wg == 0) {
        // ================================ producer ================================
        regs_release<PRODUCER_REGS>();
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
    float* lse_smem = (float*)(smem_gen + L::ROWS) + cw * 2 * BM;   // [BM] lse·log2 e of the step
    float* dsum_smem = lse_smem + BM;                                // [BM] D of the step
    const bool dq_cols = cw * PANEL_COLS < D;              // this consumer computes a dQ slice

    float dk_acc[NKV], dv_acc[NKV];   // dK, dV [64 keys, D], fp32
#pragma unroll
    for (int i = 0; i < NKV; ++i) dk_acc[i] = dv_acc[i] = 0.f;

    mbar_wait(kv_full, 0);
    for (int st = 0; st < steps; ++st) {
        const int head = kv_head * p.h_per_hk + st / m_count;
        const int m0 = (m_first + st % m_count) * BM;
        const int s = st % NBUF;
        const u32 q_tile = q_smem + s * L::Q_TILE, do_tile = do_smem + s * L::Q_TILE;
        const i64 bh_row = ((i64)batch * p.h + head) * p.s_q;   // [b, h, s_q] row base

        // lse·log2 e and D of the step's query rows into this consumer's smem; rows past s_q and
        // rows that saw no key in the forward (lse = -inf) get +inf, so their P is exactly 0
        if (t < BM) {
            const int i = m0 + t;
            float lse = i < p.s_q ? p.lse[bh_row + i] : CF_INF;
            lse_smem[t] = lse == -CF_INF ? CF_INF : lse * CF_LOG2E;
            dsum_smem[t] = i < p.s_q ? p.dsum[bh_row + i] : 0.f;
        }

        // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ  [64 keys, BM], fp32
        float s_acc[NS], dp_acc[NS];
        mbar_wait(qdo_full + 8 * s, (st / NBUF) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 off = (kk % 4) * 32;    // 16 columns = 32 bytes within a 128-byte panel row
            wgmma_ss<E, BM>(s_acc, smem_desc(k_wg + (kk / 4) * L::KV_PANEL + off, 16, 1024),
                            smem_desc(q_tile + (kk / 4) * L::Q_PANEL + off, 16, 1024), kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 off = (kk % 4) * 32;
            wgmma_ss<E, BM>(dp_acc, smem_desc(v_wg + (kk / 4) * L::KV_PANEL + off, 16, 1024),
                            smem_desc(do_tile + (kk / 4) * L::Q_PANEL + off, 16, 1024), kk > 0);
        }
        wgmma_commit();
        named_bar_sync(WG_BAR + cw, 128);     // lse / D of the step are in shared memory
        wgmma_wait<0>();
        fence_regs<NS>(s_acc);
        fence_regs<NS>(dp_acc);

        // ---- Pᵀ = exp2(Sᵀ·scale·log2 e − lse·log2 e), masked; dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale
        bool need_mask = n0 + BN > p.s_k;
        if (WINDOW)
            need_mask |= n0 + BN - 1 > m0 + p.diag_offset + p.window_right ||
                         n0 < m0 + BM - 1 + p.diag_offset - p.window_left;
        u32 p_frag[NS / 2], ds_frag[NS / 2];
#pragma unroll
        for (int i = 0; i < NS; i += 2) {
            const int col = (i / 4) * 8 + col_in_8;          // query rows m0 + col, + 1
            const int key = key0 + ((i % 4) >= 2 ? 8 : 0);
            float pv[2], dsv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float pe = fast_exp2(s_acc[i + e] * p.scale_log2 - lse_smem[col + e]);
                if (need_mask) {
                    const int qi = m0 + col + e, diag = qi + p.diag_offset;
                    bool keep = key < p.s_k;
                    if (WINDOW) keep = keep && key <= diag + p.window_right && key >= diag - p.window_left;
                    if (!keep) pe = 0.f;
                }
                pv[e] = pe;
                dsv[e] = pe * (dp_acc[i + e] - dsum_smem[col + e]) * p.scale;
            }
            p_frag[i / 2] = pack2<E>(pv[0], pv[1]);
            ds_frag[i / 2] = pack2<E>(dsv[0], dsv[1]);
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

        wgmma_wait<0>();
        fence_regs<NKV>(dv_acc);
        fence_regs<NKV>(dk_acc);
        if (t == 0) mbar_arrive(qdo_empty + 8 * s);   // Q, dO of stage s no longer needed here
        // Both consumers' dSᵀ rows are written (and, two steps back, the other buffer's dQ
        // product has completed in both: each passed this barrier one step ago after it).
        named_bar_sync(DS_BAR, 256);

        // ---- dQ[BM, 64 columns from 64·cw] = dS K over the block's 128 keys; both operands
        //      MN-major: dsT_smem (LBO unused: BM = one panel), K (LBO = bytes between panels)
        if (dq_cols) {
            float dq_acc[NQ];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_ss_tt<E, PANEL_COLS>(dq_acc, smem_desc(ds_tile + kk * 2048, L::DS_TILE, 1024),
                                           smem_desc(k_smem + cw * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024),
                                           kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs<NQ>(dq_acc);
            float* dq_bh = p.dq_accum + (bh_row * D);      // [s_q, d] float32 of this (batch, head)
#pragma unroll
            for (int i = 0; i < NQ; i += 4) {
                const int col = cw * PANEL_COLS + (i / 4) * 8 + col_in_8;
                const int r0 = m0 + row_in_wg;
                if (r0 < p.s_q) red_add_v2(dq_bh + (i64)r0 * D + col, dq_acc[i], dq_acc[i + 1]);
                if (r0 + 8 < p.s_q) red_add_v2(dq_bh + (i64)(r0 + 8) * D + col, dq_acc[i + 2], dq_acc[i + 3]);
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
