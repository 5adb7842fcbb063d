"""cupyflash: FlashAttention for CuPy and NumPy users (exact attention, O(N) memory, no PyTorch)."""
__version__ = "0.1.0"
