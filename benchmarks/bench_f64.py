"""float64 attention speed on the GPU: the f64_t kernels (DMMA) beside cuBLAS DGEMM and the plain
CuPy float64 recipe.

    PYTHONPATH=. python benchmarks/bench_f64.py [--quick] [--causal] [--fwd-ab] [--bwd-ab] [--mma-ab]
                                                [--json PATH]

Tables:
1. long sequences: head dims 64 and 128, seqlen 1k, 2k, 4k, 8k, 16k with batch · seqlen = 16k
   tokens and heads = 2048 / head dim (FlashAttention's benchmark shapes), non-causal
   (``--causal``: causal too). Forward and backward TFLOP/s (FlashAttention's count:
   4·b·h·s²·d, backward 2.5x), each as a percentage of cuBLAS DGEMM's TFLOP/s measured in the same
   run (cupy.matmul of two 8192 x 8192 float64 matrices), and the speedup over the plain CuPy
   float64 recipe where that fits in memory.
2. short sequences: head dim 64, seqlen 64 / 128 / 256, batch · heads = 16384 (16 heads), the
   same columns.

The plain recipe: S = scale · Q Kᵀ, P = softmax(S) (max, exp, sum, divide), O = P V, all
float64 CuPy; its backward by hand from the stored P (what autograd keeps): dV = Pᵀ dO,
dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = scale · dS K, dK = scale · dSᵀ Q. It runs when
its score-sized arrays (forward 3, backward 4) fit in --max-gb.
Timing: CUDA events on the current stream, warm-up first, median of the repeats.
--fwd-ab / --bwd-ab: the forward / backward with alternative tiles (FWD_AB / BWD_AB) beside the
planner's, seqlen 4096.
--mma-ab: the forward built with -DCUPYFLASH_F64_MMA884 (four m8n8k4 per m16n8k8 step, as on
sm_80) beside the default build (sm_90: one m16n8k8 .f64), seqlen 4096.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash as cf  # noqa: E402
from cupyflash._bench import time_ms  # noqa: E402

TOKENS, HIDDEN = 16384, 2048


def dgemm_tflops(n=8192, reps=5):
    a = cp.random.standard_normal((n, n))
    b = cp.random.standard_normal((n, n))
    ms = time_ms(lambda: cp.matmul(a, b), warmup=2, rep=reps)
    return 2.0 * n ** 3 / ms / 1e9


def flops(b, h, s, d, causal, bwd=False):
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * 2.5 if bwd else f


def plain_recipe(q, k, v, dout, causal):
    """(forward, backward) closures of the plain float64 CuPy computation (module docstring);
    q, k, v, dout bshd."""
    b, s, h, d = q.shape
    qt, kt, vt, dot = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    scale = 1.0 / math.sqrt(d)
    above = cp.where(cp.triu(cp.ones((s, s), bool), 1), -cp.inf, 0.0) if causal else None
    saved = {}

    def fwd():
        sc = cp.matmul(qt, kt.swapaxes(-1, -2))
        sc *= scale
        if above is not None:
            sc += above                      # -inf above the diagonal
        sc -= sc.max(-1, keepdims=True)
        cp.exp(sc, out=sc)
        sc /= sc.sum(-1, keepdims=True)
        saved["p"] = sc
        saved["o"] = cp.matmul(sc, vt)
        return saved["o"]

    def bwd():
        p, o = saved["p"], saved["o"]
        dv = cp.matmul(p.swapaxes(-1, -2), dot)
        ds = cp.matmul(dot, vt.swapaxes(-1, -2))
        ds -= (dot * o).sum(-1, keepdims=True)
        ds *= p
        dq = cp.matmul(ds, kt) * scale
        dk = cp.matmul(ds.swapaxes(-1, -2), qt) * scale
        return dq, dk, dv

    return fwd, bwd


def measure(b, s, h, d, causal, dgemm, max_gb, reps):
    rng = cp.random.default_rng()
    q, k, v, dout = (rng.standard_normal((b, s, h, d)) for _ in range(4))
    out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
    f_ms = time_ms(lambda: cf.attention(q, k, v, causal=causal), warmup=1, rep=reps)
    b_ms = time_ms(lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=causal),
                   warmup=1, rep=reps)
    row = dict(b=b, s=s, h=h, d=d, causal=causal,
               fwd_tflops=flops(b, h, s, d, causal) / f_ms / 1e9,
               bwd_tflops=flops(b, h, s, d, causal, True) / b_ms / 1e9)
    row["fwd_pct_dgemm"] = 100 * row["fwd_tflops"] / dgemm
    row["bwd_pct_dgemm"] = 100 * row["bwd_tflops"] / dgemm
    score_bytes = b * h * s * s * 8
    row["plain_fwd_x"] = row["plain_bwd_x"] = None
    if 4 * score_bytes <= max_gb * 1e9:
        pf, pb = plain_recipe(q, k, v, dout, causal)
        pf_ms = time_ms(pf, warmup=1, rep=reps)
        pb_ms = time_ms(pb, warmup=1, rep=reps)
        row["plain_fwd_tflops"] = flops(b, h, s, d, causal) / pf_ms / 1e9
        row["plain_bwd_tflops"] = flops(b, h, s, d, causal, True) / pb_ms / 1e9
        row["plain_fwd_x"] = pf_ms / f_ms
        row["plain_bwd_x"] = pb_ms / b_ms
        del pf, pb
    del q, k, v, dout, out, lse
    cp.get_default_memory_pool().free_all_blocks()
    return row


#: backward tiles (BM, NW, WD, NBUF) tried beside the planner's by --bwd-ab: WD halved or
#: quartered (fewer recomputed Sᵀ / dPᵀ, some spills), fewer warps
BWD_AB = {32: [(16, 4, 1, 1), (32, 4, 1, 1)],
          64: [(16, 8, 1, 1), (16, 4, 1, 1), (32, 8, 1, 1)],
          96: [(16, 4, 2, 1), (16, 8, 2, 1), (16, 8, 1, 1)],
          128: [(16, 8, 2, 1), (16, 4, 2, 1), (16, 8, 1, 1)],
          192: [(16, 8, 4, 1), (16, 8, 2, 1)],
          256: [(16, 8, 4, 1), (16, 8, 2, 1)]}
#: forward tiles (BM, BN, NW, STAGES) tried beside the planner's by --fwd-ab
FWD_AB = {32: [(64, 64, 4, 2), (128, 64, 8, 1), (64, 32, 4, 1)],
          64: [(64, 64, 4, 1), (64, 32, 4, 2), (128, 32, 8, 1), (64, 16, 4, 1)],
          96: [(64, 16, 4, 1), (64, 32, 4, 2), (128, 32, 8, 1)],
          128: [(64, 16, 4, 1), (64, 32, 4, 2), (128, 32, 8, 1), (128, 16, 8, 1)],
          192: [(64, 32, 4, 1), (128, 16, 8, 1)],
          256: [(32, 32, 2, 1), (64, 16, 4, 1)]}


def _shape(d, s):
    return TOKENS // s, max(HIDDEN // d, 8)


def _compiled(vs, lines):
    """The variants of ``vs`` that compile (the rest noted in ``lines``)."""
    from cupyflash.gpu import compile as gpu_compile

    try:
        gpu_compile.precompile(vs, workers=16)
        return vs
    except Exception:  # noqa: BLE001 -- an invalid tile: find which, keep the others
        ok = []
        for v in vs:
            try:
                gpu_compile.precompile([v], workers=1)
                ok.append(v)
            except Exception as e:  # noqa: BLE001
                lines.append(f"  {v.name}: does not compile ({str(e).splitlines()[0][:60]})")
        return ok


def _time_tiles(lines, d, base, vs, run, fl, reps):
    """Time ``run(variant)`` for each of ``vs`` (FLOPs ``fl``) and append one line per variant,
    ``base`` tagged as the planner's."""
    for var in vs:
        ms = time_ms(lambda: run(var), warmup=1, rep=reps)
        tag = "planner" if var == base else "alternative"
        lines.append(f"  hd {d:3d} {var.name:34s} {fl / ms / 1e9:7.2f} TFLOP/s  ({tag})")


