"""Helpers shared by the GPU test modules (imported by name: pytest puts tests/ on sys.path).

Importing this module skips the importing test module where CuPy or ml_dtypes is missing.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32)}
# Error floor of the 16-bit criterion (docs/semantics.md §9): a quarter ulp of 1 in each dtype
FLOOR = {"float16": 1e-4, "bfloat16": 1e-3}


def rounding_floor(dtype_name: str, ref) -> float:
    """FlashAttention's floor for a gradient check: twice the largest error of the float64
    reference shifted by 0.3 and back in the dtype, 2·max|fl(fl(fl(ref) + 0.3) − 0.3) − ref|
    (its tests' ``dq_atol``). This is the stored result's own rounding. A kernel whose float32
    sum errs less than the naive computation's can still round to the value next to the
    reference while the naive one rounds onto it; 2 × the naive error does not cover that
    where the values are large. One such case: a float16 dbias element of 121, ulp 0.0625,
    got 120.625, ref 120.579, naive 120.562 (docs/hopper.md)."""
    if dtype_name == "float32":
        return 0.0
    ref = np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    dt = DTYPES[dtype_name]
    shifted = (ref.astype(dt).astype(np.float32) + np.float32(0.3)).astype(dt)
    back = (shifted.astype(np.float32) - np.float32(0.3)).astype(dt)
    return 2.0 * float(np.abs(back.astype(np.float64) - ref).max())


def grad_tolerance(dtype_name: str, ref, naive_err: float) -> float:
    """The 16-bit bound of a gradient check (docs/semantics.md §9, FlashAttention's criterion): twice
    the naive computation's max error plus a floor, the larger of FLOOR scaled by max(1,
    max|ref|) and rounding_floor."""
    sc = max(1.0, float(np.abs(ref).max()) if np.size(ref) else 0.0)
    return 2.0 * naive_err + max(FLOOR[dtype_name] * sc, rounding_floor(dtype_name, ref))


#: Window and causal-alignment option cases, the first test_options cases of every GPU test file
WINDOW_OPTION_SETS = {
    "window": dict(window=(32, 16)),
    "window_left_only": dict(window=(50, -1)),
    "causal_top_left": dict(causal=True, bottom_right=False),
    "causal_window": dict(causal=True, window=(40, -1)),
}
#: The options the float32 Hopper kernels (forward and backward) take beside causal, as
#: test_options cases of both: windows, top-left causal alignment, a scale
SM90_F32_OPTION_SETS = {**WINDOW_OPTION_SETS, "scale": dict(scale=0.37)}


def compute_capability() -> int:
    """The current device's compute capability as an int (90 for 9.0), 0 without a usable one."""
    try:
        return int(cp.cuda.Device().compute_capability)
    except Exception:  # noqa: BLE001  (no usable device: the gpu marker skips anyway)
        return 0


# Marks a module or test that needs the Hopper (sm_90a) kernels
hopper_only = pytest.mark.skipif(compute_capability() != 90,
                                 reason="the Hopper kernel needs compute capability 9.0")


def alloc(shape, dtype, layout, pad=0):
    """A CuPy array viewed as bshd `shape`, stored as bshd / bhsd / with a padded last dim."""
    b, s, h, d = shape
    if layout == "bhsd":
        return cp.empty((b, h, s, d), dtype).transpose(0, 2, 1, 3)
    if layout == "padded":   # row pitch d + pad: unaligned rows when pad is odd
        return cp.empty((b, s, h, d + pad), dtype)[..., :d]
    if layout == "sstride":  # every other sequence position of a twice-longer buffer
        return cp.empty((b, 2 * s, h, d), dtype)[:, ::2]
    return cp.empty(shape, dtype)


def keep_mask(s_q, s_k, wl, wr, bottom_right):
    """(keep [s_q, s_k] bool, diag [s_q]): key j is seen by query i when
    diag[i] - wl <= j <= diag[i] + wr (a negative bound is unlimited); diag[i] = i (+ s_k - s_q
    when aligned bottom-right)."""
    i = np.arange(s_q)
    diag = i + (s_k - s_q) if bottom_right else i
    j = np.arange(s_k)[None, :]
    keep = np.ones((s_q, s_k), bool)
    if wl >= 0:
        keep &= j >= diag[:, None] - wl
    if wr >= 0:
        keep &= j <= diag[:, None] + wr
    return keep, diag


def naive_attention(q, k, v, do, dtype, scale, keep, bias=None, softcap=0.0, slopes=None, diag=None,
                    bias_dtype=None, o_saved=None, acc=None):
    """Attention and its gradients computed the naive way in ``dtype`` (docs/semantics.md §9's
    comparison), like PyTorch's same-dtype math: each matmul takes dtype operands, accumulates in
    float32 and rounds its result to dtype (what cuBLAS does for float16 / bfloat16; CuPy's
    batched matmul has no bfloat16 kernel, so the float32 matmul of the dtype values is rounded
    here); softmax in float32; P and dS rounded to dtype before their products; GQA group sums
    in float32.

    q [b, s_q, h, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v], do [b, s_q, h, d_v] (None:
    forward only) CuPy float arrays; keep bool broadcastable to [b, h, s_q, s_k]; bias float32
    4-D or None; slopes (ALiBi) [b or 1, h] with diag [s_q] (each row's diagonal key).
    o_saved [b, s_q, h, d_v] (optional): the forward output the backward is given; D =
    rowsum(dO ∘ O) then uses it, as FlashAttention's backward (and ours) does, instead of this
    function's own O. The two O are different roundings of the same values, and where one key
    dominates some 2000 rows a dbias element sums their D errors: the kernel's and a
    self-computed naive's then differ by chance, not by method (docs/hopper.md).
    That sum is the same for every backward given that out, and the naive's own roundings (dP
    to dtype) can cancel it by chance, so test_gpu_bias_varlen.check_grad allows it per element:
    |float64 gradient given that out (reference.attention_backward's out=) − exact|.
    Returns (out, lse) without do, else (out, lse, dq, dk, dv, dbias); dbias in the bias's 4-D
    shape and bias_dtype (None without a bias)."""
    f32 = cp.float32 if acc is None else acc   # acc=float64 with dtype float64: the float64 reference
    rnd = lambda x: x.astype(dtype).astype(f32)  # noqa: E731
    mm = lambda a, b: rnd(cp.matmul(a, b))       # noqa: E731
    h, h_k = q.shape[2], k.shape[2]
    grp = h // h_k
    idx = cp.asarray(np.arange(h) // grp)
    qt = q.transpose(0, 2, 1, 3).astype(f32)
    kt = k.transpose(0, 2, 1, 3)[:, idx].astype(f32)
    vt = v.transpose(0, 2, 1, 3)[:, idx].astype(f32)
    raw = mm(qt, kt.swapaxes(-1, -2)) * scale
    s = softcap * cp.tanh(raw / softcap) if softcap else raw
    if bias is not None:
        s = s + bias
    if slopes is not None:
        j = cp.arange(s.shape[-1])[None, :]
        s = s - slopes[:, :, None, None] * cp.abs(cp.asarray(diag)[:, None] - j)
    s = cp.where(cp.asarray(keep), s, -cp.inf)
    m = s.max(-1, keepdims=True)
    m = cp.where(cp.isfinite(m), m, 0)
    e = cp.exp(s - m)
    l = e.sum(-1, keepdims=True)
    lse = cp.where(l[..., 0] > 0, cp.log(l[..., 0]) + m[..., 0], -cp.inf)
    p = cp.where(l > 0, e / cp.where(l > 0, l, 1), 0)
    p16 = rnd(p)
    o = mm(p16, vt)
    if do is None:
        return o.astype(dtype).transpose(0, 2, 1, 3), lse
    dot = do.transpose(0, 2, 1, 3).astype(f32)
    dv = cp.matmul(p16.swapaxes(-1, -2), dot)
    dp = mm(dot, vt.swapaxes(-1, -2))
    o_d = o if o_saved is None else o_saved.transpose(0, 2, 1, 3).astype(f32)
    ds = p * (dp - (dot * o_d).sum(-1, keepdims=True))
    dbias = None
    if bias is not None:
        red = tuple(a for a in range(4) if bias.shape[a] == 1 and ds.shape[a] != 1)
        dbias = ds.sum(axis=red, keepdims=True) if red else ds
        dbias = dbias.astype(bias_dtype).astype(f32)
    if softcap:
        th = cp.tanh(raw / softcap)
        ds = ds * (1 - th * th)
    ds = rnd(ds)
    dq = rnd(cp.matmul(ds, kt) * scale)
    dk = cp.matmul(ds.swapaxes(-1, -2), qt) * scale
    b_, _, s_k, d = dk.shape
    dk = rnd(dk.reshape(b_, h_k, grp, s_k, d).sum(2))
    dv = rnd(dv.reshape(b_, h_k, grp, s_k, -1).sum(2))
    return (o.astype(dtype).transpose(0, 2, 1, 3), lse, dq.transpose(0, 2, 1, 3),
            dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3), dbias)


def launches_on_two_streams(dtype, launches, kernel, check, causal=True, s=700):
    """The Hopper forwards' work-tile counter (and the split tail's counters) is per stream and
    left zeroed by each launch: ``launches`` problems [2, s, 4, 64] of ``dtype`` (causal, or
    not) alternate between two streams, each launched three times with ``kernel`` (the name
    must start with fwd90_), then each is compared with the portable kernel: ``check(out, ref,
    lse, ref_lse)`` asserts. Returns the kernels' names."""
    from cupyflash.gpu import fwd as gpu_fwd
    from cupyflash._options import Options
    opts = Options(scale=0.125, window_right=0 if causal else -1)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    cases, names = [], set()
    for i in range(launches):
        with streams[i % 2]:
            q, k, v = (cp.random.standard_normal((2, s, 4, 64), dtype=cp.float32).astype(dtype)
                       for _ in range(3))
            out = cp.full(q.shape, cp.nan, dtype)
            lse = cp.full((2, 4, s), cp.nan, cp.float32)
            for _ in range(3):
                names.add(gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kernel))
            cases.append((q, k, v, out, lse))
    assert all(n.startswith("fwd90_") for n in names), names
    for st in streams:
        st.synchronize()
    for q, k, v, out, lse in cases:
        ref, ref_lse = cp.empty_like(out), cp.empty_like(lse)
        gpu_fwd.forward(q, k, v, ref, ref_lse, opts, kernel="portable")
        check(out, ref, lse, ref_lse)
    return names
