"""PyTorch SDPA peers for the benchmarks (``python -m cupyflash bench --peers benchmarks.peers``).

PyTorch is a benchmark peer only: this module lives outside the package. Each peer is a factory
``peer(q, k, v, causal, direction) -> callable | None`` over CuPy bshd arrays (zero-copy into
torch's (b, h, s, d) view); it raises when the backend refuses the problem.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

_BF16 = np.dtype(ml_dtypes.bfloat16)


@functools.lru_cache(maxsize=None)
def _torch():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    return (torch, SDPBackend, sdpa_kernel) if torch.cuda.is_available() else None


def to_torch(x):
    """A CuPy array as a torch tensor on the same memory (bfloat16 through a uint16 view)."""
    torch = _torch()[0]
    if x.dtype == _BF16:
        return torch.as_tensor(x.view(np.uint16), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(x, device="cuda")


def _sdpa_peer(backend_name):
    def peer(q, k, v, causal, direction):
        tt = _torch()
        if tt is None:
            return None
        torch, SDPBackend, sdpa_kernel = tt
        backend = getattr(SDPBackend, backend_name)
        tq, tk, tv = (to_torch(x).transpose(1, 2) for x in (q, k, v))   # (b, h, s, d) views
        enable_gqa = tq.shape[1] != tk.shape[1]

        def fwd(tq, tk, tv):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=causal, enable_gqa=enable_gqa)

        if direction == "fwd":
            fwd(tq, tk, tv)  # raises here if the backend refuses the problem
            return lambda: fwd(tq, tk, tv)
        leaves = [x.detach().clone().requires_grad_() for x in (tq, tk, tv)]
        out = fwd(*leaves)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)

    peer.__name__ = f"sdpa_{backend_name.lower()}"
    return peer


PEERS = {
    "flash": _sdpa_peer("FLASH_ATTENTION"),
    "cudnn": _sdpa_peer("CUDNN_ATTENTION"),
    "memeff": _sdpa_peer("EFFICIENT_ATTENTION"),
}


def try_peer(name, q, k, v, causal, direction):
    """``PEERS[name](q, k, v, causal, direction)``, or None (reason printed) where it cannot run:
    torch missing, or the backend refuses the call."""
    try:
        return PEERS[name](q, k, v, causal, direction)
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: {type(e).__name__}: {e}")
        return None