def bwd_ab(reps, s=4096):
    """Backward TFLOP/s of the planner's float64 tiles and the BWD_AB alternatives (non-causal,
    seqlen ``s``, 16k tokens, hidden 2048), through the launcher with a forced BwdVariant."""
    from cupyflash import _checks
    from cupyflash.gpu import bwd as gpu_bwd, plan_bwd

    smem = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    lines = [f"\n## float64 backward tiles, seqlen {s}, 16k tokens (BM x BN, warps, WD, buffers)"]
    for d, alts in BWD_AB.items():
        b, h = _shape(d, s)
        base = plan_bwd.plan_backward("float64", b, s, s, h, h, d, d, scale=d ** -0.5,
                                      smem_optin=smem).variant
        vs = [base] + [plan_bwd.BwdVariant("f64_t", d, bm, nw, wd, nb, False, False)
                       for bm, nw, wd, nb in alts]
        vs = _compiled([v for v in vs if v.smem_bytes <= smem], lines)
        rng = cp.random.default_rng()
        q, k, v, dout = (rng.standard_normal((b, s, h, d)) for _ in range(4))
        out, lse = cf.attention(q, k, v, return_lse=True)
        opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, dtype=np.float64)
        grads = [cp.empty_like(x) for x in (q, k, v)]
        _time_tiles(lines, d, base, vs,
                    lambda var: gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, kernel=var),
                    flops(b, h, s, d, False, True), reps)
        del q, k, v, dout, out, lse, grads
        cp.get_default_memory_pool().free_all_blocks()
    return "\n".join(lines)


