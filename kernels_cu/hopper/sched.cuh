// cupyflash: work-tile scheduling of the persistent Hopper kernels: the per-stream work-tile
// counter (sched_draw, sched_finish), the ring through which a producer hands work-tile indices
// to its consumers (take_tile), the longest-first order of a causal grid's last tiles
// (longest_first_tail), a work tile's sequence (set_sequence: dense or varlen), and the work tiles
// themselves: the forwards' query tile (FwdTile, fwd_work_tile), the 16-bit backward's key tile
// (KeyTile, key_tile, its steps step_head / step_m0 in either order, head_rows) and the dbias
// kernel's plane tile (DbiasTile, dbias_tile, pair_of). The float32 backward keeps its own dense key tile
// (hopper/bwd_f32.cu).
#pragma once

#include "common/params.cuh"
#include "common/types.cuh"
#include "hopper/sm90.cuh"

// Work tile tile_i of a persistent block's consumers, from the ring of `ring` indices the
// scheduling thread publishes (tile_smem [ring]; mbarriers tile_full / tile_empty [ring], 8 bytes
// apart; tile_empty counts one arrival per reading thread): every lane of the calling warp reads
// the index and frees the slot itself (each read and its release in one thread's program order,
// which racecheck can follow; once per work tile). -1: no work left.
__device__ __forceinline__ int take_tile(volatile int* tile_smem, u32 tile_full, u32 tile_empty,
                                         int tile_i, int ring) {
    const int ts = tile_i % ring;
    mbar_wait(tile_full + 8 * ts, (tile_i / ring) & 1);
    const int w = tile_smem[ts];
    mbar_arrive(tile_empty + 8 * ts);
    return w;
}

// The next work-tile index of a persistent block: from the per-stream counter sched [2] (the
// scheduler's atomic, dynamic order), or without one (sched null) i · grid + block, the i-th
// static draw; `drawn` counts this block's draws.
__device__ __forceinline__ int sched_draw(unsigned int* sched, int& drawn) {
    const int w = sched ? (int)atomicAdd(sched, 1u) : (int)blockIdx.x + drawn * (int)gridDim.x;
    ++drawn;
    return w;
}

// The persistent kernels' work-tile counter sched [2] (drawn index, finished blocks): called
// once per block after its last draw. Every block has drawn its last index before it counts
// itself finished, so the last one may zero the counter for the next launch on the stream.
__device__ __forceinline__ void sched_finish(unsigned int* sched) {
    __threadfence();
    if (atomicAdd(sched + 1, 1u) == gridDim.x - 1) {
        sched[0] = 0;
        sched[1] = 0;
        __threadfence();
    }
}

// Causal / window work tiles differ in length, and a persistent grid ends with its last block:
// the last work tiles, those of the last T groups (T·m >= two waves of the grid; m tiles per
// group, drawn in order j = 0 .. m − 1 its j-th longest), are drawn longest first across those
// groups (every group's tile 0, then every group's tile 1, ...) instead of group by group. The
// w-th tile drawn -> its index in group order (a bijection of [0, m · groups)). Groups: (head,
// batch) pairs of query tiles in the forwards, (kv head, batch) pairs of key tiles in
// hopper/bwd_f32.cu.
__device__ __forceinline__ int longest_first_tail(int w, int m, int groups, int grid) {
    const int tail_groups = min(groups, (2 * grid + m - 1) / m);
    const int tail0 = (groups - tail_groups) * m;               // the tail's first tile
    if (w < tail0) return w;
    const int i = w - tail0;                                    // i-th tile of the tail
    return tail0 + (i % tail_groups) * m + i / tail_groups;     // group i % T, its tile i / T
}

// The sequence a work tile of the forward or backward reads (FwdTile and KeyTile name these
// fields alike): lengths s_q, s_k, diagonal offset diag (row i's diagonal key is i + diag), first
// packed rows q_row / k_row and the tensor maps' batch coordinate tma_b. Dense: the batch entry
// wt.batch of [b, s, h, d] tensors. VARLEN: packed sequence z = wt.batch, rows cu_seqlens[z] ..
// cu_seqlens[z + 1] of the [1, total, h, d] tensors, causal / window aligned per sequence.
template <bool VARLEN, typename WT>
__device__ __forceinline__ void set_sequence(const Params& p, WT& wt) {
    if constexpr (VARLEN) {
        wt.q_row = p.cu_seqlens_q[wt.batch];
        wt.k_row = p.cu_seqlens_k[wt.batch];
        wt.s_q = p.cu_seqlens_q[wt.batch + 1] - wt.q_row;
        wt.s_k = p.cu_seqlens_k[wt.batch + 1] - wt.k_row;
        wt.diag = p.varlen_bottom_right ? wt.s_k - wt.s_q : 0;
        wt.tma_b = 0;
    } else {
        wt.q_row = wt.k_row = 0;
        wt.s_q = p.s_q;
        wt.s_k = p.s_k;
        wt.diag = p.diag_offset;
        wt.tma_b = wt.batch;
    }
}

