# Question: Are the portable float32 kernels, forward and backward, within FlashAttention's criterion (2x the plain float32 computation's error + 1e-6) on its test grid, with the bf16x3 products and with the 3xTF32 ones?
"""float32 accuracy of the portable kernels (kernel="portable": portable/fwd.cu, portable/bwd.cu)
on FlashAttention's test grid, one kernel build per float32 product mode (NVRTC -D flags of
kernels_cu/common/mma.cuh, passed through fwd.forward / bwd.backward's (kernel, extra options)):

    bf16x3     the tree's default: three bf16 parts, six products, every k8 step's products
               added to the accumulator in fp32 (round to nearest)
    bf16x3-RZ  the same products, short sums (S, dP, dS·K, ...) accumulated in the tensor cores
               (-DCUPYFLASH_F32_SHORT_RZ=1)
    3xTF32     the TF32 split (-DCUPYFLASH_F32_3XTF32), short sums in the tensor cores
    3xTF32-RN  the TF32 split, every k8 step added in fp32 (... -DCUPYFLASH_F32_SHORT_RZ=0)

Grid: head dims 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256; seqlens (1, 147),
(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
(1023, 1024), (1024, 1023), (2048, 2048); causal (bottom-right) and not; batch 2, 4 query heads
with 4, 2 or 1 kv heads in turn (264 cases); plus a few extra cases (the GPU fuzz failure: one key,
d 128, d_v 236, strided). Inputs standard normal float32, scale 1/sqrt(d).

Per case and output (out, lse, dq, dk, dv): err = max |got − ref| against the float64 computation
of the same float32 inputs (tests/gpu/gpu_util.naive_attention in float64 on the GPU), naive =
the same for the plain float32 computation (cuBLAS float32 matmuls, no TF32; its backward by
hand). A case passes when every output has err <= 2 · naive + 1e-6. Prints per mode: cases
passed, and per output the median and worst err / naive; then the worst cases of the default.

    python lab/f32_accuracy_grid.py [--modes bf16x3 3xTF32] [--quick] [--workers 16]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash.gpu import bwd as gpu_bwd, compile as gpu_compile, device, fwd as gpu_fwd  # noqa: E402
from cupyflash.gpu import plan_bwd, plan_fwd  # noqa: E402
from cupyflash._options import Options  # noqa: E402

MODES = {
    "bf16x3": (),
    "bf16x3-RZ": ("-DCUPYFLASH_F32_SHORT_RZ=1",),
    "3xTF32": ("-DCUPYFLASH_F32_3XTF32",),
    "3xTF32-RN": ("-DCUPYFLASH_F32_3XTF32", "-DCUPYFLASH_F32_SHORT_RZ=0"),
}
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
SEQLENS = ((1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
           (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048))
OUTPUTS = ("out", "lse", "dq", "dk", "dv")
FLOOR = 1e-6


def grid_cases(quick=False):
    """(label, b, s_q, s_k, h, h_k, d, d_v, causal, layout) for the grid, then the extras."""
    cases = []
    i = 0
    hds = HEAD_DIMS[::3] if quick else HEAD_DIMS
    sls = SEQLENS[1::3] if quick else SEQLENS
    for d in hds:
        for sq, sk in sls:
            for causal in (False, True):
                hk = (4, 2, 1)[i % 3]
                i += 1
                cases.append((f"grid hd{d} {sq}x{sk}{' causal' if causal else ''} hk{hk}",
                              2, sq, sk, 4, hk, d, d, causal, "bshd"))
    extra = [("fuzz 163x1 d128 dv236 strided", 1, 163, 1, 8, 2, 128, 236, False, "sstride"),
             ("fuzz 163x1 d128 dv236", 1, 163, 1, 8, 2, 128, 236, False, "bshd"),
             ("one key 300x1 d64", 2, 300, 1, 4, 2, 64, 64, False, "bshd"),
             ("d64 dv256 500x700", 1, 500, 700, 4, 2, 64, 256, True, "bhsd")]
    return cases, extra


def variants_of(case, smem, num_sms):
    """(forward Variant, backward BwdVariant) the planners pick for ``case`` (kernel="portable")."""
    _, b, sq, sk, h, hk, d, dv, causal, _ = case
    kw = dict(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
    fv = plan_fwd.plan_forward("float32", b, sq, sk, h, hk, d, dv, smem_optin=smem, **kw).variant
    bv = plan_bwd.plan_backward("float32", b, sq, sk, h, hk, d, dv, smem_optin=smem,
                                num_sms=num_sms, **kw).variant
    return fv, bv


def _compile_job(job):
    variant, extra = job
    src, opts, names = gpu_compile.program([variant], extra)
    cp.RawModule(code=src, options=opts, name_expressions=names).compile()
    return variant.name


def precompile(jobs, workers):
    """Fill CuPy's disk cache for (variant, extra options) pairs, ``workers`` processes."""
    import concurrent.futures as cf
    import multiprocessing as mp
    jobs = sorted(set(jobs), key=lambda j: (-j[0].d, j[0].name, j[1]))   # big ones first
    t0 = time.perf_counter()
    if workers <= 1:
        for j in jobs:
            _compile_job(j)
    else:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(_compile_job, jobs))
    print(f"# precompiled {len(jobs)} (variant, flags) programs in {time.perf_counter() - t0:.1f} s "
          f"({workers} workers)", flush=True)


def _alloc(shape, layout):
    import gpu_util
    return gpu_util.alloc(shape, cp.float32, layout)