def fwd_ab(reps, s=4096):
    """Forward TFLOP/s of the planner's float64 variant and the FWD_AB alternatives (non-causal,
    seqlen ``s``, 16k tokens, hidden 2048), through the launcher with a forced Variant."""
    from cupyflash import _checks
    from cupyflash.gpu import fwd as gpu_fwd, plan_fwd

    smem = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    lines = [f"\n## float64 forward tiles, seqlen {s}, 16k tokens (BM x BN, warps, stages)"]
    for d, alts in FWD_AB.items():
        b, h = _shape(d, s)
        base = plan_fwd.plan_forward("float64", b, s, s, h, h, d, d, scale=d ** -0.5,
                                     smem_optin=smem).variant
        vs = [base] + [plan_fwd.Variant("f64_t", d, bm, bn, nw, False, False, st)
                       for bm, bn, nw, st in alts]
        vs = _compiled([v for v in vs if v.smem_bytes <= smem], lines)
        rng = cp.random.default_rng()
        q, k, v = (rng.standard_normal((b, s, h, d)) for _ in range(3))
        opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, dtype=np.float64)
        out, lse = cp.empty_like(q), cp.empty((b, h, s))
        _time_tiles(lines, d, base, vs,
                    lambda var: gpu_fwd.forward(q, k, v, out, lse, opts, kernel=var),
                    flops(b, h, s, d, False), reps)
        del q, k, v, out, lse
        cp.get_default_memory_pool().free_all_blocks()
    return "\n".join(lines)


def fwd_mma_ab(reps, s=4096):
    """Forward TFLOP/s of the planner's float64 variant as built (sm_90: one m16n8k8 .f64 per
    step) and with -DCUPYFLASH_F64_MMA884 (four m8n8k4 DMMAs, as on sm_80), through the launcher
    with a forced (variant, options) pair; non-causal, seqlen ``s``, 16k tokens, hidden 2048.
    Also the largest difference between the two outputs (the same sums: 0 expected)."""
    from cupyflash import _checks
    from cupyflash.gpu import fwd as gpu_fwd, plan_fwd

    smem = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    lines = [f"\n## float64 forward, 1 x m16n8k8 (sm_90) vs 4 x m8n8k4, seqlen {s}"]
    for d in (64, 128):
        b, h = TOKENS // s, HIDDEN // d
        var = plan_fwd.plan_forward("float64", b, s, s, h, h, d, d, scale=d ** -0.5,
                                    smem_optin=smem).variant
        rng = cp.random.default_rng()
        q, k, v = (rng.standard_normal((b, s, h, d)) for _ in range(3))
        opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, dtype=np.float64)
        outs = []
        for extra in ((), ("-DCUPYFLASH_F64_MMA884=1",)):
            out, lse = cp.empty_like(q), cp.empty((b, h, s))
            ms = time_ms(lambda: gpu_fwd.forward(q, k, v, out, lse, opts, kernel=(var, extra)),
                         warmup=1, rep=reps)
            outs.append(out)
            lines.append(f"  hd {d:3d} {var.name:30s} {'4 x m8n8k4' if extra else 'default':10s} "
                         f"{flops(b, h, s, d, False) / ms / 1e9:7.2f} TFLOP/s")
        lines.append(f"  hd {d:3d} max |difference| {float(cp.abs(outs[0] - outs[1]).max()):.2e}")
    return "\n".join(lines)


