# Question: How fast is the forward beside SDPA and plain CuPy, with float32, memory, overhead and cold compile in one script? (python -m cupyflash bench is the benchmark of record)
"""Forward speed table: cupyflash GPU kernel vs PyTorch SDPA (flash, cuDNN) and plain CuPy.

Plain script: ``PYTHONPATH=. python lab/bench_forward.py [--quick] [--json PATH]``.
bf16, FlashAttention's benchmark shapes: batch * seqlen = 16k tokens, hidden 2048 (heads =
2048 / hd), hd 64 / 128, seqlen 512 .. 16k, causal or not; FLOPs = 4 b h s_q s_k d (halved for
causal). Timing: CUDA events around each call, warm-up first, median of the repeats.
Then: float32 (3xTF32 and TF32) vs SDPA's memory-efficient backend on float32, extra device
memory of one call, host overhead per call, cold compile time and the disk-cache reload.
PyTorch is imported here only (a benchmark peer), never by cupyflash.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import cupy as cp
import ml_dtypes
import numpy as np

from cupyflash import _bench
from cupyflash.gpu import fwd as gpu_fwd, plan_fwd
from cupyflash._options import Options

BF16 = np.dtype(ml_dtypes.bfloat16)


def time_cupy(fn, warmup=3, rep=15):
    """Median seconds of ``fn()`` between CUDA events (cupyflash._bench.time_ms). PyTorch peers
    are timed the same way: they run on the legacy default stream, CuPy's current stream here."""
    return _bench.time_ms(fn, warmup, rep) * 1e-3


def make_inputs(b, s, h, d, dtype, rng):
    return [cp.asarray(rng.standard_normal((b, s, h, d), dtype=np.float32)).astype(dtype)
            for _ in range(3)]


def ours_fn(q, k, v, causal, allow_tf32=False, kernel="auto"):
    b, s, h, d = q.shape
    out = cp.empty_like(q)
    lse = cp.empty((b, h, s), cp.float32)
    opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1,
                   allow_tf32=allow_tf32)
    return lambda: gpu_fwd.forward(q, k, v, out, lse, opts, kernel=kernel), out, lse


def get_torch():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        if not torch.cuda.is_available():
            return None
        return torch, SDPBackend, sdpa_kernel, F
    except Exception as e:  # noqa: BLE001
        print(f"# PyTorch unavailable: {e}")
        return None


def torch_fn(tt, backend, q, k, v, causal):
    torch, SDPBackend, sdpa_kernel, F = tt
    # (b, s, h, d) CuPy -> torch (b, h, s, d) zero-copy view
    tq, tk, tv = (torch.as_tensor(x.view(cp.uint16) if x.dtype == BF16 else x, device="cuda")
                  for x in (q, k, v))
    if q.dtype == BF16:
        tq, tk, tv = (x.view(torch.bfloat16) for x in (tq, tk, tv))
    tq, tk, tv = (x.transpose(1, 2) for x in (tq, tk, tv))
    be = getattr(SDPBackend, backend)

    def run():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    run()   # raises if the backend refuses the problem
    return run


def bench_bf16(tt, quick, rows):
    rng = np.random.default_rng(0)
    seqlens = [512, 2048, 8192] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    hdr = (f"{'hd':>3} {'seqlen':>6} {'causal':>6} | {'ours':>6} {'flash':>6} {'cudnn':>6} "
           f"{'cupy*':>6} | {'ours/flash':>10} {'ours/cudnn':>10}  variant")
    print("\nbf16 forward, TFLOP/s (batch*seqlen = 16k, hidden 2048; cupy* = plain CuPy "
          "matmul-softmax-matmul on float16 copies, CuPy has no bf16 batched matmul)")
    print(hdr)
    print("-" * len(hdr))
    for hd in (64, 128):
        for s in seqlens:
            b, h = 16384 // s, 2048 // hd
            q, k, v = make_inputs(b, s, h, hd, BF16, rng)
            for causal in (False, True):
                fl = plan_fwd.flops(b, h, s, s, hd, hd, causal)
                fn, out, lse = ours_fn(q, k, v, causal)
                name = fn()
                res = {"ours": fl / time_cupy(fn) / 1e12}
                for key, be in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
                    try:
                        res[key] = fl / time_cupy(torch_fn(tt, be, q, k, v, causal)) / 1e12 \
                            if tt else float("nan")
                    except Exception as e:  # noqa: BLE001
                        print(f"# {key} failed: {str(e)[:100]}")
                        res[key] = float("nan")
                nf = _bench.cupy_peer(q, k, v, causal, "fwd")
                res["cupy"] = fl / time_cupy(nf, 1, 3) / 1e12 if nf else float("nan")
                cp.get_default_memory_pool().free_all_blocks()
                r1 = res["ours"] / res["flash"]
                r2 = res["ours"] / res["cudnn"]
                print(f"{hd:>3} {s:>6} {str(causal):>6} | {res['ours']:6.1f} {res['flash']:6.1f} "
                      f"{res['cudnn']:6.1f} {res['cupy']:6.1f} | {r1:10.2f} {r2:10.2f}  {name}")
                rows.append(dict(kind="bf16", hd=hd, seqlen=s, causal=causal, variant=name, **res))
            del q, k, v
            cp.get_default_memory_pool().free_all_blocks()


