// cupyflash split-KV decode kernels (sm_80+, mma.sync): attention of a few query rows against a
// long key/value cache, contiguous or paged, with in-place append and rotary.
//
//   kvcache_check    one thread per batch entry: cache lengths, rotary positions and the used
//                    block-table entries against their ranges -> error bits (err[0])
//   kvcache_prep     new k / v rows written into the cache at cache_seqlens (rotary on k), and q
//                    rotated into a contiguous copy: one warp per (batch, row, head) row
//   flash_decode     one CTA per (split, kv head, batch x query-row tile). The M dimension packs
//                    every query head of the kv group times seqlen_q (row r = qi * g + head in
//                    group), padded to 16 * MT, so the group's heads share one pass over K / V.
//                    Each of the NW warps streams its own 16-key tiles through its own STAGES-deep
//                    cp.async ring (no CTA barrier in the key loop), keeps its own online softmax
//                    and O accumulator, and the warps are merged in shared memory at the end.
//                    num_splits == 1 writes out / lse; else partial (O / l, lse) into the
//                    workspace, merged by the split that finishes last (split_count: fused
//                    combine) or by flash_decode_combine.
//   flash_decode_combine  one warp per output row: lse = log Σ exp(lse_s), O = Σ exp(lse_s − lse) O_s
//
// Reads never leave the cache: lengths are clamped to the cache's capacity and block indices to
// [0, num_blocks) (the host checks the values before launch; kvcache_check flags them on the
// device for calls that skip the host read).
//
// Template arguments (cupyflash/gpu/plan_decode.py enumerates the instantiated set):
//   E       f16_t | bf16_t (the attention kernels); kvcache_prep also f32x3_t (float32 storage)
//   D       head dim (64, 128, 256) = d = d_v;  MT  16-row slabs per CTA;  NW  warps;
//   STAGES  16-key K / V tiles in each warp's ring
#include "common/mma.cuh"
#include "common/types.cuh"

// err[0] bits (also in cupyflash/gpu/plan_decode.py: ERR_*)
#define KV_ERR_LENGTH 1    // cache_seqlens (+ new rows) < 0 or > the cache's capacity
#define KV_ERR_BLOCK 2     // a used block_table entry outside [0, num_blocks)
#define KV_ERR_ROTARY 4    // a rotary position >= rotary_cos rows

// The whole host-to-kernel interface of this file; mirrored in plan_decode.DECODE_PARAMS_FIELDS
// (same order, same C types). Strides in elements.
struct DecodeParams {
    const void* q;            // [b, s_q, h, d] (strided; the rotated contiguous copy with rotary)
    void* k_cache;            // [num_blocks, page, h_k, d] (contiguous cache: num_blocks = b)
    void* v_cache;            // [num_blocks, page, h_k, d]
    void* o;                  // [b, s_q, h, d]
    float* lse;               // [b, h, s_q] contiguous
    float* o_part;            // [splits, b, s_q, h, D] float32 (split path), or null
    float* lse_part;          // [splits, b, h, s_q] float32
    const int* cache_seqlens; // [b] keys already in the cache, or null (all seqlens_const)
    const int* block_table;   // [b, max_blocks] (strided rows), or null: contiguous cache
    const float* alibi;       // [b or 1, h] slopes, or null
    int* err;                 // [1] error bits (KV_ERR_*)
    // kvcache_prep operands
    const void* k_new;        // [b, s_new, h_k, d] (strided), or null
    const void* v_new;        // [b, s_new, h_k, d]
    const void* q_in;         // [b, s_q, h, d] the caller's q (rotary: rotated into q)
    const float* rot_cos;     // [seqlen_ro, rd / 2] float32 contiguous, or null
    const float* rot_sin;
    long long q_stride_b, q_stride_s, q_stride_h;
    long long k_stride_blk, k_stride_s, k_stride_h;   // cache strides
    long long v_stride_blk, v_stride_s, v_stride_h;
    long long o_stride_b, o_stride_s, o_stride_h;
    long long kn_stride_b, kn_stride_s, kn_stride_h;  // k_new
    long long vn_stride_b, vn_stride_s, vn_stride_h;  // v_new
    long long qi_stride_b, qi_stride_s, qi_stride_h;  // q_in
    long long bt_stride_b;
    long long alibi_stride_b;
    int b, s_q, h, h_k, g, d;
    int s_new;                // new rows appended per batch entry (0: none)
    int page_size;            // keys per page (contiguous cache: its seqlen)
    int num_blocks;           // pages in the cache (contiguous: b)
    int max_blocks;           // block_table columns (contiguous: 1)
    int capacity;             // keys one batch entry can hold: page_size * max_blocks
    int seqlens_const;        // cache length of every entry when cache_seqlens is null
    int num_splits;
    int num_m_tiles;          // ceil(s_q * g / (16 MT))
    int window_left;          // -1 unbounded
    int window_right;         // -1 unbounded
    int bottom_right;         // 1: diag(qi) = qi + seqlen_k - s_q; 0: diag(qi) = qi
    int rot_dim;              // rotary dims (0: off); rot_interleaved: pairs (2j, 2j+1), else (j, j + rd/2)
    int rot_interleaved;
    int rot_q_per_row;        // 1: q row i rotated at position cache_seqlens + i; 0: all at cache_seqlens
    int seqlen_ro;            // rows of rot_cos / rot_sin
    int head_fastest;         // grid order: 1 (kv head, split, batch x row tile), 0 (split, kv head, ...)
    int pad1;
    unsigned int* split_count;   // [h_k * b * num_m_tiles] splits finished per CTA group, zero before
                                 // and after a launch; null: flash_decode_combine merges the splits
    float scale_log2;         // scale * log2(e)
    float softcap_pre;        // scale / softcap (0: off)
    float softcap_post;       // softcap * log2(e)
    float pad0;
};

