"""The kernels' one argument, ``struct Params`` (kernels_cu/common/params.cuh), mirrored as a NumPy
structured dtype, and the pure helpers that fill its sizes, scalars and strides. NumPy only: the
planners build Params records without a GPU.
"""
from __future__ import annotations

import numpy as np


# ------------------------------------------------------------------------------------------
# Params: mirror of `struct Params` in kernels_cu/common/params.cuh (same order, same C types).
# ------------------------------------------------------------------------------------------
PARAMS_FIELDS = (
    [(n, np.uint64) for n in ("q", "k", "v", "o", "lse", "alibi")]
    + [(f"{t}_stride_{a}", np.int64) for t in "qkvo" for a in "bsh"]
    + [("alibi_stride_b", np.int64)]
    + [(n, np.int32) for n in ("b", "h", "h_k", "h_per_hk", "s_q", "s_k", "d", "d_v",
                               "window_left", "window_right", "diag_offset", "vec_ok",
                               "num_m_blocks", "det_sched")]
    + [(n, np.float32) for n in ("scale_log2", "softcap_pre", "softcap_post", "pad0")]
    # bias / mask / varlen (GENERAL instantiations only; null pointer = feature off)
    + [(n, np.uint64) for n in ("bias", "mask", "cu_seqlens_q", "cu_seqlens_k", "dbias_accum",
                                "dbias")]
    + [(f"{t}_stride_{a}", np.int64) for t in ("bias", "mask", "dbias") for a in "bhqk"]
    + [("dbias_slab", np.int64)]
    + [(n, np.int32) for n in ("bias_f32", "dbias_mode", "varlen_bottom_right", "bias_pair")]
    # backward only (kernels_cu/portable/bwd.cu, planned in plan_bwd.py)
    + [(n, np.uint64) for n in ("dout", "dq", "dk", "dv", "dsum", "dq_accum")]
    + [(f"{t}_stride_{a}", np.int64) for t in ("do", "dq", "dk", "dv") for a in "bsh"]
    + [("dq_accum_slab", np.int64)]
    + [(n, np.int32) for n in ("num_n_blocks", "bn", "deterministic", "dq_slabs")]
    + [("scale", np.float32)]
    # Hopper forward only (kernels_cu/hopper/fwd.cu); then the TMA descriptors, see below
    + [("sched", np.uint64)]
    # Hopper forward SPLIT variants: the grid's last partial wave split along the keys
    + [(n, np.uint64) for n in ("split_table", "split_ws", "split_count")]
    + [(n, np.int32) for n in ("split_first", "split_pieces")]
    # float64 instantiations (f64_t): their scalars in double
    + [(n, np.float64) for n in ("scale_log2_f64", "softcap_pre_f64", "softcap_post_f64",
                                 "scale_f64")]
)


#: Hopper kernels only: 128-byte TMA descriptors (struct TmaDesc, 64-byte aligned).
PARAMS_TMA_FIELDS = ("tma_q", "tma_k", "tma_v", "tma_do", "tma_bias", "tma_o")
TMA_DESC_BYTES = 128


