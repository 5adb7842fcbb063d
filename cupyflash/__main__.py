"""python -m cupyflash info | demo | precompile | bench

info  versions, the GPU and its compute capability, the kernel sources and cache directory.
demo  one real-size random problem (GPU when present, else the CPU implementation), checked
      against the float64 reference on a slice; prints time, memory and max error.
precompile  compile every kernel variant for this GPU into CuPy's disk cache (parallel).
bench a sweep over FlashAttention's benchmark shapes beside the peers (plain CuPy; PyTorch SDPA
      with --peers benchmarks.peers): table, JSON and a PNG plot.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import ml_dtypes
import numpy as np

import cupyflash as cf
from cupyflash import _interop, reference


def _kernel_dir() -> str:
    try:
        from cupyflash.gpu import compile

        return str(compile.kernels_dir())
    except Exception as exc:  # CuPy missing, or the module not importable
        return f"unavailable ({type(exc).__name__}: {exc})"


def info() -> int:
    """Print what runs where."""
    print(f"cupyflash   {cf.__version__}  ({os.path.dirname(cf.__file__)})")
    print(f"python      {sys.version.split()[0]}")
    print(f"numpy       {np.__version__}")
    print(f"ml_dtypes   {ml_dtypes.__version__}")
    cp = _interop.cupy_module()
    if cp is None:
        print("cupy        not importable: NumPy inputs run on the CPU implementation")
        return 0
    print(f"cupy        {cp.__version__}")
    try:
        from cupy_backends.cuda.libs import nvrtc

        print("nvrtc       %d.%d" % nvrtc.getVersion())
    except Exception as exc:
        print(f"nvrtc       unavailable ({exc})")
    print(f"kernels     {_kernel_dir()}")
    print(f"cache dir   {os.environ.get('CUPY_CACHE_DIR', os.path.expanduser('~/.cupy/kernel_cache'))}")
    if not _interop.gpu_available():
        print("gpu         none usable: NumPy inputs run on the CPU implementation")
        return 0
    rt = cp.cuda.runtime
    print(f"cuda        runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
    for i in range(rt.getDeviceCount()):
        props = rt.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        cc = f"{props['major']}.{props['minor']}"
        print(f"gpu {i}       {name}, compute capability {cc}, {props['multiProcessorCount']} SMs, "
              f"{props['totalGlobalMem'] / 2**30:.1f} GiB")
        print(f"  forward   {_forward_kernels(props['major'] * 10 + props['minor'])}")
    return 0


def _forward_kernels(cc: int) -> str:
    """Which forward kernel the planner runs on a device of compute capability ``cc``."""
    from cupyflash.gpu import plan_fwd_sm90
    from cupyflash.gpu.tuning import TUNING
    from cupyflash.gpu.variants import SM90_SMEM_MAX

    if cc < 80:
        return "none (the GPU kernels need compute capability 8.0+): the CPU implementation"
    why = plan_fwd_sm90.why_unsupported("bfloat16", 128, 128, scale=1.0, softcap=0.0,
                                        has_alibi=False, cc=cc, smem_optin=SM90_SMEM_MAX)
    if why is not None:
        return "portable kernel (fwd.cu, mma.sync) for every call"
    f32 = ("; float32 (dense, head dim "
           f"{' / '.join(map(str, plan_fwd_sm90.SM90_F32_HEAD_DIMS))}, no softcap): fwd_sm90_f32.cu "
           "(3xTF32 on wgmma)" if TUNING.sm90_float32_auto else
           "; float32: the portable kernel (fwd_sm90_f32.cu only with kernel='sm90')")
    return ("Hopper kernel (fwd_sm90.cu: TMA + wgmma) for float16 / bfloat16, head dim "
            f"{' / '.join(map(str, plan_fwd_sm90.SM90_HEAD_DIMS))} = head_dim_v, no ALiBi / mask (a bias at "
            f"head dim {' / '.join(map(str, plan_fwd_sm90.SM90_BIAS_HEAD_DIMS))} in the layouts docs/hopper.md "
            "lists), TMA-aligned strides (dense and varlen); the portable kernel (fwd.cu) "
            "otherwise" + f32)


def _max_err_on_slice(out, q, k, v, rows: slice) -> float:
    """max |out - reference| over batch 0, heads 0..1, query rows ``rows`` (float64 reference)."""
    ref = reference.attention(q[:1, rows, :2], k[:1, :, :2], v[:1, :, :2])
    return float(np.max(np.abs(np.asarray(out[:1, rows, :2], np.float64) - ref)))


def demo(args) -> int:
    """A random problem at a real size; checked against the reference on a slice."""
    on_gpu = args.device != "cpu" and _interop.gpu_available()
    b, s, h, d = (args.batch, args.seqlen, args.heads, args.head_dim) if args.seqlen else (
        (4, 4096, 16, 128) if on_gpu else (1, 2048, 8, 64))
    dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[
        args.dtype or ("bf16" if on_gpu else "fp32")]
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(3))
    where = "GPU" if on_gpu else "CPU"
    print(f"attention on the {where}: q, k, v ({b}, {s}, {h}, {d}) {np.dtype(dtype).name}")
    if on_gpu:
        cp = _interop.cupy_module()
        qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
        cf.attention(qd, kd, vd)  # warm-up: compile or load the kernel
        cp.cuda.Device().synchronize()
        pool = cp.get_default_memory_pool()
        before = pool.used_bytes()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        out_d = cf.attention(qd, kd, vd)
        stop.record()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop)
        extra = pool.used_bytes() - before
        out = cp.asnumpy(out_d)
    else:
        tracemalloc.start()
        t0 = time.perf_counter()
        out = cf.attention(q, k, v, device="cpu")
        ms = (time.perf_counter() - t0) * 1e3
        extra = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    flops = 4 * b * h * s * s * d
    rows = slice(s - 64, s)
    err = _max_err_on_slice(out, q, k, v, rows)
    scores_bytes = b * h * s * s * 4
    print(f"time        {ms:.2f} ms  ({flops / ms / 1e9:.1f} TFLOP/s)" if on_gpu else
          f"time        {ms:.1f} ms  ({flops / ms / 1e6:.2f} GFLOP/s)")
    print(f"memory      {extra / 2**20:.1f} MiB {'allocated by the call' if on_gpu else 'peak traced'}"
          f" (the float32 score matrix would be {scores_bytes / 2**20:.0f} MiB)")
    print(f"max error   {err:.2e} vs the float64 reference (batch 0, heads 0-1, last 64 rows)")
    tol = {np.dtype(np.float32): 1e-4}.get(np.dtype(dtype), 5e-2)
    ok = bool(np.isfinite(out).all()) and err <= tol
    print("check       " + ("ok" if ok else f"FAILED (tolerance {tol})"))
    return 0 if ok else 1


def precompile(args) -> int:
    """Fill CuPy's disk cache with every forward and backward variant the planner can pick here."""
    if not _interop.gpu_available():
        print("precompile needs a CUDA GPU with CuPy", file=sys.stderr)
        return 2
    from cupyflash.gpu import (compile, plan_bwd, plan_bwd_sm90, plan_bwd_sm90_f32, plan_fwd,
                               plan_fwd_sm90)
    from cupyflash.gpu.tuning import TUNING

    cp = _interop.cupy_module()
    smem = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    t0 = time.perf_counter()
    elems = set(args.elems.split(",")) if args.elems else None
    dims = {int(x) for x in args.head_dims.split(",")} if args.head_dims else None

    def wanted(v):   # --elems / --head-dims / --general narrow the set
        return ((elems is None or v.elem in elems) and (dims is None or v.d in dims)
                and (not args.general or getattr(v, "general", False)))

    fwd = [v for v in plan_fwd.variants(smem) if wanted(v)]
    hopper = int(cp.cuda.Device().compute_capability) == 90 and not args.general
    if hopper:
        fwd += [v for v in plan_fwd_sm90.variants() if wanted(v)]
        if TUNING.sm90_float32_auto:
            fwd += [v for v in plan_fwd_sm90.f32_variants() if wanted(v)]
    fwd = compile.precompile(fwd, args.workers)
    bwd = compile.precompile([v for v in plan_bwd.variants(smem) if wanted(v)], args.workers)
    if hopper:
        bwd += compile.precompile([v for v in plan_bwd_sm90.variants() if wanted(v)], args.workers)
        bwd += compile.precompile([v for v in plan_bwd_sm90_f32.variants() if wanted(v)],
                                  args.workers)
    print(f"compiled {len(fwd)} forward and {len(bwd)} backward variants in "
          f"{time.perf_counter() - t0:.1f} s ({args.workers} processes)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, kernels and cache directory")
    p = sub.add_parser("demo", help="a real-size problem checked against the reference")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=0, help="0: a default size for the device")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p = sub.add_parser("precompile", help="compile every kernel variant for this GPU (disk cache)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--elems", default="", help="only these element tags, e.g. bf16_t,f16_t,f32x3_t")
    p.add_argument("--head-dims", default="", help="only these head-dim buckets, e.g. 64,128")
    p.add_argument("--general", action="store_true", help="only the GENERAL (bias/mask/varlen) variants")
    from cupyflash import _bench

    _bench.add_arguments(sub.add_parser("bench", help="TFLOP/s beside the peers: table, JSON, PNG"))
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "bench":
        return _bench.main(args)
    if args.command == "precompile":
        return precompile(args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
