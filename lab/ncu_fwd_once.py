# Question: what does Nsight Compute see in one forward (ours or cuDNN's) on a benchmark shape? (the call it profiles)
"""One forward of cupyflash and/or one of SDPA's cuDNN backend on a FlashAttention benchmark shape,
for Nsight Compute (bf16; the shapes of `python -m cupyflash bench`).

    ncu --clock-control none --set full --import-source yes -k regex:flash_fwd_sm90 -c 1 \\
        -o /tmp/fwd python lab/ncu_fwd_once.py 128 2048 0 ours
    ncu -i /tmp/fwd.ncu-rep --page source --csv --print-source sass > /tmp/fwd.csv
    python lab/ncu_sass_stalls.py /tmp/fwd.csv

Arguments: head dim, seqlen, causal (0 / 1), and which of "ours", "cudnn", "both" (default).
"""
import sys

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, ".")
import cupyflash as cf  # noqa: E402
from cupyflash._bench import HIDDEN, TOKENS  # noqa: E402


def main(argv):
    hd, s, causal = int(argv[0]), int(argv[1]), argv[2] == "1"
    which = argv[3] if len(argv) > 3 else "both"
    b, h = max(1, TOKENS // s), max(1, HIDDEN // hd)
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v = (cp.asarray(rng.standard_normal((b, s, h, hd), np.float32)).astype(bf16) for _ in range(3))
    if which in ("both", "ours"):
        cf.attention(q, k, v, causal=causal)
        cp.cuda.Device().synchronize()
    if which in ("both", "cudnn"):
        from benchmarks import peers
        fn = peers.PEERS["cudnn"](q, k, v, causal, "fwd")   # (runs it once itself)
        fn()
        cp.cuda.Device().synchronize()
    print("done", hd, s, causal, b, h)


if __name__ == "__main__":
    main(sys.argv[1:])