// One work tile = BM query rows of one (batch, head): its index w runs m_block fastest (from the
// last query tile down, so the longest causal tiles start first and neighbouring blocks share K/V
// in L2), then head, then batch; with a bias broadcast over the batch (and no causal / window
// band), batch fastest, then m_block, then head. VARLEN: "batch" is packed sequence z (p.b
// sequences, rows cu_seqlens[z] .. cu_seqlens[z + 1] of [1, total, h, d] tensors; p.s_q / p.s_k
// are the totals, num_m_blocks covers the longest sequence).
struct FwdTile {
    int m0, m_last, head, batch, kv_head;
    int s_q, s_k, diag;     // this sequence's lengths; diag(i) = i + diag
    int q_row, k_row;       // first packed row of the sequence in q / out and in k / v (0 dense)
    int tma_b;              // batch coordinate of the tensor maps (0 varlen)
    int t_first, n_tiles;   // key tiles [t_first, t_first + n_tiles) meet the causal / window band
    bool rows;              // the tile has query rows (varlen: m0 < this sequence's s_q)
    int piece, parts;       // SPLIT: this piece's workspace slot; the tile's pieces (1: whole)
    int tail, piece0;       // SPLIT: the tile's counter slot (r) and its first piece
};

// Work tile w. SPLIT: w is a work item of p.split_table, whose rows from p.split_first on are
// pieces of the grid's last partial wave (piece u = w − split_first covers key tiles [first,
// first + count) of its work tile's band), so that those tiles' key loops spread over every SM.
// Every item reads its row, whole tiles too: a branch on w made the compiler take the key-tile
// loop's bounds for divergent (ring stage and wgmma descriptors in per-thread registers, moved
// to uniform ones before each product). WARP: called by whole warps (the consumers), which
// reduce the row over the warp (redux.sync: the result is known to be warp-uniform).
template <bool WINDOW, bool VARLEN, int BM, int BN, bool BIAS = false, bool SPLIT = false,
          bool WARP = false>
__device__ __forceinline__ FwdTile fwd_work_tile(const Params& p, int w) {
    FwdTile wt;
    wt.piece = wt.tail = wt.piece0 = 0;   // a whole tile
    wt.parts = 1;
    int k_first = 0, k_count = 0;
    if (SPLIT) {   // every work item, whole tiles too, reads its entry (no branch on w)
        int4 e = __ldg((const int4*)p.split_table + w);
        if (WARP) {   // (redux.sync's result lands in a uniform register)
            e.x = (int)__reduce_max_sync(0xffffffffu, (unsigned)e.x);
            e.y = (int)__reduce_max_sync(0xffffffffu, (unsigned)e.y);
            e.z = (int)__reduce_max_sync(0xffffffffu, (unsigned)e.z);
            e.w = (int)__reduce_max_sync(0xffffffffu, (unsigned)e.w);
        }
        wt.piece = w - p.split_first;        // (pieces: its workspace slot)
        wt.tail = e.x - p.split_first;       // (split tiles: their counters)
        k_first = e.y;
        k_count = e.z;
        wt.piece0 = e.w >> 6;
        wt.parts = e.w & 63;
        w = e.x;                             // the work tile
    }
    int mh = w;    // m_block fastest, then head
    if (BIAS && !WINDOW && !VARLEN && p.bias_stride_b == 0) {
        // a bias shared by the batch entries: w runs batch fastest, so blocks running at the same
        // time read the same bias rows (L2 hits: one DRAM read per tile, not one per batch entry)
        wt.batch = w % p.b;
        mh = w / p.b;
    } else {
        wt.batch = w / (p.num_m_blocks * p.h);
    }
    const int m_block = p.num_m_blocks - 1 - mh % p.num_m_blocks;
    wt.head = (mh / p.num_m_blocks) % p.h;
    wt.kv_head = wt.head / p.h_per_hk;                       // GQA / MQA
    set_sequence<VARLEN>(p, wt);
    wt.m0 = m_block * BM;
    wt.rows = wt.m0 < wt.s_q;
    wt.m_last = min(wt.m0 + BM, wt.s_q) - 1;
    // Keys the tile can see: [n_lo, n_hi); key tiles wholly outside the band are never visited.
    int n_lo = 0, n_hi = wt.s_k;
    if (WINDOW) {
        n_lo = max(0, wt.m0 + wt.diag - p.window_left);
        n_hi = min(wt.s_k, wt.m_last + wt.diag + p.window_right + 1);
    }
    wt.t_first = n_lo / BN;
    wt.n_tiles = wt.rows && n_hi > n_lo ? (n_hi + BN - 1) / BN - wt.t_first : 0;
    if (SPLIT) {   // a piece: its range of the band's key tiles (whole tiles: all of them)
        wt.t_first += k_first;
        wt.n_tiles = k_count;
    }
    return wt;
}

