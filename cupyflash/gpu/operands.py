"""Launch-time operands of the forward and backward kernels (CuPy): the bias / mask / ALiBi arrays
the kernels read, written with their strides into a Params record.
"""
from __future__ import annotations

import cupy
import numpy as np

from .params import broadcast_strides, elem_strides, vec_ok


def bias_operand(bias, dtype):
    """(array, bias_f32) the kernels read for a 4-D ``bias``: the bias itself when its dtype is q's
    (``dtype``) or float32, else one float32 copy of the un-broadcast bias (documented:
    docs/choices.md). Element strides must be whole: otherwise a contiguous copy."""
    if bias.dtype == dtype or bias.dtype == np.float32:
        b = bias
    else:
        b = bias.astype(np.float32)
    if any(st % b.itemsize for st in b.strides):
        b = cupy.ascontiguousarray(b)
    return b, int(b.dtype == np.float32)


def bias_pair_ok(b, s_k) -> bool:
    """Columns (j, j + 1) of the bias operand ``b`` load as one pair: unit key stride, even s_k,
    every (row, even column) pair aligned."""
    st = broadcast_strides(b)
    return (st[3] == 1 and s_k % 2 == 0 and all(x % 2 == 0 for x in st[:3])
            and b.data.ptr % (2 * b.itemsize) == 0)


def set_bias_mask(prm, opts, dtype, operand=None):
    """Write the bias / mask pointers, strides, bias_f32 and bias_pair into Params ``prm``
    (its s_k already set); ``operand``: bias_operand(opts.bias, dtype) when already made.
    Returns the arrays that must stay alive until the launch is queued."""
    keep = []
    if opts.bias is not None:
        b, f32 = operand if operand is not None else bias_operand(opts.bias, dtype)
        prm["bias"], prm["bias_f32"] = b.data.ptr, f32
        for a, x in zip("bhqk", broadcast_strides(b)):
            prm[f"bias_stride_{a}"] = x
        prm["bias_pair"] = int(bias_pair_ok(b, int(prm["s_k"])))
        keep.append(b)
    if opts.mask is not None:
        m = opts.mask
        if m.dtype != np.bool_:
            raise ValueError(f"mask has dtype {m.dtype}, bool expected")
        prm["mask"] = m.data.ptr
        for a, st in zip("bhqk", broadcast_strides(m)):
            prm[f"mask_stride_{a}"] = st
        keep.append(m)
    return keep


def set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=False):
    """Strides, vec_ok, pointers and ALiBi slopes of the forward Params; returns arrays to keep."""
    strides = []
    for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o")):
        sb, ss, sh, _ = elem_strides(a, t)
        if zero_batch_strides:
            sb = 0
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        strides += [sb, ss, sh]
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr)
    prm["vec_ok"] = int(vec_ok(ptrs, strides, q.dtype.itemsize))
    for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse)):
        prm[n] = a.data.ptr
    return set_alibi(prm, opts.alibi_slopes, q.dtype)


def alibi_operand(alibi, dtype=np.float32):
    """(array, batch stride) the kernels read for ALiBi slopes [b or 1, h]: float32 (float64
    for float64 inputs, ``dtype``) with a unit head stride (one small copy otherwise); the batch
    stride is 0 when the slopes broadcast."""
    want = np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    if alibi.dtype != want or (alibi.shape[1] > 1 and alibi.strides[1] != want.itemsize):
        alibi = cupy.ascontiguousarray(alibi, dtype=want)
    return alibi, (alibi.strides[0] // want.itemsize if alibi.shape[0] > 1 else 0)


def set_alibi(prm, alibi, dtype=np.float32):
    """ALiBi slopes (or None) into Params ``prm`` (float64 slopes for float64 inputs,
    ``dtype``); returns the arrays to keep alive."""
    if alibi is None:
        return []
    alibi, stride_b = alibi_operand(alibi, dtype)
    prm["alibi"], prm["alibi_stride_b"] = alibi.data.ptr, stride_b
    return [alibi]
