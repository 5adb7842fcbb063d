"""The public API: attention, attention_backward, attention_vjp, attention_varlen(_backward).

Thin by design: validate (_checks), choose the backend (_interop), then call cpu.py or the GPU
launcher (_gpu), and hand the results back in the caller's array kind and layout.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional, Tuple, Union

import numpy as np

from . import _checks as ck
from . import cpu
from . import _interop
from ._interop import resolve

_LSE_DTYPE = np.float32

#: What the array arguments take: numpy.ndarray, cupy.ndarray, or an object with
#: __cuda_array_interface__ or __dlpack__ (lists and other array-likes are refused).
Array = Any
Window = Optional[Tuple[Optional[int], Optional[int]]]
Layout = Literal["bshd", "bhsd"]
Device = Literal["auto", "cpu", "gpu"]
CausalAlign = Literal["bottom_right", "top_left"]

_CAUSAL_PICTURE = """
    Causal masks (``1`` = attend) for seqlen_q = 2, seqlen_k = 5, and seqlen_q = 5, seqlen_k = 2::

        causal_align="bottom_right" (default,        causal_align="top_left"
        FlashAttention >= 2.1)                       (PyTorch is_causal)
            1 1 1 1 0                                    1 0 0 0 0
            1 1 1 1 1                                    1 1 0 0 0

            0 0                                          1 0
            0 0                                          1 1
            0 0                                          1 1
            1 0                                          1 1
            1 1                                          1 1

    A row with nothing to attend to (the first three rows above, bottom-right) gives out = 0 and
    lse = -inf, never NaN.
"""


def _run(device, arrays: dict, body):
    """``body(backend)`` on the chosen backend; host inputs under device="auto" fall back to the
    CPU implementation when the GPU kernels do not cover the call (NotImplementedError from the
    launcher, raised before any launch)."""
    backend = resolve(ck.check_device(device), arrays)
    if backend.where == "cpu" or device != "auto" or not backend.on_host:
        return _on_device(backend, body)
    try:
        return _on_device(backend, body)
    except NotImplementedError:
        return body(backend.as_cpu())


def _on_device(backend, body):
    if backend.where == "cpu" or backend.device_id == backend.xp.cuda.runtime.getDevice():
        return body(backend)
    with backend.xp.cuda.Device(backend.device_id):
        return body(backend)


# ----------------------------------------------------------------------------------------------
# Validated-call cache: validation is a function of kinds, shapes, strides, dtypes, devices and
# option values, so a call that repeats all of them (a training loop, many small calls) reuses
# its backend, sizes and Options instead of validating again. Calls with array-valued options
# (bias, mask, alibi_slopes) always take the full path.
# ----------------------------------------------------------------------------------------------
_CALLS = {}          # call signature -> (backend, dims, opts)
_CALLS_MAX = 1024


def _frozen(value):
    """A hashable stand-in for an option value that also tells 1, 1.0 and True apart."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_frozen(x) for x in value))
    return (type(value), value)


def _signature(arrays, scalars):
    """Hashable description of a call with NumPy / CuPy ``arrays`` and plain ``scalars``, or None."""
    parts = []
    cp = _interop.cupy_module()
    for x in arrays:
        t = type(x)
        if t is np.ndarray:
            parts.append((t, x.shape, x.strides, x.dtype))
        elif cp is not None and t is cp.ndarray:
            parts.append((t, x.shape, x.strides, x.dtype, x.data.device_id))
        else:  # CAI / DLPack objects: converted per call, so validated per call
            return None
    key = (tuple(parts), tuple(_frozen(s) for s in scalars))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _remember(key, entry):
    if key is not None:
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = entry


