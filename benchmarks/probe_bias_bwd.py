"""Where the Hopper bias backward's time goes (issue 6 probe, not a benchmark of record).

bf16, hd 128, 16 heads, 16k tokens, bias (1, h, s, s): the backward without a bias (baseline),
with bias + dbias as planned, and the same launch with one thing changed in its Params (results
then wrong; timing only): dbias_accum = 0 (no dbias writes: bias reads only), DBIAS_STORE forced
(plain stores instead of red.add), DBIAS_SCHED_B cleared, bias strides over rows and heads 0
(every load hits one bias row: bias traffic out of the picture). CUDA events, median of 5.

    python benchmarks/probe_bias_bwd.py [--seqlens 1024,4096]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench, _checks, _gpu, _gpu_bwd, _gpu_bwd_sm90 as h90  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="1024,4096")
    a = ap.parse_args()
    H, D = 16, 128
    orig = h90.launch
    for s in (int(x) for x in a.seqlens.split(",")):
        b = 16384 // s
        rnd = lambda *sh: cp.random.standard_normal(sh, dtype=cp.float32).astype(BF16)  # noqa: E731
        q, k, v, do = (rnd(b, s, H, D) for _ in range(4))
        bias = rnd(1, H, s, s)
        dims = _checks.check_qkv(q, k, v)
        res = {}
        for tag, kw in (("nobias", {}), ("bias", dict(bias=bias))):
            opts = _checks.make_options(dims, cp, **kw)
            out, lse = cp.empty_like(q), cp.empty((b, H, s), cp.float32)
            _gpu.forward(q, k, v, out, lse, opts)
            g = [cp.empty_like(x) for x in (q, k, v)]
            dbias = cp.empty(bias.shape, BF16) if kw else None
            call = lambda: _gpu_bwd.backward(do, q, k, v, out, lse, *g, opts, dbias=dbias)  # noqa: E731
            name = call()
            res[tag] = (_bench.time_ms(call, 1, 5), name)
            if not kw:
                continue
            for ptag, fix in (("no_dbias_writes", lambda p: p.__setitem__("dbias_accum", 0)),
                              ("store_forced", lambda p: p.__setitem__("dbias_mode", int(p["dbias_mode"]) | 16)),
                              ("no_sched_b", lambda p: p.__setitem__("dbias_mode", int(p["dbias_mode"]) & ~32)),
                              ("bias_one_row", lambda p: (p.__setitem__("bias_stride_q", 0),
                                                          p.__setitem__("bias_stride_h", 0)))):
                def patched(variant, prm, *args, _fix=fix, **kws):
                    _fix(prm)
                    return orig(variant, prm, *args, **kws)
                h90.launch = patched
                try:
                    res[ptag] = (_bench.time_ms(call, 1, 5), call())
                finally:
                    h90.launch = orig
        fl = 2.5 * 4.0 * b * H * s * s * D
        print(f"s={s} b={b}: " + " | ".join(f"{k_} {t:.3f} ms ({fl / t / 1e9:.0f} TFLOP/s) {n}"
                                             for k_, (t, n) in res.items()), flush=True)
        del q, k, v, do, bias
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
