"""The normalized options every backend (cpu.py, the GPU launcher) receives.

Validation (_checks.py) turns the user's keyword arguments into one ``Options``; nothing
downstream re-interprets user input. Pure Python, no GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: Sentinel for an unbounded window side (FlashAttention's window_size convention).
UNBOUNDED = -1


@dataclass(frozen=True)
class Options:
    """Attention options after validation.

    Scores, in this order (docs/semantics.md §2)::

        s = scale * q @ k.T                       # [b, h, s_q, s_k]
        s = softcap * tanh(s / softcap)           # when softcap > 0
        s = s + bias                              # when bias is not None
        s = s - slope[b, h] * |diag(i) - j|       # when alibi_slopes is not None
        s = -inf where not kept(i, j) or mask is False

    with ``diag(i) = i + (s_k - s_q)`` when ``bottom_right`` else ``diag(i) = i``, and key j kept
    when ``diag(i) - window_left <= j <= diag(i) + window_right`` (a side equal to UNBOUNDED, -1,
    is not bounded). ``causal=True`` is ``window_right = 0``.

    Attributes
    ----------
    scale : float
        Multiplies q·k (default 1/sqrt(head_dim), resolved by validation).
    window_left, window_right : int
        Window sides, >= 0 or UNBOUNDED (-1).
    bottom_right : bool
        Diagonal alignment: True for FlashAttention >= 2.1 (bottom-right), False for top-left.
    softcap : float
        0.0 means off.
    alibi_slopes : array or None
        [b or 1, h] in the backend's array module, already 2-D: float32 CuPy for the GPU
        kernels, float64 NumPy on the CPU path.
    bias : array or None
        4-D, each dimension 1 or full, broadcastable to [b, h, s_q, s_k]; float dtype.
    bias_shape : tuple or None
        The user's own bias shape, for reducing dbias back to it.
    mask : array or None
        4-D bool broadcastable to [b, h, s_q, s_k]; True = attend.
    deterministic : bool
        Backward: bit-identical results across runs.
    allow_tf32 : bool
        float32 inputs: allow plain TF32 tensor-core products (faster, ~1e-3 relative error).
    """

    scale: float
    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    bottom_right: bool = True
    softcap: float = 0.0
    alibi_slopes: Optional[Any] = None
    bias: Optional[Any] = None
    bias_shape: Optional[tuple] = None
    mask: Optional[Any] = None
    deterministic: bool = False
    allow_tf32: bool = False

    @property
    def causal(self) -> bool:
        """True when no key right of the diagonal is kept."""
        return self.window_right == 0

    def diag_offset(self, seqlen_q: int, seqlen_k: int) -> int:
        """Column of row 0's diagonal: s_k - s_q (bottom-right) or 0 (top-left)."""
        return seqlen_k - seqlen_q if self.bottom_right else 0
