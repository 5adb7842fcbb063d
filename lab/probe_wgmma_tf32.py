# Question: How many clocks does a TF32 wgmma m64nNk8 product take, operands in shared memory or A in registers?
"""TF32 wgmma rates on the H200 (lab/probe_wgmma_tf32.cu): clocks per m64nNk8 product,
shared-memory operands (SS) or A from registers (RS), one or two warpgroups per SM. The float32
backward's budget (docs/f32-backward-design.md, lab/f32_bwd_budget.py) assumes N / 2 clocks per
product and 128 B / clock of shared-memory operand traffic (SS m64n32k8: 192 B / clock needed,
so 24 clocks instead of 16 if the assumption holds).

    python lab/probe_wgmma_tf32.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash.gpu import compile as gpu_compile  # noqa: E402


def main() -> int:
    src = (Path(__file__).resolve().parent / "probe_wgmma_tf32.cu").read_text()
    cases = [(n, mode, wgs) for n in (32, 64, 128) for mode in (0, 1) for wgs in (1, 2)]
    names = [f"probe_wgmma_tf32<{n}, {mode}, {wgs}>" for n, mode, wgs in cases]
    opts = gpu_compile.base_options() + ("-arch=sm_90a",)
    mod = cp.RawModule(code=src, options=opts, name_expressions=names)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    iters = 2000
    print(f"# {sms} SMs, {iters} x 8 products per warpgroup")
    print(f"{'N':>4} {'mode':>4} {'wgs':>3} | {'clk/product':>11} {'ideal':>6} {'B/clk':>7} | per SM")
    for (n, mode, wgs), name in zip(cases, names):
        fn = mod.get_function(name)
        smem = wgs * 2 * 64 * 128 + 2 * n * 128 + 1024
        fn.max_dynamic_shared_size_bytes = smem
        clocks = cp.zeros(sms * wgs, cp.int64)
        fn((sms,), (128 * wgs,), (clocks, np.int32(iters)), shared_mem=smem)
        cp.cuda.get_current_stream().synchronize()
        c = float(cp.median(clocks.astype(cp.float64)))
        per = c / (iters * 8)                      # clocks per product of one warpgroup
        per_sm = per / wgs                         # products of the SM overlap across warpgroups
        byts = (2048 if mode == 0 else 0) + 32 * n
        print(f"{n:>4} {('SS', 'RS')[mode]:>4} {wgs:>3} | {per:11.1f} {n / 2:6.1f} {byts / per_sm:7.1f} |"
              f" {n / 2 / per_sm:5.0%} of the assumed peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