def table(rows, title):
    lines = [title,
             f"{'hd':>4} {'seqlen':>6} {'batch':>5} {'heads':>5} {'causal':>6} | "
             f"{'fwd TF/s':>8} {'%DGEMM':>6} {'bwd TF/s':>8} {'%DGEMM':>6} | "
             f"{'plain fwd':>9} {'plain bwd':>9} {'fwd x':>6} {'bwd x':>6}"]
    for r in rows:
        pf = f"{r['plain_fwd_tflops']:9.2f}" if r["plain_fwd_x"] else f"{'-':>9}"
        pb = f"{r['plain_bwd_tflops']:9.2f}" if r["plain_bwd_x"] else f"{'-':>9}"
        fx = f"{r['plain_fwd_x']:6.2f}" if r["plain_fwd_x"] else f"{'-':>6}"
        bx = f"{r['plain_bwd_x']:6.2f}" if r["plain_bwd_x"] else f"{'-':>6}"
        lines.append(f"{r['d']:4d} {r['s']:6d} {r['b']:5d} {r['h']:5d} {str(r['causal']):>6} | "
                     f"{r['fwd_tflops']:8.2f} {r['fwd_pct_dgemm']:5.0f}% {r['bwd_tflops']:8.2f} "
                     f"{r['bwd_pct_dgemm']:5.0f}% | {pf} {pb} {fx} {bx}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="seqlens 1k, 4k, 16k only; 2 repeats")
    p.add_argument("--causal", action="store_true", help="causal rows too")
    p.add_argument("--max-gb", type=float, default=80.0, help="memory the plain recipe may use")
    p.add_argument("--fwd-ab", action="store_true", help="also time alternative forward tiles")
    p.add_argument("--bwd-ab", action="store_true", help="also time alternative backward tiles")
    p.add_argument("--mma-ab", action="store_true",
                   help="also time the forward with four m8n8k4 per step (-DCUPYFLASH_F64_MMA884)")
    p.add_argument("--ab-only", action="store_true", help="only the A/B tables")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    reps = 2 if a.quick else 3
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    dgemm = dgemm_tflops()
    print(f"# {name}, compute capability {dev.compute_capability}; cuBLAS DGEMM 8192^3: "
          f"{dgemm:.2f} TFLOP/s")
    if a.fwd_ab:
        print(fwd_ab(reps))
    if a.bwd_ab:
        print(bwd_ab(reps))
    if a.mma_ab:
        print(fwd_mma_ab(reps))
    if a.ab_only:
        return 0
    seqlens = (1024, 4096, 16384) if a.quick else (1024, 2048, 4096, 8192, 16384)
    causals = (False, True) if a.causal else (False,)
    long_rows = [measure(TOKENS // s, s, HIDDEN // d, d, c, dgemm, a.max_gb, reps)
                 for d in (64, 128) for c in causals for s in seqlens]
    print(table(long_rows, "\n## float64, batch x seqlen = 16k tokens, hidden 2048"))
    short_rows = [measure(16384 // 16, s, 16, 64, c, dgemm, a.max_gb, reps)
                  for c in causals for s in (64, 128, 256)]
    print(table(short_rows, "\n## float64 short sequences, hd 64, batch x heads = 16384"))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=name, dgemm_tflops=dgemm,
                                                long=long_rows, short=short_rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