__device__ __forceinline__ int cache_len(const DecodeParams& p, int batch) {
    return p.cache_seqlens ? p.cache_seqlens[batch] : p.seqlens_const;
}

// Page (block) of key position `pos` of batch entry `batch` and the position inside it; indices
// clamped into the cache (a bad entry reads page 0 instead of leaving the buffer).
__device__ __forceinline__ int page_of(const DecodeParams& p, int batch, int pos, int* off) {
    if (!p.block_table) { *off = pos; return batch; }
    const int col = min(max(pos / p.page_size, 0), p.max_blocks - 1);
    int blk = p.block_table[(long long)batch * p.bt_stride_b + col];
    blk = (blk < 0 || blk >= p.num_blocks) ? 0 : blk;
    *off = pos - col * p.page_size;
    return blk;
}

#include "portable/decode_parts.cuh"   // flash_decode's parts (after DecodeParams, cache_len, page_of)

// ---------------------------------------------------------------------------------------------
// kvcache_check: one thread per batch entry
// ---------------------------------------------------------------------------------------------
__global__ void kvcache_check(const DecodeParams p) {
    const int batch = blockIdx.x * blockDim.x + threadIdx.x;
    if (batch >= p.b) return;
    const int len0 = cache_len(p, batch);
    const int len = len0 + p.s_new;                 // keys attended after the append
    int bits = 0;
    if (len0 < 0 || len > p.capacity) bits |= KV_ERR_LENGTH;
    if (p.rot_dim > 0 && len0 >= 0 && len0 + max(p.s_new, p.rot_q_per_row ? p.s_q : 1) > p.seqlen_ro)
        bits |= KV_ERR_ROTARY;
    if (p.block_table && !(bits & KV_ERR_LENGTH)) {
        const int used = (len + p.page_size - 1) / p.page_size;   // block-table entries read
        for (int j = 0; j < used; ++j) {
            const int blk = p.block_table[(long long)batch * p.bt_stride_b + j];
            if (blk < 0 || blk >= p.num_blocks) { bits |= KV_ERR_BLOCK; break; }
        }
    }
    if (bits) atomicOr(p.err, bits);
}

// ---------------------------------------------------------------------------------------------
// kvcache_prep: rows of new k / v into the cache (k rotated), rows of q rotated into p.q.
// Grid x: b * (s_new * h_k + s_q * h) rows (q rows only when rotary is on), 4 warps per block;
// one warp per row, lanes over the columns. Rotation in float32, rounded once to the storage.
// ---------------------------------------------------------------------------------------------
template <typename E>
__device__ __forceinline__ float rot_value(const typename Elem<E>::storage* row, int c, float cs, float sn,
                                           const DecodeParams& p) {
    // out[c] for a rotary pair (x1, x2): x1·cos − x2·sin at the first index, x1·sin + x2·cos at the second
    const int half = p.rot_dim / 2;
    int i1, i2, j;
    bool first;
    if (p.rot_interleaved) { j = c >> 1; i1 = c & ~1; i2 = i1 + 1; first = !(c & 1); }
    else { j = c < half ? c : c - half; i1 = j; i2 = j + half; first = c < half; }
    (void)j;
    const float x1 = to_float<E>(row[i1]), x2 = to_float<E>(row[i2]);
    return first ? x1 * cs - x2 * sn : x1 * sn + x2 * cs;
}

