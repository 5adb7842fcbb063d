"""Argument validation and its error messages, before any work or launch.

Every function here is a function of shapes, strides, dtypes and plain Python values: it works on
NumPy and CuPy arrays alike and is tested without a GPU. Each error names the argument, what it got
and what is accepted (ValueError for values and shapes, TypeError for types and dtypes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import ml_dtypes
import numpy as np

from ._options import UNBOUNDED, Options

MAX_HEAD_DIM = 256
LAYOUTS = ("bshd", "bhsd")
CAUSAL_ALIGNS = ("bottom_right", "top_left")
DEVICES = ("auto", "cpu", "gpu")

#: dtypes the GPU kernels take (float64: the portable kernels on DMMA, compute capability 8.0+).
KERNEL_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
                 np.dtype(np.float64))
ACCEPTED_DTYPES = KERNEL_DTYPES
_DTYPE_NAMES = "float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64"


def fail(exc: type, name: str, got: Any, accepted: str) -> None:
    """Raise ``exc`` with the one message format of the package."""
    raise exc(f"{name}: got {got}; accepted: {accepted}")


def _shape(x) -> tuple:
    return tuple(int(n) for n in x.shape)


_ARRAY_HINT = "a NumPy or CuPy array (wrap a list with numpy.asarray)"


def check_flag(name: str, value) -> bool:
    """``value`` is a Python bool or numpy.bool_ (not 1, "no" or None): TypeError otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        fail(TypeError, name, repr(value), "True or False")
    return bool(value)


def check_present(named: dict) -> None:
    """No array of ``named`` (name -> value) is None: a TypeError naming the first that is."""
    for name, x in named.items():
        if x is None:
            fail(TypeError, name, "None", _ARRAY_HINT)


