"""Hopper (sm_90a) dbias kernel (flash_bwd_dbias_sm90, kernels_cu/hopper/dbias.cu): launch. Variants,
coverage and work decomposition: plan_dbias_sm90.py.
"""
from __future__ import annotations

from typing import Optional

from . import compile, device, params, tma
from .plan_dbias_sm90 import BM, BN, THREADS, Sm90DbiasVariant, bases_aligned, num_work
from .variants import DTYPE_NAMES


def bases_aligned(*arrays) -> bool:
    """Whether every array's base address is one TMA can take (16-byte aligned): q, k, v, dout
    and the bias operand, checked by the launcher before it picks this kernel and by launch."""
    return all(a.data.ptr % tma.TMA_ALIGN == 0 for a in arrays)


def launch(variant: Sm90DbiasVariant, prm, q, k, v, dout, bias, dev_id: int,
           num_sms: int) -> Optional[str]:
    """Run flash_bwd_dbias_sm90 with a copy of the backward's Params ``prm`` (0-d PARAMS_DTYPE
    array: pointers, strides, sizes, lse, dsum, bias, dbias and its strides filled), adding the
    tensor maps of q, k, v, dout and ``bias`` (the bias operand, [b', h', s_q, s_k]) for this
    kernel's tiles and the stream's work-tile counter. Returns None, launching nothing, when a
    base address is not 16-byte aligned (the caller runs flash_bwd_dbias)."""
    if not bases_aligned(q, k, v, dout, bias):
        return None
    prm = prm.copy()
    dtype_name = DTYPE_NAMES[q.dtype]
    for field, a, rows in (("tma_q", q, BM), ("tma_k", k, BN), ("tma_v", v, BN),
                           ("tma_do", dout, BM)):
        dims, byte_strides, box = tma.tma_tensor(a.shape, params.elem_strides(a, field), 2, rows)
        prm[field] = tma.encode(dtype_name, a.data.ptr, dims, byte_strides, box)
    tma.bias_tma_desc(prm, bias, box_rows=BM)
    prm["sched"] = device.sched_counter(dev_id, device.current_stream().ptr)
    planes = ((int(prm["b"]) if int(prm["dbias_stride_b"]) else 1)
              * (int(prm["h"]) if int(prm["dbias_stride_h"]) else 1))
    work = num_work(int(prm["s_q"]), int(prm["s_k"]), planes)
    fn = compile.get_function(variant, dev_id)
    fn((min(num_sms, work), 1, 1), (THREADS, 1, 1), (prm.reshape(1)[0],),
       shared_mem=variant.smem_bytes)
    return variant.name
