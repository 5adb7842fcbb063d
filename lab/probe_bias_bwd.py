# Question: Where does the Hopper bias backward's time go (staging, loads, dbias)?
"""Where the Hopper bias backward's time goes (issue 6 probe, not a benchmark of record).

bf16, hd 128, 16 heads, 16k tokens, bias (1, h, s, s): the backward without a bias (baseline),
with bias + dbias as planned (BIAS_TMA: the bias tile staged by TMA), and variations, timing only:
``ld16`` the consumers' global bias loads instead (BIAS_LD16, the kernel before BIAS_TMA),
``tma_dp_early`` BIAS_TMA built with -DBIAS_TMA_DP_EARLY=1 (dPᵀ issued before Pᵀ; spills),
``bias_no_memory`` a bias tensor map whose boxes fall outside it (zero fill: no bias traffic),
``dbias_passes`` the launcher's float32 dbias accumulator zeroing and conversion alone, and
the planned launch with one Params field changed (results then wrong): dbias_accum = 0 (no dbias
writes), DBIAS_STORE forced (plain stores instead of red.add), DBIAS_SCHED_B cleared. CUDA
events, median of 5.

    python lab/probe_bias_bwd.py [--seqlens 1024,4096]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench, _checks  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd
from cupyflash.gpu import bwd_sm90
from cupyflash.gpu import compile as gpu_compile
from cupyflash.gpu import fwd as gpu_fwd
from cupyflash.gpu import params as gpu_params
from cupyflash.gpu import plan_bwd_sm90
from cupyflash.gpu import tma as gpu_tma

BF16 = np.dtype(ml_dtypes.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="1024,4096")
    a = ap.parse_args()
    H, D = 16, 128
    for s in (int(x) for x in a.seqlens.split(",")):
        b = 16384 // s
        rnd = lambda *sh: cp.random.standard_normal(sh, dtype=cp.float32).astype(BF16)  # noqa: E731
        q, k, v, do = (rnd(b, s, H, D) for _ in range(4))
        bias = rnd(1, H, s, s)
        dims = _checks.check_qkv(q, k, v)
        res = {}
        orig = bwd_sm90.launch
        for tag, kw in (("nobias", {}), ("bias", dict(bias=bias))):
            opts = _checks.make_options(dims, cp, **kw)
            out, lse = cp.empty_like(q), cp.empty((b, H, s), cp.float32)
            gpu_fwd.forward(q, k, v, out, lse, opts)
            g = [cp.empty_like(x) for x in (q, k, v)]
            dbias = cp.empty(bias.shape, BF16) if kw else None
            call = lambda: gpu_bwd.backward(do, q, k, v, out, lse, *g, opts, dbias=dbias)  # noqa: E731
            name = call()
            res[tag] = (_bench.time_ms(call, 1, 5), name)
            if not kw:
                continue
            def run_patched(tag, obj, attr, repl):
                saved = getattr(obj, attr)
                setattr(obj, attr, repl(saved))
                gpu_compile._functions.clear()
                try:
                    res[tag] = (_bench.time_ms(call, 1, 5), call())
                finally:
                    setattr(obj, attr, saved)
                    gpu_compile._functions.clear()

            run_patched("ld16", gpu_tma, "bias_tma_unsupported", lambda f: lambda *a: "probe: off")
            for ptag, define in (("tma_dp_early", "-DBIAS_TMA_DP_EARLY=1"),):
                run_patched(ptag, gpu_compile, "program",
                            lambda f, _d=define: lambda vs: (lambda src, o, n: (src, o + (_d,), n))(*f(vs)))

            def oob_desc(prm, b_arr, box_rows):   # the tensor map covers query row 0 of plane 0 only:
                st = gpu_params.broadcast_strides(b_arr)   # later boxes read no memory (zero fill)
                dims, strides, box = gpu_tma.tma_tensor((1, 1, 1, b_arr.shape[3]), (st[0], st[2], st[1], 1),
                                                      b_arr.itemsize, plan_bwd_sm90.BM)
                prm["tma_bias"] = gpu_tma.encode("bfloat16", b_arr.data.ptr, dims, strides, box)
            run_patched("bias_no_memory", gpu_tma, "bias_tma_desc", lambda f: oob_desc)

            def dbias_passes():   # what the launcher does around the kernel for this dbias
                acc = cp.zeros(bias.size, cp.float32)
                cp.copyto(dbias, acc.reshape(dbias.shape), casting="unsafe")
            res["dbias_passes"] = (_bench.time_ms(dbias_passes, 1, 5), "zeros + copyto")
            for ptag, fix in (("no_dbias_writes", lambda p: p.__setitem__("dbias_accum", 0)),
                              ("store_forced", lambda p: p.__setitem__("dbias_mode", int(p["dbias_mode"]) | 16)),
                              ("no_sched_b", lambda p: p.__setitem__("dbias_mode", int(p["dbias_mode"]) & ~32))):
                def patched(variant, prm, *args, _fix=fix, _orig=orig, **kws):
                    _fix(prm)
                    return _orig(variant, prm, *args, **kws)
                run_patched(ptag, bwd_sm90, "launch", lambda f, _p=patched: _p)
        fl = 2.5 * 4.0 * b * H * s * s * D
        print(f"s={s} b={b}: " + " | ".join(f"{k_} {t:.3f} ms ({fl / t / 1e9:.0f} TFLOP/s) {n}"
                                             for k_, (t, n) in res.items()), flush=True)
        del q, k, v, do, bias
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