# ----------------------------------------------------------------------------------------------
# Fast path of a repeated GPU call. CuPy q, k, v whose flat key (shapes, strides, dtypes and
# devices of the three arrays, typed option values) went through the full path above once, and
# whose launch then needed nothing per call but pointers (no copy, no ALiBi, nothing empty), map
# to a _FastCall holding the launcher's cached entry and the output shapes: a hit allocates out
# and lse on the current stream and launches, skipping backend resolution, views, Options and
# the launcher's own signature key. Calls from another current device take the full path.
# ----------------------------------------------------------------------------------------------
class _NoArrayType:
    """Stands for cupy.ndarray in the fast-path type test until a GPU call has been cached."""


_FAST = {}           # _fast_key(...) -> _FastCall
_FAST_MAX = 1024
_fast_array_type = _NoArrayType
_fast_get_device = None
_fast_new = None     # cupy.ndarray: (shape, dtype) -> an uninitialized array on the current device
_LSE_NP_DTYPE = np.dtype(_LSE_DTYPE)


def _lse_dtype(dtype) -> np.dtype:
    """lse's dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else _LSE_NP_DTYPE


def _fast_key(q, k, v, causal, causal_align, window, softcap, scale, layout, device, allow_tf32):
    """Flat hashable key of a call on CuPy q, k, v: everything validation and planning read
    (types of the option values too, so 1, 1.0 and True differ). Raises TypeError for an
    unhashable option value."""
    return (q.shape, q.strides, q.dtype, q.data.device_id,
            k.shape, k.strides, k.dtype, k.data.device_id,
            v.shape, v.strides, v.dtype, v.data.device_id,
            causal.__class__, causal, causal_align.__class__, causal_align,
            None if window is None else _frozen(window),
            softcap.__class__, softcap, scale.__class__, scale, layout.__class__, layout,
            device.__class__, device, allow_tf32.__class__, allow_tf32)


class _FastCall:
    """One validated, planned GPU call signature: out [caller's layout] and lse [b, h, s_q]
    allocated per call, the launcher's cached ``_Launch`` entry launched with their pointers."""

    __slots__ = ("device_id", "entry", "out_shape", "dtype", "lse_shape", "lse_dtype")

    def __init__(self, device_id, entry, out_shape, dtype, lse_shape):
        self.device_id = device_id
        self.entry = entry
        self.out_shape = out_shape
        self.dtype = dtype
        self.lse_shape = lse_shape
        self.lse_dtype = _lse_dtype(dtype)

    def __call__(self, q, k, v):
        out = _fast_new(self.out_shape, self.dtype)
        lse = _fast_new(self.lse_shape, self.lse_dtype)
        self.entry.launch(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
        return out, lse


def _remember_fast(backend, qkv, options, qkv_bshd, out_user, dims, opts, layout):
    """Cache the fast path of a GPU call that just ran on ``backend`` (the current device) with
    the caller's ``qkv`` and ``options`` (_fast_key's order), when they are exact CuPy arrays and
    the launch needs nothing per call but the pointers of q, k, v, out and lse."""
    global _fast_array_type, _fast_get_device, _fast_new
    cp = backend.xp
    if any(type(x) is not cp.ndarray for x in qkv) or dims.empty or dims.seqlen_k == 0:
        return
    if opts.alibi_slopes is not None or opts.bias is not None or opts.mask is not None:
        return
    if any(x.shape[-1] > 1 and x.strides[-1] != x.itemsize for x in qkv_bshd):
        return  # the full path copies these
    try:
        key = _fast_key(*qkv, *options)
        if key in _FAST:
            return
    except TypeError:
        return
    out = out_user.transpose(0, 2, 1, 3) if layout == "bhsd" else out_user
    entry = _gpu_module().cached_launch(*qkv_bshd, out, opts)
    if entry is None:
        return
    _fast_array_type, _fast_get_device, _fast_new = cp.ndarray, cp.cuda.runtime.getDevice, cp.ndarray
    if len(_FAST) >= _FAST_MAX:
        _FAST.clear()
    _FAST[key] = _FastCall(backend.device_id, entry, out_user.shape, qkv_bshd[0].dtype,
                           (dims.batch, dims.heads, dims.seqlen_q))


def _gpu_module():
    from .gpu import device, fwd as _gpu  # imports CuPy: only on the GPU path

    device.when_limit_changes(_FAST.clear)   # _FAST's launches are planned for the smem limit
    return _gpu


def _inputs(backend, q, k, v, layout, ndim=4):
    """q, k, v in the backend's module, bshd views, one dtype, checked sizes."""
    q, k, v = (backend.take(x) for x in (q, k, v))
    dtype = ck.check_same_dtype({"q": q, "k": k, "v": v})
    qb, kb, vb = (ck.to_bshd(n, x, layout, ndim) for n, x in (("q", q), ("k", k), ("v", v)))
    if ndim == 3:  # varlen: (total, h, d) as one batch of the packed tokens
        qb, kb, vb = qb[None], kb[None], vb[None]
    return qb, kb, vb, dtype


def _last_dim_contiguous(backend, x):
    """The kernels need a unit stride in the last dimension: otherwise one documented copy."""
    if backend.where == "gpu" and x.ndim and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        return backend.xp.ascontiguousarray(x)
    return x


def _empty_outputs(xp, dims: ck.Dims, dtype, layout, lse_dtype):
    """out (in the caller's layout) and its bshd view, and lse [b, h, s_q]."""
    b, sq, h, dv = dims.batch, dims.seqlen_q, dims.heads, dims.head_dim_v
    if layout == "bhsd":
        out_user = xp.empty((b, h, sq, dv), dtype)
        out = out_user.transpose(0, 2, 1, 3)
    else:
        out_user = out = xp.empty((b, sq, h, dv), dtype)
    return out_user, out, xp.empty((b, h, sq), lse_dtype)


def _forward_bshd(backend, qb, kb, vb, dims, opts, dtype, layout):
    """out (caller's layout) and lse [b, h, s_q] for checked bshd inputs on ``backend``."""
    xp = backend.xp
    lse_dtype = _lse_dtype(dtype)
    if dims.empty or dims.seqlen_k == 0:
        out_user, _, lse = _empty_outputs(xp, dims, dtype, layout, lse_dtype)
        out_user.fill(0)
        lse.fill(-np.inf)  # no key to attend to
        return out_user, lse
    if backend.where == "cpu":
        out, lse = cpu.forward(qb, kb, vb, opts)
        out_user = np.ascontiguousarray(out.transpose(0, 2, 1, 3)) if layout == "bhsd" else out
        return out_user, lse
    gpu = _gpu_module()
    qb, kb, vb = (_last_dim_contiguous(backend, x) for x in (qb, kb, vb))
    out_user, out, lse = _empty_outputs(xp, dims, dtype, layout, lse_dtype)
    gpu.forward(qb, kb, vb, out, lse, opts)
    return out_user, lse


def attention(q: Array, k: Array, v: Array, *, causal: bool = False,
              causal_align: CausalAlign = "bottom_right", window: Window = None,
              bias: Optional[Array] = None, mask: Optional[Array] = None,
              softcap: Optional[float] = None, alibi_slopes: Optional[Array] = None,
              scale: Optional[float] = None, layout: Layout = "bshd", return_lse: bool = False,
              device: Device = "auto", allow_tf32: bool = False) -> Union[Array, Tuple[Array, Array]]:
    """Exact attention ``softmax(scale * q kᵀ + bias) v`` in O(N) memory.

    Parameters
    ----------
    q : array (batch, seqlen_q, heads, head_dim)          [layout="bshd", the default]
        or (batch, heads, seqlen_q, head_dim)              [layout="bhsd", PyTorch SDPA's]
    k : array (batch, seqlen_k, heads_k, head_dim)  or (batch, heads_k, seqlen_k, head_dim)
    v : array (batch, seqlen_k, heads_k, head_dim_v) or (batch, heads_k, seqlen_k, head_dim_v)
        heads % heads_k == 0 (GQA / MQA: query head i reads kv head i // (heads // heads_k)).
        head_dim and head_dim_v in 1..256. One dtype for all three: float16, bfloat16
        (ml_dtypes.bfloat16), float32 (float32 accuracy) or float64 (float64 DMMA kernels on the GPU).
        Any strides; on the GPU a last dimension that is not contiguous costs one copy.
    causal : bool
        Keep key j only up to the diagonal (window right side 0).
    causal_align : "bottom_right" | "top_left"
        Where the diagonal sits when seqlen_q != seqlen_k: diag(i) = i + seqlen_k - seqlen_q
        (bottom-right, FlashAttention >= 2.1) or diag(i) = i (top-left).
    window : (left, right) or None
        Sliding window: key j kept when diag(i) - left <= j <= diag(i) + right; None or -1 on a
        side is unbounded (FlashAttention's window_size).
    bias : float array broadcastable to (batch, heads, seqlen_q, seqlen_k), or None
        Added to the scores (always indexed in this order, whatever ``layout``).
    mask : bool array broadcastable to (batch, heads, seqlen_q, seqlen_k), or None
        True = attend.
    softcap : float or None
        Scores become softcap * tanh(scores / softcap) (before bias and ALiBi); None or 0 = off.
    alibi_slopes : array (heads,) or (batch, heads), or None
        Scores minus slope * |diag(i) - j|.
    scale : float or None
        Defaults to 1 / sqrt(head_dim).
    layout : "bshd" | "bhsd"
    return_lse : bool
        Also return lse, float32 (batch, heads, seqlen_q) (float64 for float64 inputs): the
        natural-log sum of exp of each row's scores.
    device : "auto" | "cpu" | "gpu"
        Where NumPy inputs run ("auto": the GPU when usable). GPU arrays always run on their GPU
        unless "cpu" is asked for.
    allow_tf32 : bool
        float32 inputs only (ValueError for another dtype): plain TF32 tensor-core products on
        the GPU (faster, about 1e-3 relative error); no effect on the CPU.

    Array arguments take NumPy or CuPy arrays (or __cuda_array_interface__ / DLPack objects);
    lists, None in place of q, k or v, and NumPy masked arrays are refused with a TypeError.
    Flags (causal, return_lse, allow_tf32, deterministic) take True or False only.

    Returns
    -------
    out : array like q with head_dim_v, in q's dtype and layout; NumPy for NumPy inputs, CuPy for
        GPU inputs (CuPy, __cuda_array_interface__ or DLPack, taken zero-copy).
    lse : (batch, heads, seqlen_q), when return_lse.

    Scores are built as ``s = scale·q kᵀ``; ``softcap·tanh(s/softcap)``; ``+ bias``;
    ``- slope·|diag - j|``; then the causal / window / mask masks.
    """
    if return_lse.__class__ is not bool:
        ck.check_flag("return_lse", return_lse)
    key = None
    if bias is None and mask is None and alibi_slopes is None:
        t = _fast_array_type
        if type(q) is t and type(k) is t and type(v) is t:
            try:
                fast = _FAST.get(_fast_key(q, k, v, causal, causal_align, window, softcap, scale,
                                           layout, device, allow_tf32))
            except TypeError:  # an unhashable option value: the full path judges it
                fast = None
            if fast is not None and fast.device_id == _fast_get_device():
                out, lse = fast(q, k, v)
                return (out, lse) if return_lse else out
        key = _signature((q, k, v), ("attention", causal, causal_align, window, softcap, scale,
                                     layout, device, allow_tf32))
    known = _CALLS.get(key) if key is not None else None

    def body(backend):
        if known is not None:  # validated before: same kinds, shapes, strides, dtypes, options
            _, dims, opts = known
            qb, kb, vb = (ck.to_bshd(n, backend.take(x), layout) for n, x in (("q", q), ("k", k), ("v", v)))
            dtype = qb.dtype
        else:
            qb, kb, vb, dtype = _inputs(backend, q, k, v, layout)
            dims = ck.check_qkv(qb, kb, vb)
            opts = ck.make_options(dims, backend.xp, causal=causal, causal_align=causal_align,
                                   window=window, bias=backend.take(bias), mask=backend.take(mask),
                                   softcap=softcap, alibi_slopes=alibi_slopes, scale=scale,
                                   allow_tf32=allow_tf32, dtype=dtype)
        out, lse = _forward_bshd(backend, qb, kb, vb, dims, opts, dtype, layout)
        if known is None and not (backend.on_host and backend.where == "gpu"):
            _remember(key, (backend, dims, opts))  # (host inputs on the GPU follow the current device)
        if key is not None and backend.where == "gpu" and not backend.on_host:
            _remember_fast(backend, (q, k, v), (causal, causal_align, window, softcap, scale,
                                                layout, device, allow_tf32),
                           (qb, kb, vb), out, dims, opts, layout)
        return (backend.give_back(out), backend.give_back(lse)) if return_lse else backend.give_back(out)

    if known is not None:
        return _on_device(known[0], body)
    ck.check_present({"q": q, "k": k, "v": v})
    ck.check_layout(layout)
    return _run(device, {"q": q, "k": k, "v": v, "bias": bias, "mask": mask}, body)


attention.__doc__ += _CAUSAL_PICTURE


def _check_backward_arrays(backend, dout, out, lse, dims, dtype, layout):
    """dout and out shaped like the output (caller's layout), lse [b, h, s_q]; bshd views back."""
    dout, out, lse = (backend.take(x) for x in (dout, out, lse))
    b, sq, h, dv = dims.batch, dims.seqlen_q, dims.heads, dims.head_dim_v
    out_shape = (b, h, sq, dv) if layout == "bhsd" else (b, sq, h, dv)
    ck.check_like("dout", dout, out_shape, dtype)
    ck.check_like("out", out, out_shape, dtype)
    lse_dtype = _lse_dtype(dtype)
    ck.check_like("lse", lse, (b, h, sq), lse_dtype)
    return ck.to_bshd("dout", dout, layout), ck.to_bshd("out", out, layout), lse


def _backward_bshd(backend, doutb, qb, kb, vb, outb, lse, dims, opts, layout):
    """(dq, dk, dv) in the caller's layout and dbias in the bias's own shape (or None)."""
    xp = backend.xp
    if dims.empty or dims.seqlen_k == 0:
        grads = [xp.zeros_like(x) for x in (qb, kb, vb)]
        dbias = None if opts.bias is None else xp.zeros(opts.bias.shape, opts.bias.dtype)
    elif backend.where == "cpu":
        *grads, dbias = cpu.backward(doutb, qb, kb, vb, outb, lse, opts)
    else:
        from .gpu import bwd as _gpu_bwd  # imports CuPy: only on the GPU path

        doutb, qb, kb, vb, outb = (_last_dim_contiguous(backend, x) for x in (doutb, qb, kb, vb, outb))
        grads = [xp.empty_like(x) for x in (qb, kb, vb)]  # bshd, written by the kernels
        dbias = None if opts.bias is None else xp.empty(opts.bias.shape, opts.bias.dtype)
        _gpu_bwd.backward(doutb, qb, kb, vb, outb, xp.ascontiguousarray(lse), *grads, opts,
                          dbias=dbias)
    if layout == "bhsd":
        grads = [xp.ascontiguousarray(g.transpose(0, 2, 1, 3)) for g in grads]
    if dbias is not None:
        dbias = dbias.reshape(opts.bias_shape)
    return (*grads, dbias)


def attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *,
                       causal: bool = False, causal_align: CausalAlign = "bottom_right",
                       window: Window = None, bias: Optional[Array] = None,
                       mask: Optional[Array] = None, softcap: Optional[float] = None,
                       alibi_slopes: Optional[Array] = None, scale: Optional[float] = None,
                       layout: Layout = "bshd", deterministic: bool = False,
                       device: Device = "auto", allow_tf32: bool = False) -> Tuple[Array, ...]:
    """Gradients of ``attention`` (same options) from the forward's ``out`` and ``lse``.

    Parameters
    ----------
    dout : array like out: (batch, seqlen_q, heads, head_dim_v) [bshd] or (batch, heads, seqlen_q,
        head_dim_v) [bhsd], q's dtype.
    q, k, v : as passed to ``attention``.
    out : the forward's output.
    lse : (batch, heads, seqlen_q) float32 (float64 for float64 inputs), from
        ``attention(..., return_lse=True)``.
    deterministic : bool
        Bit-identical results across runs (the GPU backward avoids order-dependent atomics).
    Other keywords: as ``attention``; pass the same values as the forward.

    Returns
    -------
    (dq, dk, dv), shaped and typed like q, k, v; with ``bias`` given, (dq, dk, dv, dbias) where
    dbias has the bias's own shape (summed over its broadcast dimensions).

    P is never stored: it is recomputed from q, k and lse, block by block.
    """
    ck.check_present({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
    ck.check_layout(layout)

    def body(backend):
        qb, kb, vb, dtype = _inputs(backend, q, k, v, layout)
        dims = ck.check_qkv(qb, kb, vb)
        doutb, outb, lse_ = _check_backward_arrays(backend, dout, out, lse, dims, dtype, layout)
        opts = ck.make_options(dims, backend.xp, causal=causal, causal_align=causal_align,
                               window=window, bias=backend.take(bias), mask=backend.take(mask),
                               softcap=softcap, alibi_slopes=alibi_slopes, scale=scale,
                               deterministic=deterministic, allow_tf32=allow_tf32, dtype=dtype)
        dq, dk, dv, dbias = _backward_bshd(backend, doutb, qb, kb, vb, outb, lse_, dims, opts, layout)
        grads = tuple(backend.give_back(g) for g in (dq, dk, dv))
        return grads if bias is None else grads + (backend.give_back(dbias),)

    return _run(device, {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse,
                         "bias": bias, "mask": mask}, body)


def attention_vjp(q: Array, k: Array, v: Array, **options: Any) -> Tuple[Array, Callable[..., Tuple[Array, ...]]]:
    """Forward now, backward later: ``out, vjp = attention_vjp(q, k, v, **options)``.

    ``options`` are ``attention``'s keywords (``return_lse`` excepted). ``vjp(dout,
    deterministic=False)`` returns ``attention_backward``'s gradients: (dq, dk, dv), plus dbias
    when a bias was given. out and the lse are kept for the backward; nothing N×N is.

    Shapes: q (batch, seqlen_q, heads, head_dim), k (batch, seqlen_k, heads_k, head_dim),
    v (batch, seqlen_k, heads_k, head_dim_v) in "bshd"; out and dout
    (batch, seqlen_q, heads, head_dim_v) (or the "bhsd" transposes).
    """
    if "return_lse" in options:
        ck.fail(TypeError, "return_lse", "an option of attention_vjp", "attention's other keywords")
    out, lse = attention(q, k, v, return_lse=True, **options)

    def vjp(dout, deterministic=False):
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)

    return out, vjp


# ----------------------------------------------------------------------------------------------
# Variable-length (packed) batches
# ----------------------------------------------------------------------------------------------

def _varlen_setup(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Packed inputs as 1-batch bshd views, the sequence boundaries on the host, and Dims."""
    qb, kb, vb, dtype = _inputs(backend, q, k, v, "bshd", ndim=3)
    total = ck.check_qkv(qb, kb, vb)
    bounds = []
    for name, cu, n in (("cu_seqlens_q", cu_seqlens_q, total.seqlen_q),
                        ("cu_seqlens_k", cu_seqlens_k, total.seqlen_k)):
        if cu is None or not hasattr(cu, "dtype"):
            ck.fail(TypeError, name, type(cu).__name__, "an integer array (batch + 1,)")
        cu = backend.take(cu)
        host = cu if isinstance(cu, np.ndarray) else cu.get()
        bounds.append(ck.check_cu_seqlens(name, cu, n, host))
    cq, ckk = bounds
    # any integer dtype whose values fit: the kernels read int32
    cu_dev = tuple(backend.take(cu).astype(np.int32, copy=False)
                   for cu in (cu_seqlens_q, cu_seqlens_k))
    if cq.size != ckk.size:
        ck.fail(ValueError, "cu_seqlens_k", f"{ckk.size - 1} sequences while cu_seqlens_q has {cq.size - 1}",
                "the same number of sequences in both")
    ck.check_max_seqlen("max_seqlen_q", max_seqlen_q, np.diff(cq))
    ck.check_max_seqlen("max_seqlen_k", max_seqlen_k, np.diff(ckk))
    dims = dataclasses.replace(total, batch=cq.size - 1)
    return qb, kb, vb, dtype, cq, ckk, dims, cu_dev


def _longest(cu):
    return int(np.diff(cu).max()) if cu.size > 1 else 0


def _per_sequence(opts, i):
    """The options of sequence i of a packed batch (its row of (batch, heads) ALiBi slopes)."""
    slopes = opts.alibi_slopes
    if slopes is None or slopes.shape[0] == 1:
        return opts
    return dataclasses.replace(opts, alibi_slopes=slopes[i:i + 1])


def _seq_dims(dims, nq, nk):
    return dataclasses.replace(dims, batch=1, seqlen_q=nq, seqlen_k=nk)


def attention_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, *,
                     causal: bool = False, causal_align: CausalAlign = "bottom_right",
                     window: Window = None, softcap: Optional[float] = None,
                     alibi_slopes: Optional[Array] = None, scale: Optional[float] = None,
                     return_lse: bool = False, device: Device = "auto",
                     allow_tf32: bool = False) -> Union[Array, Tuple[Array, Array]]:
    """Attention over packed sequences of different lengths, no padding.

    Parameters
    ----------
    q : (total_q, heads, head_dim); k : (total_k, heads_k, head_dim); v : (total_k, heads_k,
        head_dim_v): the sequences one after another.
    cu_seqlens_q, cu_seqlens_k : integer (batch + 1,): sequence i is rows cu[i]:cu[i+1]; starts
        at 0, non-decreasing, ends at total. Same kind (NumPy / GPU) as q. Any integer dtype
        whose values fit in int32 (np.cumsum's int64 included; converted to int32).
    max_seqlen_q, max_seqlen_k : int or None: the longest sequence (computed when None).
    alibi_slopes : (heads,) or (batch, heads).
    Other keywords as ``attention``; causal and window apply per sequence (bottom-right aligned
    per sequence by default).

    Returns
    -------
    out : (total_q, heads, head_dim_v); and lse : float32 (heads, total_q) when return_lse.
    A sequence with no keys gives out = 0 and lse = -inf.

    On the GPU all sequences run in one launch (grid over the longest sequence's query tiles x
    heads x sequences; tiles past a sequence's end exit at once); on the CPU one dense call per
    sequence.
    """
    ck.check_flag("return_lse", return_lse)
    ck.check_present({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                      "cu_seqlens_k": cu_seqlens_k})

    def body(backend):
        qb, kb, vb, dtype, cq, ckk, dims, cu_dev = _varlen_setup(
            backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        opts = ck.make_options(dims, backend.xp, causal=causal, causal_align=causal_align,
                               window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                               scale=scale, allow_tf32=allow_tf32, dtype=dtype)
        xp = backend.xp
        out = xp.empty((dims.seqlen_q, dims.heads, dims.head_dim_v), dtype)
        lse = xp.empty((dims.heads, dims.seqlen_q), _lse_dtype(dtype))
        if backend.where == "gpu":
            qb, kb, vb = (_last_dim_contiguous(backend, x) for x in (qb, kb, vb))
            _gpu_module().forward_varlen(qb, kb, vb, *cu_dev, _longest(cq), _longest(ckk),
                                         out[None], lse, opts)
            return (backend.give_back(out), backend.give_back(lse)) if return_lse else backend.give_back(out)
        for i in range(dims.batch):
            (q0, q1), (k0, k1) = cq[i:i + 2], ckk[i:i + 2]
            o, l = _forward_bshd(backend, qb[:, q0:q1], kb[:, k0:k1], vb[:, k0:k1],
                                 _seq_dims(dims, q1 - q0, k1 - k0), _per_sequence(opts, i), dtype, "bshd")
            out[q0:q1] = o[0]
            lse[:, q0:q1] = l[0]
        return (backend.give_back(out), backend.give_back(lse)) if return_lse else backend.give_back(out)

    return _run(device, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                         "cu_seqlens_k": cu_seqlens_k}, body)


def attention_varlen_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array,
                              cu_seqlens_q: Array, cu_seqlens_k: Array,
                              max_seqlen_q: Optional[int] = None,
                              max_seqlen_k: Optional[int] = None, *, causal: bool = False,
                              causal_align: CausalAlign = "bottom_right", window: Window = None,
                              softcap: Optional[float] = None,
                              alibi_slopes: Optional[Array] = None, scale: Optional[float] = None,
                              deterministic: bool = False, device: Device = "auto",
                              allow_tf32: bool = False) -> Tuple[Array, Array, Array]:
    """Gradients of ``attention_varlen`` (same options).

    dout, out : (total_q, heads, head_dim_v); lse : (heads, total_q) from
    ``attention_varlen(..., return_lse=True)``. Returns (dq, dk, dv) shaped like q, k, v.
    On the GPU one launch set for all sequences; on the CPU one dense backward per sequence.
    """
    ck.check_present({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse,
                      "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})

    def body(backend):
        qb, kb, vb, dtype, cq, ckk, dims, cu_dev = _varlen_setup(
            backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        d_, o_, l_ = (backend.take(x) for x in (dout, out, lse))
        packed_out = (dims.seqlen_q, dims.heads, dims.head_dim_v)
        ck.check_like("dout", d_, packed_out, dtype)
        ck.check_like("out", o_, packed_out, dtype)
        ck.check_like("lse", l_, (dims.heads, dims.seqlen_q),
                      _lse_dtype(dtype))
        opts = ck.make_options(dims, backend.xp, causal=causal, causal_align=causal_align,
                               window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                               scale=scale, deterministic=deterministic, allow_tf32=allow_tf32,
                               dtype=dtype)
        if backend.where == "gpu":
            from .gpu import bwd as _gpu_bwd  # imports CuPy: only on the GPU path

            xp = backend.xp
            qb, kb, vb = (_last_dim_contiguous(backend, x) for x in (qb, kb, vb))
            d_, o_ = (_last_dim_contiguous(backend, x) for x in (d_, o_))
            grads = [xp.empty_like(x[0]) for x in (qb, kb, vb)]
            _gpu_bwd.backward_varlen(d_[None], qb, kb, vb, o_[None], xp.ascontiguousarray(l_),
                                     *cu_dev, _longest(cq), _longest(ckk),
                                     *(g[None] for g in grads), opts)
            return tuple(backend.give_back(g) for g in grads)
        grads = [backend.xp.zeros_like(x[0]) for x in (qb, kb, vb)]
        for i in range(dims.batch):
            (q0, q1), (k0, k1) = cq[i:i + 2], ckk[i:i + 2]
            sq, sk = slice(q0, q1), slice(k0, k1)
            dq, dk, dv, _ = _backward_bshd(
                backend, d_[None, sq], qb[:, sq], kb[:, sk], vb[:, sk], o_[None, sq],
                backend.xp.ascontiguousarray(l_[None, :, sq]), _seq_dims(dims, q1 - q0, k1 - k0),
                _per_sequence(opts, i), "bshd")
            grads[0][sq], grads[1][sk], grads[2][sk] = dq[0], dk[0], dv[0]
        return tuple(backend.give_back(g) for g in grads)

    return _run(device, {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse,
                         "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}, body)