template <typename E>
__global__ void __launch_bounds__(128) kvcache_prep(const DecodeParams p) {
    typedef typename Elem<E>::storage S;
    const long long row = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const long long kv_rows = (long long)p.b * p.s_new * p.h_k;
    const long long q_rows = p.rot_dim > 0 ? (long long)p.b * p.s_q * p.h : 0;
    const int half = p.rot_dim / 2;
    if (row < kv_rows) {
        // new key / value row (batch, i, head) -> cache position cache_seqlens[batch] + i
        const int head = (int)(row % p.h_k);
        const int i = (int)((row / p.h_k) % p.s_new);
        const int batch = (int)(row / ((long long)p.h_k * p.s_new));
        const int pos = cache_len(p, batch) + i;
        if (pos < 0 || pos >= p.capacity) return;           // flagged by kvcache_check; never written
        int off;
        const int blk = page_of(p, batch, pos, &off);
        const S* k_row = (const S*)p.k_new + batch * p.kn_stride_b + i * p.kn_stride_s + head * p.kn_stride_h;   // [d]
        const S* v_row = (const S*)p.v_new + batch * p.vn_stride_b + i * p.vn_stride_s + head * p.vn_stride_h;   // [d]
        S* kc_row = (S*)p.k_cache + blk * p.k_stride_blk + (long long)off * p.k_stride_s + head * p.k_stride_h;  // [d]
        S* vc_row = (S*)p.v_cache + blk * p.v_stride_blk + (long long)off * p.v_stride_s + head * p.v_stride_h;  // [d]
        const int rpos = min(pos, p.seqlen_ro - 1);
        for (int c = lane; c < p.d; c += 32) {
            if (c < p.rot_dim) {   // k rotated at its cache position
                const int j = p.rot_interleaved ? c >> 1 : (c < half ? c : c - half);
                const float cs = p.rot_cos[(long long)rpos * half + j], sn = p.rot_sin[(long long)rpos * half + j];
                kc_row[c] = from_float<E>(rot_value<E>(k_row, c, cs, sn, p));
            } else {
                kc_row[c] = k_row[c];
            }
            vc_row[c] = v_row[c];
        }
        return;
    }
    const long long r = row - kv_rows;
    if (r >= q_rows) return;
    // query row (batch, i, head): rotated at cache_seqlens[batch] (+ i when rot_q_per_row)
    const int head = (int)(r % p.h);
    const int i = (int)((r / p.h) % p.s_q);
    const int batch = (int)(r / ((long long)p.h * p.s_q));
    const int pos = min(max(cache_len(p, batch) + (p.rot_q_per_row ? i : 0), 0), p.seqlen_ro - 1);
    const S* q_row = (const S*)p.q_in + batch * p.qi_stride_b + i * p.qi_stride_s + head * p.qi_stride_h;   // [d]
    S* qo_row = (S*)p.q + batch * p.q_stride_b + i * p.q_stride_s + head * p.q_stride_h;                    // [d]
    for (int c = lane; c < p.d; c += 32) {
        if (c < p.rot_dim) {
            const int j = p.rot_interleaved ? c >> 1 : (c < half ? c : c - half);
            const float cs = p.rot_cos[(long long)pos * half + j], sn = p.rot_sin[(long long)pos * half + j];
            qo_row[c] = from_float<E>(rot_value<E>(q_row, c, cs, sn, p));
        } else {
            qo_row[c] = q_row[c];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// flash_decode
// ---------------------------------------------------------------------------------------------
template <typename E, int D, int MT, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32)
flash_decode(const DecodeParams p) {
    constexpr int BM = 16 * MT;                   // packed rows per CTA
    constexpr int P = DecodeSmem<D>::P, TILE = DecodeSmem<D>::TILE;
    constexpr int NT = NW * 32;
    constexpr bool QREG = D * MT <= 128;          // Q fragments kept in registers (else re-read from smem)
    static_assert(D % 64 == 0 && D <= 256, "head dims 64, 128, 192, 256");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* q_smem = (u16*)smem_raw;                              // [BM, P]
    u16* ring_smem = q_smem + BM * P;                          // [NW][STAGES][2][16, P]  (K, V)
    float* merge_smem = (float*)ring_smem;                     // after the key loop: [NW][BM][D] O, then m, l
    float* ml_smem = merge_smem + NW * BM * D;                 // [NW][BM][2]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int split = p.head_fastest ? blockIdx.y : blockIdx.x;
    const int head_k = p.head_fastest ? blockIdx.x : blockIdx.y;
    const int batch = blockIdx.z / p.num_m_tiles, m_tile = blockIdx.z % p.num_m_tiles;
    const int rows = p.s_q * p.g;                              // packed rows of this (batch, kv head)
    const int m0 = m_tile * BM;

    // Keys of this batch entry after the append, clamped to the cache
    const int len = min(max(cache_len(p, batch) + p.s_new, 0), p.capacity);
    const int diag0 = p.bottom_right ? len - p.s_q : 0;        // diag(qi) = qi + diag0

    // Key range any row of the tile keeps: [n_lo, n_hi), in 16-key tiles [t_lo, t_hi)
    const int qi_first = m0 / p.g, qi_last = (min(m0 + BM, rows) - 1) / p.g;
    int n_lo = 0, n_hi = len;
    if (p.window_left >= 0) n_lo = max(0, qi_first + diag0 - p.window_left);
    if (p.window_right >= 0) n_hi = min(len, qi_last + diag0 + p.window_right + 1);
    const int t_lo = n_lo / 16, t_all = n_hi > n_lo ? (n_hi + 15) / 16 - t_lo : 0;
    // this split's tiles (balanced), then warp w takes tiles w, w + NW, ...
    const int s_beg = t_lo + (int)((long long)t_all * split / p.num_splits);
    const int s_end = t_lo + (int)((long long)t_all * (split + 1) / p.num_splits);
    const int my_tiles = s_end - s_beg > warp ? (s_end - s_beg - warp + NW - 1) / NW : 0;

    u16* k_ring = ring_smem + warp * STAGES * 2 * TILE;        // [STAGES][16, P]
    u16* v_ring = k_ring + STAGES * TILE;                      // [STAGES][16, P]

    // Pages of this warp's tiles (paged cache), read 32 tiles ahead: lane l of blk_cur holds the
    // page of tile 32 * chunk + l, blk_nxt those of the next chunk, so no block-table read stalls
    // the ring (a contiguous cache's "page" is the batch entry)
    auto tile_key0 = [&](int tile) { return (s_beg + warp + tile * NW) * 16; };   // first key of a warp tile
    auto fetch_pages = [&](int chunk) {
        const int tile = chunk * 32 + lane;
        int off;
        return (p.block_table && tile < my_tiles) ? page_of(p, batch, tile_key0(tile), &off) : batch;
    };
    int blk_cur = fetch_pages(0), blk_nxt = fetch_pages(1), chunk_cur = 0;
    // Issue warp tile `tile` (issued in order 0, 1, 2, ...; warp-uniform) into ring slot tile % STAGES
    auto issue = [&](int tile) {
        if ((tile >> 5) != chunk_cur) { chunk_cur = tile >> 5; blk_cur = blk_nxt; blk_nxt = fetch_pages(chunk_cur + 1); }
        const int key0 = tile_key0(tile);
        const int blk = __shfl_sync(0xffffffffu, blk_cur, tile & 31);
        const int off = p.block_table ? key0 - min(key0 / p.page_size, p.max_blocks - 1) * p.page_size : key0;
        load_kv_tile<D>(k_ring + (tile % STAGES) * TILE, v_ring + (tile % STAGES) * TILE, p, blk, off, head_k, key0, len, lane);
    };

    // Start this warp's ring before Q is even loaded: STAGES − 1 tiles in flight
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < my_tiles) issue(s);
        cp_async_commit();
    }

    // Q tile [BM, D]: packed row r = qi * g + head in group; rows past the end are zeros
    {
        constexpr int CPR = D / 8;
        for (int c = tid; c < BM * CPR; c += NT) {
            const int r = c / CPR, col = (c % CPR) * 8;
            const int pr = m0 + r;
            uint4 val = make_uint4(0, 0, 0, 0);
            if (pr < rows) {
                const int qi = pr / p.g, head = head_k * p.g + pr % p.g;
                val = *(const uint4*)((const u16*)p.q + batch * p.q_stride_b + qi * p.q_stride_s + head * p.q_stride_h + col);
            }
            *(uint4*)(q_smem + r * P + col) = val;
        }
    }
    __syncthreads();   // the Q tile is complete before any warp reads its fragments

    // Per-row constants of this lane's rows (mt, half): diagonal and ALiBi slope (base 2)
    int diag_r[MT][2];
    float slope_r[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int pr = min(m0 + mt * 16 + g + half * 8, rows - 1);
            diag_r[mt][half] = pr / p.g + diag0;
            slope_r[mt][half] = p.alibi ? p.alibi[batch * p.alibi_stride_b + head_k * p.g + pr % p.g] * CF_LOG2E : 0.f;
        }

    u32 q_frag[QREG ? MT : 1][QREG ? D / 16 : 1][4];           // A operand: Q [16 rows, 16 cols] per (mt, kk)
    if constexpr (QREG) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ldmatrix_x4(q_frag[mt][kk], q_smem + (mt * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
    }

    float o_frag[MT][D / 8][4];                    // unnormalized O [16 rows, D] per slab
    float m_row[MT][2], l_row[MT][2];              // running max (base-2 units), partial denominator
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) o_frag[mt][j][0] = o_frag[mt][j][1] = o_frag[mt][j][2] = o_frag[mt][j][3] = 0.f;
        m_row[mt][0] = m_row[mt][1] = -CF_INF;
        l_row[mt][0] = l_row[mt][1] = 0.f;
    }
    const bool need_mask_any = p.window_left >= 0 || p.window_right >= 0;

    for (int it = 0; it < my_tiles; ++it) {
        // next tile into the slot freed by the previous iteration (always commit: counts stay right)
        {
            const int nx = it + STAGES - 1;
            if (nx < my_tiles) issue(nx);
            cp_async_commit();
        }
        cp_async_wait<STAGES - 1>();
        __syncwarp();   // tile `it` landed for every lane of this warp (its own ring: no CTA barrier)
        const u16* k_smem = k_ring + (it % STAGES) * TILE;     // [16, P]
        const u16* v_smem = v_ring + (it % STAGES) * TILE;     // [16, P]
        const int key0 = tile_key0(it);

        // S = Q K(tile)ᵀ   [16 rows, 16 keys] per slab, fp32
        float s_frag[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < 2; ++j) s_frag[mt][j][0] = s_frag[mt][j][1] = s_frag[mt][j][2] = s_frag[mt][j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 k_frag[4];                         // B: keys 0..7 (k_frag 0, 1) and 8..15 (2, 3) x k16
            ldmatrix_x4(k_frag, k_smem + ((lane & 7) + (lane >> 4) * 8) * P + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 a_tmp[4];
                const u32* a = a_tmp;
                if constexpr (QREG) a = q_frag[mt][kk];
                else ldmatrix_x4(a_tmp, q_smem + (mt * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
                mma16816<E>(s_frag[mt][0], a, k_frag[0], k_frag[1]);
                mma16816<E>(s_frag[mt][1], a, k_frag[2], k_frag[3]);
            }
        }

        // Scores in base-2 units: softcap c·tanh(s/c) or scale·s; ALiBi −slope·|diag − j|;
        // −inf past the keys and outside the window
        const bool edge = key0 + 16 > len || need_mask_any;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float s = s_frag[mt][j][e];
                    s = p.softcap_post > 0.f ? p.softcap_post * tanhf(s * p.softcap_pre) : s * p.scale_log2;
                    const int col = key0 + j * 8 + 2 * t + (e & 1);
                    const int diag = diag_r[mt][e >> 1];
                    if (p.alibi) s -= slope_r[mt][e >> 1] * fabsf((float)(diag - col));
                    if (edge) {
                        bool keep = col < len;
                        if (p.window_left >= 0) keep = keep && col >= diag - p.window_left;
                        if (p.window_right >= 0) keep = keep && col <= diag + p.window_right;
                        if (!keep) s = -CF_INF;
                    }
                    s_frag[mt][j][e] = s;
                }

        // Online softmax per row: m_new = max(m, rowmax S); O, l *= 2^(m − m_new); P = 2^(S − m_new)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float mx = fmaxf(m_row[mt][half], fmaxf(fmaxf(s_frag[mt][0][2 * half], s_frag[mt][0][2 * half + 1]),
                                                        fmaxf(s_frag[mt][1][2 * half], s_frag[mt][1][2 * half + 1])));
                mx = quad_max(mx);                                      // row max over the quad
                const float m_use = mx == -CF_INF ? 0.f : mx;           // all masked so far: no inf − inf
                const float alpha = fast_exp2(m_row[mt][half] - m_use);
                m_row[mt][half] = mx;
                float row_sum = 0.f;
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const float p0 = fast_exp2(s_frag[mt][j][2 * half] - m_use);
                    const float p1 = fast_exp2(s_frag[mt][j][2 * half + 1] - m_use);
                    s_frag[mt][j][2 * half] = p0;
                    s_frag[mt][j][2 * half + 1] = p1;
                    row_sum += p0 + p1;
                }
                l_row[mt][half] = l_row[mt][half] * alpha + row_sum;
