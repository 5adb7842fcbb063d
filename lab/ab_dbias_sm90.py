# Question: Is the Hopper dbias kernel faster than the portable one on (1, h, s, s) bf16 bias shapes at hd 128?
"""A/B of the two dbias kernels: flash_bwd_dbias (portable/bwd.cu, portable) against flash_bwd_dbias_sm90
(hopper/dbias.cu, Hopper), on issue 6's benchmark shapes: bias (1, h, s, s) bf16, hd 128, 16 heads,
16k tokens (batch = 16k / s). One device call:

    python lab/ab_dbias_sm90.py [--seqlens 1024 8192] [--rounds 5] [--rep 10]

Per sequence length:
- the dbias kernel alone, each kernel timed with the Params record the backward builds (captured
  from one backward call; D recomputed here, as the record's buffer is freed), interleaved round
  by round (lab/ab_timing.py), TFLOP/s counted as the kernel's two products,
  4·b·h·s²·d; target for issue 6: >= ~300 TFLOP/s (0.45 ms at 1k, 3.7 ms at 8k);
- the whole backward with dbias three ways: the float32 accumulator (the default path,
  DBIAS_KERNEL off), the portable dbias kernel, the Hopper dbias kernel (DBIAS_KERNEL on,
  DBIAS_SM90 off / on), TFLOP/s by FlashAttention's backward count;
- how far apart the two kernels' dbias are (max |Hopper − portable| / max |portable|; a bf16
  unit in the last place is 2^-8 relative).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench, _checks  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd
from cupyflash.gpu import compile as gpu_compile
from cupyflash.gpu import dbias_sm90
from cupyflash.gpu import fwd as gpu_fwd
from cupyflash.gpu import plan_bwd
from cupyflash.gpu import plan_dbias_sm90
from cupyflash.gpu.tuning import TUNING

from ab_timing import interleaved_tflops  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
TOKENS, H, D = 16384, 16, 128


def columns(tf, flops) -> str:
    """'tf_0 .. tf_n TFLOP/s (ms_0 .. ms_n ms) | tf_1/tf_0 .. tf_n/tf_0'."""
    return (" ".join(f"{x:7.1f}" for x in tf) + " TFLOP/s ("
            + " ".join(f"{flops / x / 1e9:.3f}" for x in tf) + " ms) | "
            + " ".join(f"{x / tf[0]:.3f}" for x in tf[1:]))


def capture_dbias_record(call):
    """Params (0-d array) of the dbias kernels as the backward ``call()`` hands them over."""
    got = {}
    orig = gpu_bwd._fill_and_launch

    def spy(*a, **kw):
        after = kw.get("after")
        if after is not None:
            def keep(prm):
                got["prm"] = prm.copy()
                after(prm)
            kw["after"] = keep
        return orig(*a, **kw)

    gpu_bwd._fill_and_launch = spy
    try:
        call()
    finally:
        gpu_bwd._fill_and_launch = orig
    return got["prm"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=10)
    args = ap.parse_args(argv)
    print(_bench.device_line())
    rng = np.random.default_rng(0)
    for s in args.seqlens:
        run_one(s, args.rounds, args.rep, rng)
        cp.get_default_memory_pool().free_all_blocks()


def run_one(s, rounds, rep, rng):
    """The three timings of one sequence length (module docstring)."""
    dev_id, smem, num_sms = gpu_bwd._device()
    b = TOKENS // s
    q, k, v, dout = (cp.asarray(rng.standard_normal((b, s, H, D), dtype=np.float32).astype(BF16))
                     for _ in range(4))
    bias = cp.asarray(rng.standard_normal((1, H, s, s), dtype=np.float32).astype(BF16))
    opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, bias=bias)
    out, lse = cp.empty_like(q), cp.empty((b, H, s), cp.float32)
    gpu_fwd.forward(q, k, v, out, lse, opts)
    grads = [cp.empty_like(x) for x in (q, k, v)]
    dbias = cp.empty(bias.shape, BF16)

    def backward():
        return gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, dbias=dbias)

    def with_switches(kernel, sm90):
        def call():
            saved = TUNING.dbias_kernel, TUNING.dbias_sm90
            TUNING.dbias_kernel, TUNING.dbias_sm90 = kernel, sm90
            try:
                return backward()
            finally:
                TUNING.dbias_kernel, TUNING.dbias_sm90 = saved
        return call

    # the two kernels' dbias, and the record they read
    with_switches(True, False)()
    ref = dbias.astype(np.float32)
    prm = capture_dbias_record(with_switches(True, True))
    diff = float(cp.abs(dbias.astype(np.float32) - ref).max() / cp.abs(ref).max())
    dsum = (dout.astype(np.float32) * out.astype(np.float32)).sum(-1).transpose(0, 2, 1).copy()
    prm["dsum"] = dsum.data.ptr    # [b, h, s] D = rowsum(dO ∘ O)

    # the dbias kernel alone
    rec = prm.reshape(1)[0]
    pv = plan_bwd.dbias_variant("bf16_t", D, smem)
    pfn = gpu_compile.get_functions(pv, dev_id)[0]
    pgrid = (-(-s // pv.bn), -(-s // pv.bm), H)
    hv = plan_dbias_sm90.variant_for("bf16_t", D, False, False)
    calls = [lambda: pfn(pgrid, (pv.threads, 1, 1), (rec,), shared_mem=pv.smem_bytes),
             lambda: dbias_sm90.launch(hv, prm, q, k, v, dout, bias, dev_id, num_sms)]
    fl_k = 4.0 * b * H * s * s * D
    tf, _ = interleaved_tflops(calls, None, fl_k, rounds, rep, _bench.time_ms)
    print(f"s {s:5d} b {b:2d}  dbias kernel alone: {pv.name} | {hv.name} | ratio")
    print(f"    {columns(tf, fl_k)}")

    # the whole backward with dbias
    fl_b = _bench.flops(b, H, s, s, D, False, "bwd")
    calls = [with_switches(False, False), with_switches(True, False), with_switches(True, True)]
    tf, _ = interleaved_tflops(calls, None, fl_b, rounds, rep, _bench.time_ms)
    print("    backward with dbias: float32 accumulator | portable dbias kernel | "
          "Hopper dbias kernel | ratios to the first")
    print(f"    {columns(tf, fl_b)}")
    print(f"    dbias Hopper vs portable kernel: max |diff| / max |dbias| = {diff:.3g}"
          f"  (main kernel {with_switches(True, True)()})")


if __name__ == "__main__":
    main()
