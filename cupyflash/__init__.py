"""cupyflash: FlashAttention for CuPy and NumPy users (exact attention, O(N) memory, no PyTorch).

    import cupyflash as cf
    out = cf.attention(q, k, v, causal=True)            # q (batch, seqlen, heads, head_dim)
    out, vjp = cf.attention_vjp(q, k, v); dq, dk, dv = vjp(dout)
"""
from .api import (
    attention,
    attention_backward,
    attention_varlen,
    attention_varlen_backward,
    attention_vjp,
)
from .kvcache import attention_with_kvcache

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_vjp",
    "attention_with_kvcache",
]