// Query tiles a key tile [n0, n0 + n_rows) of a sequence (s_q, s_k, diag(i) = i + diag) meets:
// rows i with i + diag - left <= j <= i + diag + right for some key j of the tile (mirror of
// plan_bwd.query_tiles)
template <int BN, int BM, bool WINDOW>
__device__ __forceinline__ void query_tile_range(const Params& p, int s_q, int s_k, int diag, int n0,
                                                 int* m_first, int* m_count) {
    const int n_rows = min(BN, s_k - n0);
    int i_lo = 0, i_hi = s_q - 1;
    if (WINDOW) {
        i_lo = max(0, n0 - diag - p.window_right);
        i_hi = min(s_q - 1, n0 + n_rows - 1 - diag + p.window_left);
    }
    *m_first = i_lo / BM;
    *m_count = i_hi >= i_lo ? i_hi / BM - i_lo / BM + 1 : 0;
}

// The 16-bit backward's work tile w (BN keys; steps of BM query rows) = n_block + num_n ·
// (kv_head + h_k · batch): key tiles fastest. VARLEN: "batch" is
// packed sequence z (p.b sequences: rows cu_seqlens[z] .. cu_seqlens[z + 1] of the [1, total, h, d]
// tensors; p.s_q / p.s_k are the totals, num_n = p.num_n_blocks covers the longest sequence's keys,
// so tiles whose keys start past their sequence's s_k have no keys: the producer skips them).
// With a bias whose dbias sums over the batch (DBIAS_SCHED_B), w = batch + b · (n_block + num_n ·
// kv_head): the blocks adding into one dbias tile run together, so its float32 lines stay in L2
// between their additions. DET (the deterministic order of hopper/bwd.cu; p.det_sched = 2g +
// rev): the (kv head, batch) pairs q = kv_head + h_k · batch in groups of g, each group's tiles
// key-tile-major, pair-minor (g pairs between two key tiles of one pair), key tiles ascending, or
// descending where rev (plan_bwd_sm90.det_work_tile mirrors this)
struct KeyTile {
    int n0, kv_head, batch;   // keys n0 .. n0 + BN (of the sequence) of kv head kv_head in batch `batch`
    int s_q, s_k, diag;       // this sequence's lengths; diag(i) = i + diag
    int q_row, k_row;         // first packed row of the sequence in q / dO and in k / v (0 dense)
    int tma_b;                // batch coordinate of the tensor maps and strides (0 varlen)
    int m_first, m_count;     // the query tiles that see them
    int steps;                // m_count x the query heads of the group
    bool keys;                // the tile has keys (varlen: n0 < this sequence's s_k)
};
template <int BN, int BM, bool WINDOW, bool VARLEN, int BIAS, bool DET = false>
__device__ __forceinline__ KeyTile key_tile(const Params& p, int w) {
    const int num_n = VARLEN ? p.num_n_blocks : (p.s_k + BN - 1) / BN;
    KeyTile wt;
    if constexpr (DET) {
        const int pairs = p.h_k * p.b, g0 = max(1, p.det_sched >> 1);
        const int first = w / (g0 * num_n) * g0;          // the group's first pair
        const int g = min(g0, pairs - first);              // its pairs (the last group may be short)
        const int wi = w - first * num_n;                  // index in the group
        const int nl = wi / g, q = first + wi % g;         // key tile (in draw order), pair
        wt.n0 = ((p.det_sched & 1) ? num_n - 1 - nl : nl) * BN;
        wt.kv_head = q % p.h_k;
        wt.batch = q / p.h_k;
    } else if (BIAS && (p.dbias_mode & DBIAS_SCHED_B)) {
        wt.batch = w % p.b;
        wt.n0 = ((w / p.b) % num_n) * BN;
        wt.kv_head = w / p.b / num_n;
    } else {
        wt.n0 = (w % num_n) * BN;
        wt.kv_head = (w / num_n) % p.h_k;
        wt.batch = w / num_n / p.h_k;
    }
    set_sequence<VARLEN>(p, wt);
    wt.keys = !VARLEN || wt.n0 < wt.s_k;   // dense tiles always have keys
    query_tile_range<BN, BM, WINDOW>(p, wt.s_q, wt.s_k, wt.diag, wt.n0, &wt.m_first, &wt.m_count);
    wt.steps = wt.keys ? wt.m_count * p.h_per_hk : 0;
    return wt;
}
// query head and first query row (of the sequence) of step st of a work tile. Steps run query
// head outer, query tiles ascending inside; DET (the deterministic dQ order of hopper/bwd.cu):
// query tiles outer, the group's query heads inside, query tiles ascending where the key tiles
// add in descending order (p.det_sched & 1), else descending, so that of two key tiles of one
// (batch, kv head) the one that adds first reaches every (head, query tile) they share no later
// in its own steps
template <bool DET = false>
__device__ __forceinline__ int step_head(const Params& p, const KeyTile& wt, int st) {
    if constexpr (DET) return wt.kv_head * p.h_per_hk + st % p.h_per_hk;
    return wt.kv_head * p.h_per_hk + st / wt.m_count;
}
template <int BM, bool DET = false>
__device__ __forceinline__ int step_m0(const Params& p, const KeyTile& wt, int st) {
    if constexpr (DET) {
        const int mi = st / p.h_per_hk;
        return (wt.m_first + ((p.det_sched & 1) ? mi : wt.m_count - 1 - mi)) * BM;
    }
    return (wt.m_first + st % wt.m_count) * BM;
}
// Index of the sequence's row 0 of query head `head` in the [b, h, s_q] row arrays (lse, D, the
// dQ accumulator's rows); VARLEN: [h, total_q] (p.s_q = total_q)
template <bool VARLEN>
__device__ __forceinline__ i64 head_rows(const Params& p, const KeyTile& wt, int head) {
    if constexpr (VARLEN) return (i64)head * p.s_q + wt.q_row;
    return ((i64)wt.batch * p.h + head) * p.s_q;
}