def bench_f32(tt, rows):
    rng = np.random.default_rng(1)
    print("\nfloat32 forward, TFLOP/s: ours (3xTF32, float32 accuracy), ours (TF32), SDPA mem-efficient")
    hdr = (f"{'hd':>3} {'seqlen':>6} {'causal':>6} | {'3xTF32':>6} {'TF32':>6} {'memeff':>6} | "
           f"{'3x/memeff':>9}")
    print(hdr)
    print("-" * len(hdr))
    for hd in (64, 128):
        for s in (1024, 4096):
            b, h = 16384 // s, 2048 // hd
            q, k, v = make_inputs(b, s, h, hd, np.float32, rng)
            for causal in (False, True):
                fl = plan_fwd.flops(b, h, s, s, hd, hd, causal)
                f3, _, _ = ours_fn(q, k, v, causal)
                f1, _, _ = ours_fn(q, k, v, causal, allow_tf32=True)
                t3 = fl / time_cupy(f3) / 1e12
                t1 = fl / time_cupy(f1) / 1e12
                try:
                    tm = fl / time_cupy(torch_fn(tt, "EFFICIENT_ATTENTION", q, k, v,
                                                         causal)) / 1e12 if tt else float("nan")
                except Exception as e:  # noqa: BLE001
                    print(f"# memeff failed: {str(e)[:100]}")
                    tm = float("nan")
                print(f"{hd:>3} {s:>6} {str(causal):>6} | {t3:6.1f} {t1:6.1f} {tm:6.1f} | "
                      f"{t3 / tm:9.2f}")
                rows.append(dict(kind="f32", hd=hd, seqlen=s, causal=causal, x3=t3, tf32=t1,
                                 memeff=tm))
            del q, k, v
            cp.get_default_memory_pool().free_all_blocks()


def bench_memory_and_overhead(rows):
    rng = np.random.default_rng(2)
    pool = cp.get_default_memory_pool()
    q, k, v = make_inputs(4, 2048, 16, 128, BF16, rng)
    fn, out, lse = ours_fn(q, k, v, True)
    fn()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    fn()
    cp.cuda.Device().synchronize()
    extra = pool.used_bytes() - before
    print(f"\nextra device memory of one call (out, lse preallocated): {extra} bytes "
          f"(out + lse = {out.nbytes + lse.nbytes} bytes, allocated by the caller)")
    # host overhead: tiny problem, many calls, one sync (the measurement of benchmarks/overhead.py)
    from benchmarks.overhead import per_call_us
    q, k, v = make_inputs(1, 128, 1, 64, BF16, rng)
    fn, out, lse = ours_fn(q, k, v, False)
    per, wall = per_call_us(fn)
    print(f"host overhead per call (warm caches, median of runs of many calls, one sync): "
          f"{per:.1f} us (wall incl. GPU {wall:.1f} us); more in benchmarks/overhead.py")
    rows.append(dict(kind="overhead", extra_bytes=extra, host_us=per))