#pragma unroll
                for (int j = 0; j < D / 8; ++j) {
                    o_frag[mt][j][2 * half] *= alpha;
                    o_frag[mt][j][2 * half + 1] *= alpha;
                }
            }

        // O += P V(tile): P [16 rows, 16 keys] packed to 16-bit as the A operand
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 p_frag[4];
            p_frag[0] = pack2<E>(s_frag[mt][0][0], s_frag[mt][0][1]);
            p_frag[1] = pack2<E>(s_frag[mt][0][2], s_frag[mt][0][3]);
            p_frag[2] = pack2<E>(s_frag[mt][1][0], s_frag[mt][1][1]);
            p_frag[3] = pack2<E>(s_frag[mt][1][2], s_frag[mt][1][3]);
#pragma unroll
            for (int dd = 0; dd < D / 16; ++dd) {
                u32 v_frag[4];                     // B: keys 0..15 x columns dd*16.. (transposed load)
                ldmatrix_x4_trans(v_frag, v_smem + ((lane & 7) + ((lane >> 3) & 1) * 8) * P + dd * 16 + (lane >> 4) * 8);
                mma16816<E>(o_frag[mt][2 * dd], p_frag, v_frag[0], v_frag[1]);
                mma16816<E>(o_frag[mt][2 * dd + 1], p_frag, v_frag[2], v_frag[3]);
            }
        }
        __syncwarp();   // every lane finished reading this slot before the next iteration refills it
    }

    // Merge the warps: each writes its unnormalized O, m and l; then O = Σ_w 2^(m_w − m) O_w,
    // l = Σ_w 2^(m_w − m) l_w with m = max_w m_w
    cp_async_wait<0>();
    __syncthreads();   // every warp left its ring (the merge area overlays the rings)
    {
        float* o_w = merge_smem + warp * BM * D;   // [BM, D]
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = mt * 16 + g + half * 8;
                const float l = quad_sum(l_row[mt][half]);
                if (t == 0) {
                    ml_smem[(warp * BM + r) * 2] = m_row[mt][half];
                    ml_smem[(warp * BM + r) * 2 + 1] = l;
                }
#pragma unroll
                for (int j = 0; j < D / 8; ++j)
                    *(float2*)(o_w + r * D + j * 8 + 2 * t) = make_float2(o_frag[mt][j][2 * half], o_frag[mt][j][2 * half + 1]);
            }
    }
    __syncthreads();   // all warps' partial O, m, l are in shared memory
    float* fin_smem = (float*)q_smem;              // [BM][NW + 2]: per-warp weights, 1 / l, lse  (Q no longer read)
    if (tid < BM) {
        const int r = tid;
        float m = -CF_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) m = fmaxf(m, ml_smem[(w * BM + r) * 2]);
        const float m_use = m == -CF_INF ? 0.f : m;
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float wt = fast_exp2(ml_smem[(w * BM + r) * 2] - m_use);
            fin_smem[r * (NW + 2) + w] = wt;
            l += wt * ml_smem[(w * BM + r) * 2 + 1];
        }
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
        fin_smem[r * (NW + 2) + NW] = inv_l;
        const float lse = l > 0.f ? (m_use + log2f(l)) * CF_LN2 : -CF_INF;   // natural log
        fin_smem[r * (NW + 2) + NW + 1] = lse;
        const int pr = m0 + r;
        if (pr < rows) {
            const int qi = pr / p.g, head = head_k * p.g + pr % p.g;
            if (p.o_part)
                p.lse_part[(((long long)split * p.b + batch) * p.h + head) * p.s_q + qi] = lse;
            else
                p.lse[((long long)batch * p.h + head) * p.s_q + qi] = lse;
        }
    }
    __syncthreads();   // the per-row weights are ready
    // O / l per element: the split's partial (float32) or the output (q's dtype)
    for (int c = tid; c < BM * (D / 2); c += NT) {
        const int r = c / (D / 2), col = (c % (D / 2)) * 2;
        const int pr = m0 + r;
        if (pr >= rows || col >= p.d) continue;
        float o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float wt = fin_smem[r * (NW + 2) + w];
            const float2 v = *(const float2*)(merge_smem + (w * BM + r) * D + col);
            o0 += wt * v.x;
            o1 += wt * v.y;
        }
        const float inv_l = fin_smem[r * (NW + 2) + NW];
        o0 *= inv_l; o1 *= inv_l;
        const int qi = pr / p.g, head = head_k * p.g + pr % p.g;
        if (p.o_part) {
            float* dst = p.o_part + ((((long long)split * p.b + batch) * p.s_q + qi) * p.h + head) * D + col;
            *(float2*)dst = make_float2(o0, o1);
        } else {
            u16* dst = (u16*)p.o + batch * p.o_stride_b + qi * p.o_stride_s + head * p.o_stride_h + col;
            *(u32*)dst = pack2<E>(o0, o1);
        }
    }
    if (!p.o_part || !p.split_count) return;

    decode_combine<E, D, MT, NW>(p, merge_smem, tid, warp, lane, head_k, batch, m_tile, rows, m0);
}

