"""attention_with_kvcache's attention step on the GPU: the split-KV decode kernel (decode.Launch),
or, for multi-head calls on compute capability 9.0 that plan_decode.route_forward takes, the
Hopper forward on the cache's first n keys (ForwardRoute; the append / rotary kernel still runs
first). Apart from gpu/decode.py because it calls gpu/fwd.py, which calls decode.py for the plain
``attention`` call's split-KV route.

Why the route: on multi-head decode rows the Hopper forward read the cache faster than the decode
kernel (H100, bf16 hd 128: 64 x 4k x 32/32 3206 vs 3035 GB/s, 4 x 32k x 32/32 3181 vs 2926;
docs/kvcache.md); multi-head has no GQA packing for the decode kernel to gain.
"""
from __future__ import annotations

from . import decode, device, fwd, fwd_sm90, plan_decode
from .variants import DTYPE_NAMES


class ForwardRoute:
    """A multi-head call on the Hopper forward: the Launch's kvcache_check / kvcache_prep, then
    ``fwd.forward`` on the first n keys of the cache, n = the entries' common length after the
    append (``seqlens_const`` + new rows). Called like a decode.Launch."""

    __slots__ = ("launch", "opts", "s_new", "name", "dtype")

    def __init__(self, launch, opts, s_new):
        self.launch, self.opts, self.s_new = launch, opts, s_new
        self.name = "sm90_forward"
        self.dtype = launch.dtype

    def __call__(self, q, kc, vc, kn, vn, out, lse, cs_ptr, seqlens_const, bt_ptr, cos_ptr,
                 sin_ptr, alibi_ptr, check) -> int:
        _, _, q_att, bits = self.launch.prepare(q, kc, vc, kn, vn, cs_ptr, seqlens_const, bt_ptr,
                                                cos_ptr, sin_ptr, alibi_ptr, check)
        if bits:
            return bits
        n = max(0, min(seqlens_const + self.s_new, kc.shape[1]))
        fwd.forward(q_att, kc[:, :n], vc[:, :n], out, lse, self.opts)
        return 0


def takes(q, k_cache, v_cache, out, cache_seqlens, block_table, num_splits, max_keys, opts) -> bool:
    """plan_decode.route_forward for this call, and the Hopper forward covers the cache's first
    ``max_keys`` keys (strides, dtype, head dim, options)."""
    dev_id = device.get_device()
    cc, smem, _ = device.info(dev_id)
    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    n = min(max_keys, k_cache.shape[1])
    kv_bytes = 2 * b * n * h_k * d * k_cache.dtype.itemsize
    if not plan_decode.route_forward(cc, h, h_k, block_table is not None,
                                     cache_seqlens is not None, num_splits, kv_bytes):
        return False
    _, reason = fwd_sm90.check(q, k_cache[:, :n], v_cache[:, :n], out, opts,
                               DTYPE_NAMES[q.dtype], dev_id, smem)
    return reason is None


def attend(q, k_cache, v_cache, k_new, v_new, out, lse, *, cache_seqlens, seqlens_const,
           block_table, page_size, max_blocks, rot, opts, num_splits, max_keys, check_device):
    """One attention_with_kvcache call on the GPU: (entry, error bits); repeated calls call the
    entry (a decode.Launch, or a ForwardRoute where ``takes`` says so) with new pointers.

    q [b, s_q, h, d]; k_cache / v_cache [num_blocks, page_size, h_k, d] (a contiguous cache is
    [b, seqlen_cache, h_k, d] with page_size = seqlen_cache, max_blocks = 1, no block_table);
    k_new / v_new [b, s_new, h_k, d] or None; out [b, s_q, h, d] contiguous; lse float32
    [b, h, s_q] contiguous; cache_seqlens int32 [b] on the device or None (every entry holds
    ``seqlens_const`` keys); block_table int32 [b, max_blocks] or None; rot (cos, sin float32
    [seqlen_ro, rd / 2], interleaved, q rotated per row) or None; ``max_keys`` bounds the keys of
    any entry after the append (plans the split count); ``check_device``: run kvcache_check and
    read its bits before any write (nonzero bits: nothing launched after the check).
    """
    ent = decode.build(q, k_cache, v_cache, k_new, v_new, with_lengths=cache_seqlens is not None,
                       block_table=block_table, page_size=page_size, max_blocks=max_blocks,
                       rot=rot, opts=opts, num_splits=num_splits, max_keys=max_keys)
    if takes(q, k_cache, v_cache, out, cache_seqlens, block_table, num_splits, max_keys, opts):
        ent = ForwardRoute(ent, opts, 0 if k_new is None else k_new.shape[1])
    bits = ent(q, k_cache, v_cache, k_new, v_new, out, lse,
               0 if cache_seqlens is None else cache_seqlens.data.ptr, seqlens_const,
               0 if block_table is None else block_table.data.ptr,
               0 if rot is None else rot[0].data.ptr, 0 if rot is None else rot[1].data.ptr,
               0 if opts.alibi_slopes is None else opts.alibi_slopes.data.ptr, check_device)
    return ent, bits


__all__ = ["ForwardRoute", "takes", "attend"]