COLD = r"""
import time, math, cupy as cp, numpy as np
t0 = time.perf_counter()
from cupyflash.gpu import fwd as gpu_fwd
from cupyflash._options import Options
q = cp.asarray(np.random.default_rng(0).standard_normal((1, 256, 2, 80), dtype=np.float32)).astype(cp.float16)
out = cp.empty_like(q); lse = cp.empty((1, 2, 256), cp.float32)
cp.cuda.Device().synchronize()
t1 = time.perf_counter()
name = gpu_fwd.forward(q, q, q, out, lse, Options(scale=0.1, softcap=20.0, window_right=0))
cp.cuda.Device().synchronize()
t2 = time.perf_counter()
print(f"{name} {t2 - t1:.3f}")
"""


def bench_compile(rows):
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, CUPY_CACHE_DIR=tmp)
        res = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", COLD], env=env, capture_output=True,
                               text=True, timeout=120)
            res.append(r.stdout.strip() or r.stderr.strip()[-300:])
        print(f"\ncold compile + first call of one variant (fresh cache dir): {res[0]} s")
        print(f"second process, same cache dir (disk cache load): {res[1]} s")
        rows.append(dict(kind="compile", cold=res[0], warm=res[1]))


TUNE = [  # (elem, hd, BM, BN, warps, K stages, QK unroll or None for the kernel's default)
    ("bf16_t", 64, 128, 128, 4, 2, None), ("bf16_t", 64, 128, 64, 4, 2, None),
    ("bf16_t", 128, 128, 64, 4, 2, None), ("bf16_t", 128, 128, 32, 4, 2, None),
    ("bf16_t", 128, 128, 64, 4, 2, 4),
    ("f32x3_t", 64, 64, 64, 4, 1, None), ("f32x3_t", 64, 128, 64, 4, 1, None),
    ("f32x3_t", 128, 64, 32, 4, 1, None), ("f32x3_t", 128, 64, 64, 4, 1, None),
]


def bench_tune(rows):
    """Alternative tiles (BM, BN, warps) and k-loop unroll for the main cells."""
    rng = np.random.default_rng(3)
    print("\ntile tuning, s=4096 b=4 hidden 2048, TFLOP/s (non-causal / causal)")
    inputs = {}
    for elem, hd, bm, bn, nw, st, unroll in TUNE:
        dt = BF16 if elem == "bf16_t" else np.float32
        if (dt, hd) not in inputs:
            inputs.clear()
            cp.get_default_memory_pool().free_all_blocks()
            inputs[(dt, hd)] = make_inputs(4, 4096, 2048 // hd, hd, dt, rng)
        q, k, v = inputs[(dt, hd)]
        b, s, h = 4, 4096, 2048 // hd
        res = []
        for causal in (False, True):
            var = plan_fwd.Variant(elem, hd, bm, bn, nw, causal, False, st)
            extra = () if unroll is None else (f"-DQK_UNROLL={unroll}",)
            fn, _, _ = ours_fn(q, k, v, causal, kernel=(var, extra))
            try:
                fn()
                res.append(plan_fwd.flops(b, h, s, s, hd, hd, causal) / time_cupy(fn) / 1e12)
            except Exception as e:  # noqa: BLE001
                print(f"# {var.name}: {str(e)[:120]}")
                res.append(float("nan"))
        print(f"  {elem} hd{hd} {bm}x{bn} w{nw} stages {st} unroll {unroll}: "
              f"{res[0]:6.1f} / {res[1]:6.1f}")
        rows.append(dict(kind="tune", elem=elem, hd=hd, bm=bm, bn=bn, nw=nw, stages=st, unroll=unroll,
                         tflops=res))
    inputs.clear()
    cp.get_default_memory_pool().free_all_blocks()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--skip", default="", help="comma list of: bf16,f32,mem,compile,tune")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    dev = cp.cuda.Device()
    print(f"# device {dev.id}: {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, "
          f"CuPy {cp.__version__}")
    tt = get_torch()
    if tt:
        print(f"# torch {tt[0].__version__}")
    rows = []
    if "compile" not in skip:
        bench_compile(rows)
    if "mem" not in skip:
        bench_memory_and_overhead(rows)
    if "f32" not in skip:
        bench_f32(tt, rows)
    if "tune" not in skip:
        bench_tune(rows)
    if "bf16" not in skip:
        bench_bf16(tt, args.quick, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