@dataclass(frozen=True)
class Dims:
    """Problem sizes of one dense call (bshd order inside the package)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    head_dim_v: int

    @property
    def empty(self) -> bool:
        """True when the output has no element (nothing to launch)."""
        return self.batch == 0 or self.seqlen_q == 0 or self.heads == 0


def check_dtype(name: str, x) -> np.dtype:
    """The dtype of ``x`` when it is one we compute with, else TypeError."""
    dt = np.dtype(x.dtype)
    if dt not in ACCEPTED_DTYPES:
        fail(TypeError, name, f"dtype {dt}", _DTYPE_NAMES)
    return dt


def check_same_dtype(named: dict) -> np.dtype:
    """All arrays of ``named`` (name -> array) have one accepted dtype; returns it."""
    dtypes = {name: check_dtype(name, x) for name, x in named.items()}
    first_name, first = next(iter(dtypes.items()))
    for name, dt in dtypes.items():
        if dt != first:
            fail(TypeError, name, f"dtype {dt} while {first_name} has {first}",
                 f"the same dtype for {', '.join(dtypes)} (cast one of them)")
    return first


def to_bshd(name: str, x, layout: str, ndim: int = 4):
    """Check ``x.ndim`` and return a bshd view (a transpose for layout "bhsd", never a copy)."""
    if x.ndim != ndim:
        want = "(batch, seqlen, heads, head_dim)" if layout == "bshd" else "(batch, heads, seqlen, head_dim)"
        if ndim == 3:
            want = "(total_tokens, heads, head_dim)"
        fail(ValueError, name, f"{x.ndim}-D array of shape {_shape(x)}", f"a {ndim}-D array {want}")
    if ndim == 4 and layout == "bhsd":
        return x.transpose(0, 2, 1, 3)
    return x


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        fail(ValueError, "layout", repr(layout), '"bshd" (FlashAttention) or "bhsd" (PyTorch SDPA)')
    return layout


def check_device(device) -> str:
    if device not in DEVICES:
        fail(ValueError, "device", repr(device), '"auto", "cpu" or "gpu"')
    return device


def check_qkv(q, k, v) -> Dims:
    """Sizes of bshd q [b, s_q, h, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v]; raises on mismatch."""
    b, sq, h, d = _shape(q)
    bk, sk, hk, dk = _shape(k)
    bv, skv, hkv, dv = _shape(v)
    if bk != b or bv != b:
        bad, got = ("k", bk) if bk != b else ("v", bv)
        fail(ValueError, bad, f"batch {got} while q has batch {b}", "the same batch size for q, k and v")
    if skv != sk:
        fail(ValueError, "v", f"seqlen {skv} while k has seqlen {sk}", "the same seqlen for k and v")
    if hkv != hk:
        fail(ValueError, "v", f"{hkv} heads while k has {hk}", "the same number of heads for k and v")
    if dk != d:
        fail(ValueError, "k", f"head_dim {dk} while q has head_dim {d}", "the same head_dim for q and k")
    for name, n in (("q", d), ("v", dv)):
        if not 1 <= n <= MAX_HEAD_DIM:
            fail(ValueError, name, f"head_dim {n}", f"1 <= head_dim <= {MAX_HEAD_DIM}")
    if hk == 0 and h != 0 or hk != 0 and h % hk != 0:
        fail(ValueError, "k", f"{hk} heads for {h} query heads",
             "heads_k dividing heads (heads % heads_k == 0: multi-head, GQA or MQA)")
    return Dims(b, sq, sk, h, hk, d, dv)


def check_like(name: str, x, shape: tuple, dtype=None) -> None:
    """``x`` has exactly ``shape`` (and ``dtype`` when given)."""
    if _shape(x) != tuple(shape):
        fail(ValueError, name, f"shape {_shape(x)}", f"shape {tuple(shape)}")
    if dtype is not None and np.dtype(x.dtype) != np.dtype(dtype):
        fail(TypeError, name, f"dtype {np.dtype(x.dtype)}", f"dtype {np.dtype(dtype)}")


def check_window(window, causal) -> tuple:
    """(left, right) with UNBOUNDED for None or -1; causal sets right = 0."""
    check_flag("causal", causal)
    if window is None:
        left = right = UNBOUNDED
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            fail(ValueError, "window", repr(window), "None or a pair (left, right) of ints >= 0, -1 or None")
        sides = []
        for side in window:
            if side is None:
                side = UNBOUNDED
            if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)) or side < UNBOUNDED:
                fail(ValueError, "window", repr(tuple(window)),
                     "None or a pair (left, right) of ints >= 0, -1 or None (unbounded)")
            sides.append(int(side))
        left, right = sides
    if causal:
        right = 0
    return left, right


def _check_number(name: str, value, accepted: str, minimum: float) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        fail(TypeError, name, repr(value), accepted)
    value = float(value)
    if not math.isfinite(value) or value < minimum:
        fail(ValueError, name, repr(value), accepted)
    return value


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _check_number("scale", scale, "None (1/sqrt(head_dim)) or a finite number", -math.inf)


def check_softcap(softcap) -> float:
    if softcap is None:
        return 0.0
    return _check_number("softcap", softcap, "None or a finite number >= 0 (0 = off)", 0.0)


def broadcast_4d(name: str, x, dims: Dims, kinds: str, dtypes: tuple):
    """A bias or mask as a 4-D view broadcastable to [b, h, s_q, s_k] (no copy), checked."""
    dt = np.dtype(x.dtype)
    if dt not in dtypes:
        fail(TypeError, name, f"dtype {dt}", kinds)
    full = (dims.batch, dims.heads, dims.seqlen_q, dims.seqlen_k)
    shape = _shape(x)
    accepted = f"a shape broadcastable to (batch, heads, seqlen_q, seqlen_k) = {full}"
    if x.ndim > 4:
        fail(ValueError, name, f"{x.ndim}-D shape {shape}", accepted)
    shape4 = (1,) * (4 - len(shape)) + shape
    for n, f in zip(shape4, full):
        if n not in (1, f):
            fail(ValueError, name, f"shape {shape}", accepted)
    return x.reshape(shape4)


def check_alibi(alibi_slopes, dims: Dims, xp, dtype=None):
    """ALiBi slopes (h,) or (b, h) as a 2-D [b or 1, h] array of module ``xp``.

    float32 for the GPU kernels, float64 for float64 inputs (``dtype``) on the GPU; float64 on
    the CPU (NumPy) path, so float64 inputs keep float64 accuracy.
    """
    if alibi_slopes is None:
        return None
    if (isinstance(alibi_slopes, np.ma.MaskedArray) or not hasattr(alibi_slopes, "dtype")
            or not hasattr(alibi_slopes, "shape")):
        fail(TypeError, "alibi_slopes", f"{type(alibi_slopes).__module__}.{type(alibi_slopes).__qualname__}",
             _ARRAY_HINT + " of shape (heads,) or (batch, heads)")
    shape = tuple(np.shape(alibi_slopes))
    accepted = f"shape ({dims.heads},) or ({dims.batch}, {dims.heads}), float"
    if shape not in ((dims.heads,), (dims.batch, dims.heads)):
        fail(ValueError, "alibi_slopes", f"shape {shape}", accepted)
    dt = np.dtype(alibi_slopes.dtype)
    if dt.kind not in "fiu":
        fail(TypeError, "alibi_slopes", f"dtype {dt}", accepted)
    if xp is np and hasattr(alibi_slopes, "get") and not isinstance(alibi_slopes, np.ndarray):
        alibi_slopes = alibi_slopes.get()  # CuPy slopes for a call on the CPU
    f64 = xp is np or (dtype is not None and np.dtype(dtype) == np.float64)
    slopes = xp.asarray(alibi_slopes).astype(np.float64 if f64 else np.float32)
    return xp.ascontiguousarray(slopes.reshape(-1 if len(shape) == 2 else 1, dims.heads))


def make_options(dims: Dims, xp, *, causal=False, causal_align="bottom_right", window=None,
                 bias=None, mask=None, softcap=None, alibi_slopes=None, scale=None,
                 deterministic=False, allow_tf32=False, dtype=None) -> Options:
    """Validate the option keywords of the public API into one ``Options``.

    ``dtype``: the inputs' dtype, when known; allow_tf32=True is refused for any but float32.
    """
    if causal_align not in CAUSAL_ALIGNS:
        fail(ValueError, "causal_align", repr(causal_align), '"bottom_right" (FlashAttention >= 2.1) or "top_left"')
    left, right = check_window(window, causal)
    check_flag("deterministic", deterministic)
    check_flag("allow_tf32", allow_tf32)
    if allow_tf32 and dtype is not None and np.dtype(dtype) != np.float32:
        fail(ValueError, "allow_tf32", f"True with dtype {np.dtype(dtype)}",
             "True only for float32 inputs (TF32 is a float32 mode); False for other dtypes")
    bias4 = None
    if bias is not None:
        bias4 = broadcast_4d("bias", bias, dims, "a float dtype (" + _DTYPE_NAMES + ")", ACCEPTED_DTYPES)
    mask4 = None
    if mask is not None:
        mask4 = broadcast_4d("mask", mask, dims, "bool (True = attend)", (np.dtype(bool),))
    return Options(
        scale=check_scale(scale, dims.head_dim),
        window_left=left,
        window_right=right,
        bottom_right=causal_align == "bottom_right",
        softcap=check_softcap(softcap),
        alibi_slopes=check_alibi(alibi_slopes, dims, xp, dtype),
        bias=bias4,
        bias_shape=None if bias is None else _shape(bias),
        mask=mask4,
        deterministic=bool(deterministic),
        allow_tf32=bool(allow_tf32),
    )


INT32_MAX = 2**31 - 1


def check_cu_seqlens(name: str, cu, total: int, host_values) -> np.ndarray:
    """cu_seqlens: integers (batch + 1,), starting at 0, non-decreasing, last == total tokens.

    Any integer dtype is accepted when every value fits in int32 (the kernels read int32: the
    caller converts). ``host_values`` is the array's values on the host (NumPy), read by the
    caller. Returns the values as int64.
    """
    accepted = (f"an integer array (batch + 1,) of values that fit in int32, starting at 0, "
                f"non-decreasing, ending at {total}")
    if np.dtype(cu.dtype).kind not in "iu":
        fail(TypeError, name, f"dtype {np.dtype(cu.dtype)}", accepted)
    if cu.ndim != 1 or cu.shape[0] < 1:
        fail(ValueError, name, f"shape {_shape(cu)}", accepted)
    host = np.asarray(host_values)
    if host.size and (int(host.max()) > INT32_MAX or int(host.min()) < -INT32_MAX - 1):
        fail(ValueError, name, f"values up to {int(host.max())} (dtype {host.dtype}), beyond int32",
             accepted)
    vals = host.astype(np.int64)
    if vals[0] != 0 or np.any(np.diff(vals) < 0) or vals[-1] != total:
        shown = vals if vals.size <= 8 else f"[{vals[0]}, {vals[1]}, ..., {vals[-1]}] (non-decreasing: {bool(np.all(np.diff(vals) >= 0))})"
        fail(ValueError, name, f"values {shown}", accepted)
    return vals


def check_max_seqlen(name: str, given: Optional[int], lengths: np.ndarray) -> int:
    """max_seqlen: None (computed) or an int >= the longest sequence."""
    longest = int(lengths.max()) if lengths.size else 0
    if given is None:
        return longest
    if isinstance(given, (bool, np.bool_)) or not isinstance(given, (int, np.integer)) or given < longest:
        fail(ValueError, name, repr(given), f"None or an int >= the longest sequence ({longest})")
    return int(given)