def _params_dtype() -> np.dtype:
    """C layout of Params: natural alignment for PARAMS_FIELDS, then the TmaDesc members at the
    next 64-byte boundary; the struct's size is a multiple of its 64-byte alignment."""
    head = np.dtype(PARAMS_FIELDS, align=True)
    names = list(head.names)
    formats = [head.fields[n][0] for n in names]
    offsets = [head.fields[n][1] for n in names]
    off = -(-head.itemsize // 64) * 64
    for n in PARAMS_TMA_FIELDS:
        names.append(n)
        formats.append((np.uint64, TMA_DESC_BYTES // 8))
        offsets.append(off)
        off += TMA_DESC_BYTES
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": off})


#: The structured dtype passed by value as the kernel's one argument (C alignment rules).
PARAMS_DTYPE = _params_dtype()
PARAMS_NBYTES = PARAMS_DTYPE.itemsize   # checked against sizeof(Params) when kernels compile
LOG2E = 1.4426950408889634


def problem_params(bm, b, s_q, s_k, h, h_k, d, d_v, scale, window_left, window_right,
                   bottom_right, softcap):
    """A Params record with the sizes / scalars of one problem filled (num_m_blocks: query
    tiles of bm rows), as every kernel family reads them."""
    unbounded = s_q + s_k
    prm = np.zeros((), PARAMS_DTYPE)
    prm["b"], prm["h"], prm["h_k"], prm["h_per_hk"] = b, h, h_k, h // h_k
    prm["s_q"], prm["s_k"], prm["d"], prm["d_v"] = s_q, s_k, d, d_v
    prm["window_left"] = window_left if window_left >= 0 else unbounded
    prm["window_right"] = window_right if window_right >= 0 else unbounded
    prm["diag_offset"] = s_k - s_q if bottom_right else 0
    prm["num_m_blocks"] = -(-s_q // bm)
    set_scalars(prm, scale, softcap)
    return prm


def sizes_and_scalars(bm, b, s_q, s_k, h, h_k, d, d_v, scale, window_left, window_right,
                      bottom_right, softcap):
    """problem_params(...) and the grid (ceil(s_q / bm), h, b) of a forward kernel with bm
    query rows per block."""
    prm = problem_params(bm, b, s_q, s_k, h, h_k, d, d_v, scale, window_left, window_right,
                         bottom_right, softcap)
    num_m = int(prm["num_m_blocks"])
    if num_m > 2**31 - 1 or h > 65535 or b > 65535:
        raise NotImplementedError(f"grid ({num_m}, {h}, {b}) exceeds CUDA's grid limits")
    return prm, (num_m, h, b)


def set_scalars(prm, scale, softcap):
    """scale · log2(e), and softcap's scale / softcap and softcap · log2(e) (0 when off), into
    the float32 fields and their float64 twins (*_f64, read by the float64 kernels); the natural
    scale into ``scale`` / ``scale_f64``."""
    prm["scale_log2"] = prm["scale_log2_f64"] = scale * LOG2E
    prm["scale"] = prm["scale_f64"] = scale
    if softcap > 0:
        prm["softcap_pre"] = prm["softcap_pre_f64"] = scale / softcap
        prm["softcap_post"] = prm["softcap_post_f64"] = softcap * LOG2E


def varlen_params(prm, total_q, total_k, window_left, window_right, bottom_right):
    """The packed-sequence fields of a varlen Params record (either kernel): s_q / s_k = the
    totals, windows unbounded past every sequence, causal / window aligned per sequence."""
    unbounded = total_q + total_k                  # past every sequence's own s_q + s_k
    prm["s_q"], prm["s_k"] = total_q, total_k
    prm["window_left"] = window_left if window_left >= 0 else unbounded
    prm["window_right"] = window_right if window_right >= 0 else unbounded
    prm["diag_offset"] = 0                         # per sequence, from varlen_bottom_right
    prm["varlen_bottom_right"] = int(bool(bottom_right))


def vec_ok(ptrs, strides, itemsize: int) -> bool:
    """True when every row start is 16-byte aligned: base pointers and all (element) strides."""
    mask = 15
    acc = 0
    for p_ in ptrs:
        acc |= p_
    for s_ in strides:
        acc |= s_ * itemsize
    return (acc & mask) == 0


def elem_strides(a, what):
    isz = a.dtype.itemsize
    st = a.strides
    if a.shape[-1] > 1 and st[-1] != isz:
        raise ValueError(f"{what}: the last dimension must be contiguous (strides {st})")
    if any(s % isz for s in st):
        raise ValueError(f"{what}: strides {st} are not multiples of the item size {isz}")
    return tuple(s // isz for s in st)


def broadcast_strides(a):
    """Element strides of a 4-D array over (b, h, s_q, s_k), 0 along its size-1 dimensions."""
    return tuple(0 if n == 1 else st // a.itemsize for n, st in zip(a.shape, a.strides))


def write_strides(prm, elem_strides):
    """Batch / sequence / head strides of q, k, v, out into the Params record; returns them."""
    flat = []
    for t, (sb, ss, sh, _) in zip("qkvo", elem_strides):
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        flat += [sb, ss, sh]
    return flat