// ---------------------------------------------------------------------------------------------
// flash_decode_combine: one warp per output row (batch, qi, head); lanes over D columns.
//   lse = log Σ_s exp(lse_s);  O = Σ_s exp(lse_s − lse) O_s   (splits without keys: lse_s = −inf)
// ---------------------------------------------------------------------------------------------
template <typename E, int D>
__global__ void __launch_bounds__(128) flash_decode_combine(const DecodeParams p) {
    const long long row = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);   // (batch, qi, head)
    const int lane = threadIdx.x & 31;
    if (row >= (long long)p.b * p.s_q * p.h) return;
    const int head = (int)(row % p.h);
    const int qi = (int)((row / p.h) % p.s_q);
    const int batch = (int)(row / ((long long)p.h * p.s_q));
    const long long split_lse = (long long)p.b * p.h * p.s_q;       // lse_part stride of one split
    const long long split_o = (long long)p.b * p.s_q * p.h * D;      // o_part stride of one split
    const float* lse_in = p.lse_part + ((long long)batch * p.h + head) * p.s_q + qi;
    const float* o_in = p.o_part + (((long long)batch * p.s_q + qi) * p.h + head) * D;
    // m = max_s lse_s (lanes over splits, then the warp)
    float m = -CF_INF;
    for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, lse_in[s * split_lse]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float m_use = m == -CF_INF ? 0.f : m;
    // sum = Σ_s exp(lse_s − m)
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += 32) sum += fast_exp2((lse_in[s * split_lse] - m_use) * CF_LOG2E);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float lse = sum > 0.f ? m_use + logf(sum) : -CF_INF;
    if (lane == 0) p.lse[((long long)batch * p.h + head) * p.s_q + qi] = lse;
    // O = Σ_s exp(lse_s − lse) O_s, two columns per lane and step
    constexpr int PER = D / 64;                   // column pairs per lane
    float acc[PER][2];
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i][0] = acc[i][1] = 0.f;
    if (sum > 0.f) {
        for (int s = 0; s < p.num_splits; ++s) {
            const float ls = lse_in[s * split_lse];
            if (ls == -CF_INF) continue;          // a split without keys adds nothing
            const float wt = fast_exp2((ls - lse) * CF_LOG2E);
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const float2 v = *(const float2*)(o_in + s * split_o + (i * 32 + lane) * 2);
                acc[i][0] += wt * v.x;
                acc[i][1] += wt * v.y;
            }
        }
    }
    u16* dst = (u16*)p.o + batch * p.o_stride_b + qi * p.o_stride_s + head * p.o_stride_h;   // [d]
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int col = (i * 32 + lane) * 2;
        if (col < p.d) *(u32*)(dst + col) = pack2<E>(acc[i][0], acc[i][1]);
    }
}
