# Question: Do the bf16x3 float32 products (mma_f32) give A Bᵀ on the kernels' fragments as accurately as float32 math, and how fast are tf32 m16n8k8, bf16 m16n8k8 / m16n8k16 and a whole float32 k8 step (bf16x3 vs 3xTF32) on this card?
"""Checks the fragment claim behind the default float32 products (kernels_cu/common/mma.cuh,
mma_f32): each operand split into three bf16 parts, two products per bf16 m16n8k16 on the tf32
m16n8k8 fragments as the portable kernels load them (lab/probe_mma_f32.cu).

1. Layout: A, B of small integers (exact in bf16; every sum exact in float32) must give A Bᵀ
   bit for bit, one k8 step and many.
2. Accuracy: random normal A [16, K], B [8, K], K = 8 .. 1024, both splits (the module built as
   is and with -DCUPYFLASH_F32_3XTF32), short sums (accumulated per step as S = Q Kᵀ) and
   LONG_SUM: max |C − exact| over 64 draws, beside plain float32 math (cuBLAS float32 A Bᵀ, no
   TF32) on the same inputs, and the ratio.
3. Rates, registers only, 8 independent accumulators per warp: tf32 m16n8k8, bf16 m16n8k8,
   bf16 m16n8k16 (TFLOP/s and ns per instruction per SM); then a whole float32 k8 step as the
   forward's S = Q Kᵀ takes it (A split once, 8 B pairs from shared memory, one mma_f32 each):
   bf16x3 vs 3xTF32, as m16n8k8-equivalent TFLOP/s.

    python lab/probe_mma_f32.py

Prints one line per check and exits 1 on a layout mismatch.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash.gpu import compile as gpu_compile  # noqa: E402

SPLITS = {"bf16x3": (), "3xTF32": ("-DCUPYFLASH_F32_3XTF32",)}
NAMES = ["probe_f32_product<false>", "probe_f32_product<true>", "mma_rate<0>", "mma_rate<1>",
         "mma_rate<2>", "mma_f32_rate<false>", "mma_f32_rate<true>"]


def _modules():
    src = (Path(__file__).resolve().parent / "probe_mma_f32.cu").read_text()
    return {k: cp.RawModule(code=src, options=gpu_compile.base_options() + extra,
                            name_expressions=NAMES) for k, extra in SPLITS.items()}


def _product(fn, a, b):
    steps = a.shape[1] // 8
    c = cp.full((16, 8), cp.nan, cp.float32)
    fn((1,), (32,), (cp.asarray(a, cp.float32), cp.asarray(b, cp.float32), c, np.int32(steps)))
    return cp.asnumpy(c).astype(np.float64)


def _time(fn, args, grid, block):
    fn(grid, block, args)   # warm-up
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(3):
        t0.record()
        fn(grid, block, args)
        t1.record()
        t1.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(t0, t1))
    return best


def main() -> int:
    mods = _modules()
    rng = np.random.default_rng(0)
    bad = 0
    print("1. layout: integer inputs (exact in bf16: the hi parts alone; sums exact in float32) "
          "must give A Bᵀ bit for bit; normal inputs (all three parts) within 16 ulps of Σ|a||b|")
    for split, mod in mods.items():
        for long_sum in (False, True):
            fn = mod.get_function(f"probe_f32_product<{'true' if long_sum else 'false'}>")
            ok = ok_n = 0
            for i in range(20):
                K = 8 if i < 10 else 64
                a = rng.integers(-60, 61, (16, K)).astype(np.float64)
                b = rng.integers(-60, 61, (8, K)).astype(np.float64)
                ok += bool(np.array_equal(_product(fn, a, b), a @ b.T))
                a = rng.standard_normal((16, K)).astype(np.float32).astype(np.float64)
                b = rng.standard_normal((8, K)).astype(np.float32).astype(np.float64)
                err = np.abs(_product(fn, a, b) - a @ b.T)
                ok_n += bool((err <= 16 * 2.0**-24 * (np.abs(a) @ np.abs(b).T)).all())
            bad += (ok != 20) + (ok_n != 20)
            print(f"   {split:7s} {'LONG_SUM' if long_sum else 'short   '}: integers {ok} / 20 exact, "
                  f"normal {ok_n} / 20 within 16 ulps" + ("" if ok == ok_n == 20 else "  MISMATCH"))

    print("2. accuracy: max |C - exact| over 64 draws of normal A [16, K], B [8, K]; "
          "plain = cuBLAS float32 (no TF32)")
    print(f"   {'K':>5} | {'plain':>9} | " + " | ".join(
        f"{s + (' long' if ls else ' short'):>14} {'/plain':>6}" for s in SPLITS for ls in (False, True)))
    for K in (8, 64, 256, 1024):
        errs = {}
        plain = 0.0
        for _ in range(64):
            a = rng.standard_normal((16, K)).astype(np.float32)
            b = rng.standard_normal((8, K)).astype(np.float32)
            exact = a.astype(np.float64) @ b.astype(np.float64).T
            c32 = cp.asnumpy(cp.asarray(a) @ cp.asarray(b).T).astype(np.float64)
            plain = max(plain, float(np.abs(c32 - exact).max()))
            for split, mod in mods.items():
                for ls in (False, True):
                    fn = mod.get_function(f"probe_f32_product<{'true' if ls else 'false'}>")
                    e = float(np.abs(_product(fn, a, b) - exact).max())
                    errs[(split, ls)] = max(errs.get((split, ls), 0.0), e)
        print(f"   {K:>5} | {plain:9.2e} | " + " | ".join(
            f"{errs[(s, ls)]:14.2e} {errs[(s, ls)] / plain:6.2f}" for s in SPLITS for ls in (False, True)))

    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    clock_khz = dev.attributes.get("ClockRate", 0)
    blocks, warps, iters = sms * 4, 8, 4096
    out = cp.empty(blocks * warps * 32, cp.float32)
    args = (out, np.int32(iters))
    print(f"3. rates: {sms} SMs, {blocks // sms} blocks x {warps} warps each, registers only "
          f"(8 independent accumulators per warp); ns / instr / SM = time / (instructions / SMs)")
    mod = mods["bf16x3"]
    base = None
    for shape, what, flop in ((0, "tf32 m16n8k8", 2048), (1, "bf16 m16n8k8", 2048),
                              (2, "bf16 m16n8k16", 4096)):
        ms = _time(mod.get_function(f"mma_rate<{shape}>"), args, (blocks,), (warps * 32,))
        n = blocks * warps * iters * 8
        base = base or ms
        print(f"   {what:14s}: {n * flop / ms / 1e9:7.1f} TFLOP/s, {ms * 1e6 / (n / sms):6.3f} ns / instr / SM "
              f"({ms / base:4.2f}x the tf32 k8 time)")
    print("   whole float32 k8 step (A split once, 8 B pairs from shared memory, one mma_f32 each), "
          "m16n8k8-equivalent TFLOP/s:")
    res = {}
    for split, m in mods.items():
        for ls in (False, True):
            fn = m.get_function(f"mma_f32_rate<{'true' if ls else 'false'}>")
            ms = _time(fn, args, (blocks,), (warps * 32,))
            n = blocks * warps * iters * 8
            res[(split, ls)] = ms
            print(f"   {split:7s} {'LONG_SUM' if ls else 'short   '}: {n * 2048 / ms / 1e9:7.1f} TFLOP/s "
                  f"({ms * 1e6 / (n / sms):6.3f} ns / step / SM)")
    print(f"   bf16x3 / 3xTF32 time: short {res[('bf16x3', False)] / res[('3xTF32', False)]:.2f}, "
          f"LONG_SUM {res[('bf16x3', True)] / res[('3xTF32', True)]:.2f}  (clock {clock_khz / 1e6:.2f} GHz max)")
    print("probe_mma_f32:", "OK" if bad == 0 else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