def _maxerr(got, ref):
    """max |got − ref| over the finite elements of ref; inf where got's -inf pattern differs."""
    got = got.astype(cp.float64)
    fin = cp.isfinite(ref)
    if not bool((cp.isneginf(got) == cp.isneginf(ref)).all()):
        return math.inf
    if not bool(fin.any()):
        return 0.0
    return float(cp.abs(cp.where(fin, got - cp.where(fin, ref, 0), 0)).max())


def run_case(case, modes, rng):
    """{mode: {output: (err, naive err)}} for one case."""
    import gpu_util
    label, b, sq, sk, h, hk, d, dv, causal, layout = case
    host = [rng.standard_normal(s, dtype=np.float32)
            for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, h, dv))]
    q, k, v, dout = (_alloc(x.shape, layout) for x in host)
    for dst, x in zip((q, k, v, dout), host):
        dst[...] = cp.asarray(x)
    scale = 1 / math.sqrt(d)
    keep, _ = gpu_util.keep_mask(sq, sk, -1, 0 if causal else -1, True)
    q64, k64, v64, do64 = (cp.asarray(x, cp.float64) for x in host)
    ref = gpu_util.naive_attention(q64, k64, v64, do64, cp.float64, scale, keep, acc=cp.float64)
    nai = gpu_util.naive_attention(*(cp.asarray(x) for x in host), cp.float32, scale, keep)
    refs = dict(zip(OUTPUTS, ref[:5]))
    naive = {w: _maxerr(x, refs[w]) for w, x in zip(OUTPUTS, nai[:5])}
    opts = Options(scale=scale, window_right=0 if causal else -1)
    res = {}
    for mode in modes:
        extra = MODES[mode]
        out = _alloc((b, sq, h, dv), layout)
        out.fill(cp.nan)
        lse = cp.full((b, h, sq), cp.nan, cp.float32)
        gpu_fwd.forward(q, k, v, out, lse, opts, kernel=("portable", extra))
        grads = [_alloc(x.shape, layout) for x in (q, k, v)]
        for g in grads:
            g.fill(cp.nan)
        gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, kernel=("portable", extra))
        got = dict(zip(OUTPUTS, (out, lse, *grads)))
        res[mode] = {w: (_maxerr(got[w], refs[w]), naive[w]) for w in OUTPUTS}
    return res


def passes(row):
    return all(e <= 2 * n + FLOOR for e, n in row.values())


def summary(title, results, modes):
    print(f"\n## {title}: {len(results)} cases; criterion err <= 2 * naive + {FLOOR:g}")
    if not results:
        print("(no cases run)")
        return
    hdr = f"{'mode':>10} | {'pass':>9} | " + " | ".join(f"{w + ' med/max':>15}" for w in OUTPUTS)
    print(hdr + f" | {'worst case (err/naive)'}")
    for mode in modes:
        rows = [r[mode] for _, r in results]
        npass = sum(passes(r) for r in rows)
        cells = []
        worst = (0.0, "")
        for w in OUTPUTS:
            ratios = [e / n if n > 0 else (0.0 if e == 0 else math.inf) for e, n in (r[w] for r in rows)]
            cells.append(f"{statistics.median(ratios):6.2f} / {max(ratios):6.2f}")
            for (label, r), x in zip(results, ratios):
                if x > worst[0]:
                    worst = (x, f"{label} {w}")
        print(f"{mode:>10} | {npass:4d}/{len(rows):<4d} | " + " | ".join(f"{c:>15}" for c in cells)
              + f" | {worst[1]} {worst[0]:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--quick", action="store_true", help="a quarter of the grid")
    ap.add_argument("--workers", type=int, default=16, help="compile processes")
    ap.add_argument("--show", type=int, default=8, help="failing cases listed per mode")
    ap.add_argument("--budget", type=float, default=math.inf,
                    help="seconds (after the compile) after which no more grid cases start; the "
                         "grid runs in a fixed shuffled order, so a cut run is a sample of it")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cc, smem, num_sms = device.info(cp.cuda.runtime.getDevice())
    cases, extra = grid_cases(args.quick)
    jobs = []
    for case in cases + extra:
        for v in variants_of(case, smem, num_sms):
            jobs += [(v, MODES[m]) for m in args.modes]
    precompile(jobs, args.workers)
    t_run = time.perf_counter()
    print(f"# compiled {len(jobs)} programs in {t_run - t0:.1f} s", flush=True)
    rng = np.random.default_rng(34)
    order = [cases[i] for i in np.random.default_rng(0).permutation(len(cases))]
    results, extra_res = [], []
    for case in extra + order:
        if case in cases and time.perf_counter() - t_run > args.budget:
            print(f"# budget spent: {len(results)} of {len(cases)} grid cases run")
            break
        r = run_case(case, args.modes, rng)
        (results if case in cases else extra_res).append((case[0], r))
        cp.get_default_memory_pool().free_all_blocks()
    print(f"# float32 accuracy, portable kernels, cc {cc}; {time.perf_counter() - t0:.1f} s")
    summary("FlashAttention grid", results, args.modes)
    summary("extra cases", extra_res, args.modes)
    for mode in args.modes:
        bad = [(label, r[mode]) for label, r in results + extra_res if not passes(r[mode])]
        if not bad:
            continue
        print(f"\n{mode}: {len(bad)} failing cases (output err / naive; first {args.show}):")
        for label, row in bad[:args.show]:
            print(f"  {label}: " + "  ".join(f"{w} {e:.2e}/{n:.2e}" for w, (e, n) in row.items()
                                              if e > 2 * n + FLOOR))
    print("\n## extra cases, per output err / naive:")
    for label, r in extra_res:
        print(f"  {label}: " + " | ".join(
            f"{m} " + " ".join(f"{w} {e / n if n else 0:.2f}" for w, (e, n) in r[m].items())
            for m in args.modes))
    print(f"# {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
