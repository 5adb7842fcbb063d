"""python -m cupyflash info | demo | precompile | bench

info  versions, the GPU and its compute capability, the kernel sources and cache directory.
demo  one real-size random problem (GPU when present, else the CPU implementation), checked
      against the float64 reference on a slice; prints time, memory and max error.
precompile  compile every kernel variant for this GPU into CuPy's disk cache (parallel).
bench on a GPU: a sweep over FlashAttention's benchmark shapes beside the peers (plain CuPy;
      PyTorch SDPA with --peers benchmarks.peers): table, JSON and a PNG plot. Without one (or
      with --device cpu): the CPU implementation beside textbook NumPy, time and peak memory.
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
from cupyflash import _checks, _interop, reference


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
    from cupyflash import cpu

    print(f"cpu         {cpu.num_threads()} threads for the CPU implementation "
          "(CUPYFLASH_CPU_THREADS to change), BLAS one thread each")
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
        return "portable kernel (portable/fwd.cu, mma.sync) for every call"
    f32 = ("; float32 (dense, head dim "
           f"{' / '.join(map(str, plan_fwd_sm90.SM90_F32_HEAD_DIMS))}, no softcap): hopper/fwd_f32.cu "
           "(3xTF32 on wgmma)" if TUNING.sm90_float32_auto else
           "; float32: the portable kernel (hopper/fwd_f32.cu only with kernel='sm90')")
    return ("Hopper kernel (hopper/fwd.cu: TMA + wgmma) for float16 / bfloat16, head dim "
            f"{' / '.join(map(str, plan_fwd_sm90.SM90_HEAD_DIMS))} = head_dim_v, no ALiBi / mask (a bias at "
            f"head dim {' / '.join(map(str, plan_fwd_sm90.SM90_BIAS_HEAD_DIMS))} in the layouts docs/hopper.md "
            "lists), TMA-aligned strides (dense and varlen); the portable kernel (portable/fwd.cu) "
            "otherwise" + f32)


def _max_err_on_slice(out, q, k, v, rows: slice) -> float:
    """max |out - reference| over batch 0, heads 0..1, query rows ``rows`` (float64 reference)."""
    ref = reference.attention(q[:1, rows, :2], k[:1, :, :2], v[:1, :, :2])
    return float(np.max(np.abs(np.asarray(out[:1, rows, :2], np.float64) - ref)))


#: demo's default problem per device (batch, seqlen, heads, head_dim)
DEMO_SIZES = {"gpu": (4, 4096, 16, 128), "cpu": (1, 2048, 8, 64)}


def _no_gpu(command: str) -> int:
    print(f"python -m cupyflash {command}: error: --device gpu but no usable CUDA GPU (CuPy "
          "missing or no device); use --device cpu or auto", file=sys.stderr)
    return 2


def demo(args) -> int:
    """A random problem at a real size; checked against the reference on a slice."""
    if args.device == "gpu" and not _interop.gpu_available():
        return _no_gpu("demo")
    on_gpu = args.device != "cpu" and _interop.gpu_available()
    given = (args.batch, args.seqlen, args.heads, args.head_dim)
    b, s, h, d = (x if x is not None else default
                  for x, default in zip(given, DEMO_SIZES["gpu" if on_gpu else "cpu"]))
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
    rows = slice(max(0, s - 64), s)
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
    """Fill CuPy's disk cache with every forward, backward and decode (attention_with_kvcache)
    variant the planner can pick here."""
    if not _interop.gpu_available():
        print("precompile needs a CUDA GPU with CuPy", file=sys.stderr)
        return 2
    from cupyflash.gpu import (compile, plan_bwd, plan_bwd_sm90, plan_bwd_sm90_f32, plan_decode,
                               plan_fwd, plan_fwd_sm90)
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
    dec = [] if args.general else compile.precompile(
        [v for v in plan_decode.variants(smem) if wanted(v)], args.workers,
        plan_decode.build_options())
    print(f"compiled {len(fwd)} forward, {len(bwd)} backward and {len(dec)} decode variants in "
          f"{time.perf_counter() - t0:.1f} s ({args.workers} processes)")
    return 0


def _int_in(low: int, high=None, what="an int"):
    """argparse type: an int in [low, high] (high None: unbounded), else a clear usage error."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < low or (high is not None and n > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be {bound}")
        return n
    parse.__name__ = "int"
    return parse


def _int_list(low: int, high=None):
    """argparse type: comma-separated ints, each in [low, high]."""
    one = _int_in(low, high)

    def parse(text: str) -> str:
        if text:
            for part in text.split(","):
                one(part.strip())
        return text
    parse.__name__ = "list of ints"
    return parse


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


_bool.__name__ = "bool"

#: help and validation of the ``bench`` options that _bench.add_arguments defines (dest -> ...)
_BENCH_HELP = {
    "dtype": "element types to time (GPU default: bf16; CPU default: fp32)",
    "head_dim": "head dims to time (GPU default: 64 128; CPU default: 64)",
    "seqlen": "sequence lengths to time (GPU default: 512 ... 16384, batch·seqlen = 16384; "
              "CPU default: 1024 4096)",
    "causal": "causal settings to time, e.g. --causal false true (GPU default: both; CPU: false)",
    "direction": "fwd and/or bwd (GPU default: both; CPU default: fwd)",
    "rep": "timed repeats per case, median reported (GPU default: 20; CPU default: 3)",
    "json": "where to write the results as JSON (default: %(default)s)",
    "png": "where to write the plot, GPU only (default: %(default)s; needs matplotlib)",
}
_BENCH_TYPES = {"head_dim": _int_in(1, _checks.MAX_HEAD_DIM, "head dim"),
                "seqlen": _int_in(1, None, "seqlen"), "rep": _int_in(1, None, "rep"),
                "causal": _bool, "smem_limit": _int_in(1, None, "smem limit")}
