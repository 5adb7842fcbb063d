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
# Error floor of the 16-bit criterion (design.md §4): a quarter ulp of 1 in each dtype
FLOOR = {"float16": 1e-4, "bfloat16": 1e-3}


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