// The dbias kernel's work tile w: the [BM, BN] dbias tile (m0, n0) of plane (pb, ph), query
// tiles fastest, then key tiles, then planes (pb · planes_h + ph). The plane sums nb·nh pairs: every batch entry where dbias is
// summed over the batch (dbias_stride_b = 0), else pb alone; likewise heads.
struct DbiasTile {
    int m0, n0;        // first query row and first key of the tile
    int pb, ph;        // the plane: dbias (and bias) batch and head coordinates
    int pairs;         // (batch, head) pairs summed into the tile; 0: no row keeps a key of it
    bool need_mask;    // WINDOW: the tile crosses a band edge (P masked per element)
};
__device__ __forceinline__ int num_planes(const Params& p) {
    return (p.dbias_stride_b ? p.b : 1) * (p.dbias_stride_h ? p.h : 1);
}
template <int BM, int BN, bool WINDOW>
__device__ __forceinline__ DbiasTile dbias_tile(const Params& p, int w) {
    const int num_m = (p.s_q + BM - 1) / BM, num_n = (p.s_k + BN - 1) / BN;
    DbiasTile wt;
    wt.m0 = (w % num_m) * BM;
    wt.n0 = ((w / num_m) % num_n) * BN;
    const int plane = w / num_m / num_n, planes_h = p.dbias_stride_h ? p.h : 1;
    wt.pb = plane / planes_h;
    wt.ph = plane % planes_h;
    const int nb = p.dbias_stride_b ? 1 : p.b, nh = p.dbias_stride_h ? 1 : p.h;
    wt.pairs = nb * nh;
    wt.need_mask = false;
    if (WINDOW) {   // row i keeps key j when diag(i) − left <= j <= diag(i) + right
        const int m_last = min(wt.m0 + BM, p.s_q) - 1, n_last = min(wt.n0 + BN, p.s_k) - 1;
        if (n_last < wt.m0 + p.diag_offset - p.window_left || wt.n0 > m_last + p.diag_offset + p.window_right)
            wt.pairs = 0;
        wt.need_mask = wt.n0 + BN - 1 > wt.m0 + p.diag_offset + p.window_right ||
                       wt.n0 < wt.m0 + BM - 1 + p.diag_offset - p.window_left;
    }
    return wt;
}
// (batch, query head) of pair `it` of the tile's plane (batch outer, head inner)
__device__ __forceinline__ void pair_of(const Params& p, const DbiasTile& wt, int it, int* batch, int* head) {
    const int nh = p.dbias_stride_h ? 1 : p.h;
    *batch = p.dbias_stride_b ? wt.pb : it / nh;
    *head = p.dbias_stride_h ? wt.ph : it % nh;
}