#: options whose default depends on where bench runs: set after parsing (GPU: _bench's own)
_BENCH_PER_DEVICE = ("dtype", "head_dim", "seqlen", "causal", "direction", "rep")


def _bench_parser(p) -> dict:
    """The bench options: _bench's own, each given help and validation, plus --device, --batch
    --heads and --kv-heads; returns _bench's defaults of the options whose CPU default differs."""
    from cupyflash import _bench

    _bench.add_arguments(p)
    gpu_defaults = {}
    for action in p._actions:
        if action.dest in _BENCH_TYPES:
            action.type = _BENCH_TYPES[action.dest]
        if action.dest in _BENCH_HELP:
            action.help = _BENCH_HELP[action.dest]
        if action.dest in _BENCH_PER_DEVICE:
            gpu_defaults[action.dest] = action.default
            action.default = None
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto (default): the GPU when CuPy sees one, else the CPU implementation "
                        "beside textbook NumPy; cpu; gpu (an error without one)")
    p.add_argument("--batch", type=_int_in(1, None, "batch"), default=None,
                   help="CPU only: batch size (default: 1; the GPU sweep uses 16384 / seqlen)")
    p.add_argument("--heads", type=_int_in(1, None, "heads"), default=None,
                   help="query heads (GPU default: 2048 / head_dim; CPU default: 8)")
    p.add_argument("--kv-heads", type=_int_in(1, None, "kv heads"), default=None,
                   help="key / value heads, dividing the query heads: GQA / MQA (default: as "
                        "many as the query heads)")
    return gpu_defaults


def bench(args, gpu_defaults: dict) -> int:
    """GPU sweep (_bench) or, without a GPU or with --device cpu, the CPU bench (_cpubench)."""
    if args.device == "gpu" and not _interop.gpu_available():
        return _no_gpu("bench")
    on_gpu = args.device != "cpu" and _interop.gpu_available()
    from cupyflash import _cpubench

    defaults = gpu_defaults if on_gpu else _cpubench.DEFAULTS
    for name in _BENCH_PER_DEVICE + ("batch", "heads"):
        if getattr(args, name, None) is None and name in defaults:
            setattr(args, name, defaults[name])
    if args.kv_heads:   # GQA / MQA: the key / value heads divide the query heads of every case
        from cupyflash._bench import heads_for
        try:
            for hd in args.head_dim:
                heads_for(hd, args.heads, args.kv_heads)
        except ValueError as e:
            print(f"python -m cupyflash bench: error: {e}", file=sys.stderr)
            return 2
    if on_gpu:
        from cupyflash import _bench

        return _bench.main(args)
    if getattr(args, "smem_limit", None):
        print("python -m cupyflash bench: error: --smem-limit plans GPU kernels; the CPU bench "
              "has none (run it with a GPU, or leave the option out)", file=sys.stderr)
        return 2
    return _cpubench.main(args)


def build_parser():
    """The ``python -m cupyflash`` parser; returns (parser, _bench's GPU defaults)."""
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"cupyflash {cf.__version__} (numpy {np.__version__})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="versions, GPU, kernels and cache directory")
    p = sub.add_parser("demo", help="a real-size problem checked against the reference")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto (default): the GPU when CuPy sees one, else the CPU; cpu; "
                        "gpu (an error without one)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="element type (default: bf16 on the GPU, fp32 on the CPU)")
    size = "default: %d on the GPU, %d on the CPU"
    p.add_argument("--batch", type=_int_in(1, None, "batch"),
                   help="batch size (" + size % (DEMO_SIZES["gpu"][0], DEMO_SIZES["cpu"][0]) + ")")
    p.add_argument("--seqlen", type=_int_in(1, None, "seqlen"),
                   help="sequence length ("
                        + size % (DEMO_SIZES["gpu"][1], DEMO_SIZES["cpu"][1]) + ")")
    p.add_argument("--heads", type=_int_in(1, None, "heads"),
                   help="heads ("
                        + size % (DEMO_SIZES["gpu"][2], DEMO_SIZES["cpu"][2]) + ")")
    p.add_argument("--head-dim", type=_int_in(1, _checks.MAX_HEAD_DIM, "head dim"),
                   help="head dim, 1..%d (" % _checks.MAX_HEAD_DIM
                        + size % (DEMO_SIZES["gpu"][3], DEMO_SIZES["cpu"][3]) + ")")
    p = sub.add_parser("precompile", help="compile every kernel variant for this GPU (disk cache)")
    p.add_argument("--workers", type=_int_in(1, None, "workers"), default=os.cpu_count() or 1,
                   help="compiler processes in parallel (default: the cores, %(default)s)")
    p.add_argument("--elems", default="", help="only these element tags, e.g. bf16_t,f16_t,f32x3_t")
    p.add_argument("--head-dims", default="", type=_int_list(1, _checks.MAX_HEAD_DIM),
                   help="only these head-dim buckets, e.g. 64,128")
    p.add_argument("--general", action="store_true", help="only the GENERAL (bias/mask/varlen) variants")
    gpu_defaults = _bench_parser(sub.add_parser(
        "bench", help="GPU: TFLOP/s beside the peers (table, JSON, PNG); "
                      "CPU: time and memory beside textbook NumPy"))
    return parser, gpu_defaults


def main(argv=None) -> int:
    parser, gpu_defaults = build_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "bench":
        return bench(args, gpu_defaults)
    if args.command == "precompile":
        return precompile(args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
