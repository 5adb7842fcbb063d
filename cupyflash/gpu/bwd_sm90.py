"""Hopper (sm_90a) backward main kernel (flash_bwd_sm90, kernels_cu/hopper/bwd.cu): launch. Variants,
coverage and shared memory: plan_bwd_sm90.py.
"""
from __future__ import annotations

from typing import Optional

import cupy

from . import compile, device, params, tma
from .plan_bwd_sm90 import BIAS_TMA, BM, SPLIT_D, THREADS, Sm90BwdVariant, det_sched, dq_semaphores
from .variants import DTYPE_NAMES


def launch(variant: Sm90BwdVariant, prm, pre_grid, q, k, v, dout, dev_id,
           num_sms: int, varlen=None, bias=None) -> Optional[str]:
    """Run pre, the Hopper main kernel and the dQ conversion with the Params record ``prm``
    (pointers, strides, sizes filled by bwd.backward; ``pre_grid``: the portable
    flash_bwd_pre's, for O rows that are not 16-byte aligned). Returns None, launching nothing,
    when a base address is not 16-byte aligned (the caller runs the portable kernels).

    ``varlen`` = (sequences, max_seqlen_k) for a VARLEN variant: q, k, v, dout are the packed
    [1, total, heads, d] tensors, ``prm`` has cu_seqlens, b = 1, s_q / s_k = the totals (what the
    helper kernels see); the main kernel's record gets b = sequences and num_n_blocks = the key
    tiles of the longest sequence. ``bias``: the bias operand of a BIAS_TMA variant.

    A DET variant allocates its own workspace: one float32 accumulator (zeroed by pre, as in
    atomic mode: ``prm`` is copied with deterministic = 0, which the Hopper kernels do not read
    otherwise) followed by its int32 dQ semaphores (plan_bwd_sm90.dq_semaphores), zeroed here.
    The caller then allocates no accumulator."""
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr)
    if any(p_ % tma.TMA_ALIGN for p_ in ptrs) or int(prm["dk"]) % 4 or int(prm["dv"]) % 4:
        return None
    b, s_q, h, _ = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    if h > 65535:   # the helper kernels' grid.y
        return None
    dtype_name = DTYPE_NAMES[q.dtype]
    ws = None
    if variant.det:
        prm = prm.copy()
        prm["deterministic"] = 0   # flash_bwd_pre (O rows not aligned) zeroes the accumulator
        slab = int(prm["dq_accum_slab"])
        n_sem = dq_semaphores(slab // variant.d, (varlen[0] if variant.varlen else b) * h,
                              parts=2 if variant.d == SPLIT_D else 1)   # d = 256: one per column half
        ws = cupy.empty(slab + n_sem, cupy.float32)
        (ws.data + 4 * slab).memset_async(0, 4 * n_sem)
        prm["dq_accum"] = ws.data.ptr
    bn = variant.bn                                # keys per work tile
    for field, a, rows in (("tma_q", q, BM), ("tma_k", k, bn), ("tma_v", v, bn),
                           ("tma_do", dout, BM)):
        dims, byte_strides, box = tma.tma_tensor(a.shape, params.elem_strides(a, field), 2, rows)
        prm[field] = tma.encode(dtype_name, a.data.ptr, dims, byte_strides, box)
    if variant.bias == BIAS_TMA:
        tma.bias_tma_desc(prm, bias, box_rows=BM)
    prm["sched"] = device.sched_counter(dev_id, device.current_stream().ptr)
    main, pre, pre_portable, conv = compile.get_functions(variant, dev_id)
    num_n, pairs = -(-s_k // bn), h_k * b          # key tiles of a pair, (kv head, batch) pairs
    if variant.varlen:
        nseq, max_k = varlen
        num_n, pairs = -(-max_k // bn), h_k * nseq
    num_work = num_n * pairs
    grid = min(num_sms, num_work)
    if variant.det:   # the order of the dQ additions and the work tiles' numbering
        prm["det_sched"] = det_sched(num_n, pairs, grid)
    rec = prm.reshape(1)[0]
    main_rec = rec
    if variant.varlen:
        main_prm = prm.copy()
        main_prm["b"], main_prm["num_n_blocks"] = nseq, num_n
        main_rec = main_prm.reshape(1)[0]
    o_rows_aligned = (int(prm["o"]) % 16 == 0
                      and all(int(prm[f"o_stride_{a}"]) % 8 == 0 for a in "bsh"))
    if o_rows_aligned:
        pre((-(-s_q // (256 // (variant.d // 8))), h, b), (256, 1, 1), (rec,))
    else:
        pre_portable(pre_grid, (256, 1, 1), (rec,))
    main((grid, 1, 1), (THREADS, 1, 1), (main_rec,), shared_mem=variant.smem_bytes)
    conv((-(-s_q // (256 // (variant.d // 4))), h, b), (256, 1, 1), (rec,))
    del ws   # (freed into the stream-ordered pool after the launches above)
    return variant.name
