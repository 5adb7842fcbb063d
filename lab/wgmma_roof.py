# Question: What is the tensor-core roof of the Hopper forward's key-tile products on this card, beside cuBLAS?
"""The tensor-core roof of the Hopper forward's products on this card, beside cuBLAS (through
CuPy's matmul), on random bf16 data (lab/wgmma_roof.cu): what the hd 128 forward's key-tile
step could reach if it did nothing but its products, with NC warpgroups per SM and no softmax,
loads or turns. docs/hopper.md ("Where the time goes") reads it against the forward and cuDNN.

    python lab/wgmma_roof.py [--iters 4000] [--rep 10]

Prints, per case, TFLOP/s over the whole grid (CUDA events, median of --rep after warm-up) and
the median clocks per product of one warpgroup (clock64: the SM's cycles, whatever its clock)
beside the ideal, N / 2 clocks per m64nNk16 product times the NC warpgroups sharing the SM.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import compile as gpu_compile

#: (mode, warpgroups per SM, what it is): see wgmma_roof.cu
CASES = [(0, 2, "S = Q K^T, SS m64n128k16"), (1, 2, "O += P V, RS m64n128k16"),
         (2, 2, "S then O += P V (the forward's turn)"), (3, 2, "SS m64n256k16 (GEMM shape)"),
         (0, 3, "S = Q K^T, SS m64n128k16")]
# (modes 1 and 2 with three warpgroups do not fit 168 registers a thread: ptxas spilled and
# waited after every product, so they are not timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=4000, help="key-tile steps per warpgroup")
    ap.add_argument("--rep", type=int, default=10)
    args = ap.parse_args(argv)
    src = (Path(__file__).resolve().parent / "wgmma_roof.cu").read_text()
    names = [f"wgmma_roof<{m}, {nc}>" for m, nc, _ in CASES]
    mod = cp.RawModule(code=src, options=gpu_compile.base_options() + ("-arch=sm_90a",),
                       name_expressions=names)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    fill = cp.random.standard_normal(64 * 1024, dtype=cp.float32).astype(ml_dtypes.bfloat16)
    fill = fill.view(cp.uint32)           # 128 KB of random bf16 bits (uint4 per thread)
    sink = cp.zeros(512, cp.float32)
    print(f"# {_bench.device_line()}; {sms} SMs, {args.iters} key-tile steps per warpgroup")
    print(f"{'case':44s} {'NC':>2} | {'TFLOP/s':>8} {'clk/product':>11} {'ideal':>5}")
    for (mode, nc, what), name in zip(CASES, names):
        fn = mod.get_function(name)
        n = 256 if mode == 3 else 128
        smem = nc * 16384 + 2 * n * 128 + 32768 + 1024
        fn.max_dynamic_shared_size_bytes = smem
        clocks = cp.zeros(sms * nc, cp.int64)
        products = (2 if mode == 2 else 1) * 8          # per step and warpgroup
        flops = sms * nc * args.iters * products * 2 * 64 * n * 16

        def call():
            fn((sms,), (128 * nc,), (fill, clocks, sink, np.int32(args.iters)), shared_mem=smem)
        ms = _bench.time_ms(call, warmup=3, rep=args.rep)
        c = statistics.median(cp.asnumpy(clocks).tolist()) / (args.iters * products)
        print(f"{what:44s} {nc:>2} | {flops / ms / 1e9:8.1f} {c:11.1f} {n / 2 * nc:5.0f}", flush=True)
    a, b = (cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(ml_dtypes.bfloat16)
            for _ in range(2))
    ms = _bench.time_ms(lambda: cp.matmul(a, b), warmup=3, rep=args.rep)
    print(f"{'cuBLAS bf16 8192^3 (cupy.matmul)':44s} {'':>2} | {2 * 8192 ** 3 / ms / 1e9:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
