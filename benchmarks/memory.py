"""Device memory of one call, counted allocation by allocation through CuPy's memory pool.

``PYTHONPATH=. python benchmarks/memory.py [--seqlen 16384] [--skip-cupy]``

``cupyflash._bench.measure_memory`` (a CuPy memory hook) sees every request the call makes of the
default pool, including blocks the pool hands back from its cache, which the pool's byte counters
do not show (``benchmarks/memory_16k.py`` measured the pool's growth and printed 0 MiB for a call
that writes a 64 MiB out). "peak" is the most bytes the call held at once beyond its inputs,
"kept" what it returned, "requests" every buffer it asked for. Each row prints what the issue
allows beside it:

* forward: out + lse (issue 3);
* backward: dq, dk, dv + D + the float32 dQ accumulator where the kernel uses one (issue 4);
* backward with a bias: the same + dbias; with the main kernel's float32 accumulator of dbias's
  shape (``TUNING.dbias_kernel = False``; the default where no Hopper dbias kernel covers the
  call) + that accumulator where dbias is 16-bit; with a dbias kernel (``DBIAS_KERNEL = True``; the
  default on compute capability 9.0 where flash_bwd_dbias_sm90 covers the call, in deterministic
  mode and when the accumulator does not fit) dbias only (issue 6).

The plain CuPy recipe (scores materialized) is the comparison for the forward.
"""
import argparse

import cupy as cp
import ml_dtypes
import numpy as np

import cupyflash as cf
from cupyflash import _bench
from cupyflash.gpu.tuning import TUNING

MiB = 2**20


def rand(rng, shape, dtype):
    return cp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def row(name, peak, kept, sizes, allowed, parts):
    """Print one call's figures; allowed=None: report only (deterministic mode's slabs)."""
    ok = "report" if allowed is None else "ok" if peak <= allowed + MiB else "OVER"
    limit = "" if allowed is None else f"{allowed / MiB:9.1f} "
    print(f"{name:44s} peak {peak / MiB:9.1f} MiB  kept {kept / MiB:9.1f}  allowed "
          f"{limit}({parts})  {ok}")
    print(f"{'':44s} requests (MiB): " + ", ".join(f"{s / MiB:.2f}" for s in sizes))
    return ok != "OVER"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--bias-seqlen", type=int, default=8192)
    ap.add_argument("--f32-bwd-seqlen", type=int, default=4096)
    ap.add_argument("--skip-cupy", action="store_true", help="skip the plain CuPy peer (57 GiB at 16k)")
    args = ap.parse_args()
    rng = np.random.default_rng()
    bf16 = ml_dtypes.bfloat16
    s, h = args.seqlen, 16
    good = True
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy {cp.__version__}")

    # Forward, bf16 and float32, hd 128 and 64, batch 1: out + lse, nothing N x N.
    for dtype, d, causal in ((bf16, 128, False), (bf16, 128, True), (bf16, 64, False),
                             (np.float32, 128, False), (np.float32, 64, True)):
        q, k, v = (rand(rng, (1, s, h, d), dtype) for _ in range(3))
        out_b, lse_b = q.nbytes, 1 * h * s * 4
        peak, kept, sizes = _bench.measure_memory(lambda: cf.attention(q, k, v, causal=causal, return_lse=True))
        good &= row(f"fwd {np.dtype(dtype).name} hd{d} s{s} causal={causal}", peak, kept, sizes,
                    out_b + lse_b, "out + lse")

        # Backward from the forward's out / lse: grads + D (+ float32 dQ accumulator). float32
        # at --f32-bwd-seqlen: the portable float32 backward takes seconds per call at 16k.
        if dtype == np.float32 and args.f32_bwd_seqlen < s:
            q, k, v = (x[:, :args.f32_bwd_seqlen].copy() for x in (q, k, v))
        sq = q.shape[1]
        out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
        dout = rand(rng, out.shape, dtype)
        for det in (False, True):
            peak, kept, sizes = _bench.measure_memory(lambda: cf.attention_backward(
                dout, q, k, v, out, lse, causal=causal, deterministic=det))
            allowed = 3 * q.nbytes + h * sq * 4 + sq * h * d * 4
            good &= row(f"bwd {np.dtype(dtype).name} hd{d} s{sq} causal={causal} det={det}", peak,
                        kept, sizes, None if det else allowed,
                        "deterministic: + one dQ slab per key tile" if det else
                        "dq dk dv + D + fp32 dQ accum")
        del q, k, v, out, lse, dout
        cp.get_default_memory_pool().free_all_blocks()

    # Bias (1, h, s, s) bf16, hd 128, batch 2 (16k tokens at s = 8k): forward out + lse;
    # backward grads + D + dQ accum + dbias (+ its float32 accumulator: dbias sums over batch),
    # then with a dbias kernel (sums the batch in registers): dbias only.
    sb, b = args.bias_seqlen, max(1, 16384 // args.bias_seqlen)
    q, k, v = (rand(rng, (b, sb, h, 128), bf16) for _ in range(3))
    bias = rand(rng, (1, h, sb, sb), bf16)
    peak, kept, sizes = _bench.measure_memory(lambda: cf.attention(q, k, v, bias=bias, return_lse=True))
    good &= row(f"fwd bias (1,{h},{sb},{sb}) bf16 hd128 b{b}", peak, kept, sizes,
                q.nbytes + b * h * sb * 4, "out + lse")
    out, lse = cf.attention(q, k, v, bias=bias, return_lse=True)
    dout = rand(rng, out.shape, bf16)
    TUNING.dbias_kernel = False
    peak, kept, sizes = _bench.measure_memory(lambda: cf.attention_backward(dout, q, k, v, out, lse, bias=bias))
    base = 3 * q.nbytes + b * h * sb * 4 + b * sb * h * 128 * 4
    good &= row(f"bwd bias (1,{h},{sb},{sb}) bf16 b{b} fp32 accum", peak, kept, sizes,
                base + bias.nbytes + bias.size * 4, "dq dk dv + D + dQ accum + dbias + fp32 dbias accum")
    print(f"{'':44s} of which dbias {bias.nbytes / MiB:.0f} MiB, its float32 accumulator "
          f"{bias.size * 4 / MiB:.0f} MiB (freed before return)")
    TUNING.dbias_kernel = True
    peak, kept, sizes = _bench.measure_memory(lambda: cf.attention_backward(dout, q, k, v, out, lse, bias=bias))
    TUNING.dbias_kernel = None
    good &= row(f"bwd bias (1,{h},{sb},{sb}) bf16 b{b} dbias kernel", peak, kept, sizes,
                base + bias.nbytes, "dq dk dv + D + dQ accum + dbias")
    # A float32 bias: dbias is its own float32 accumulator (one slab): extra = dbias.
    bias32 = bias.astype(np.float32)
    peak, kept, sizes = _bench.measure_memory(lambda: cf.attention_backward(dout, q, k, v, out, lse, bias=bias32))
    good &= row(f"bwd bias (1,{h},{sb},{sb}) float32 hd128 b{b}", peak, kept, sizes,
                base + bias32.nbytes, "dq dk dv + D + dQ accum + dbias")
    del q, k, v, bias, bias32, out, lse, dout
    cp.get_default_memory_pool().free_all_blocks()

    if not args.skip_cupy:   # the recipe cupyflash replaces: scores in memory
        q, k, v = (rand(rng, (1, s, h, 128), bf16) for _ in range(3))
        fn = _bench.cupy_peer(q, k, v, False, "fwd", max_bytes=1e12)
        peak, kept, sizes = _bench.measure_memory(fn)
        ms = _bench.time_ms(fn, warmup=1, rep=5)
        print(f"{'plain CuPy fwd bf16 hd128 s' + str(s):44s} peak {peak / MiB:9.1f} MiB, {ms:.2f} ms")
        ms = _bench.time_ms(lambda: cf.attention(q, k, v), warmup=3, rep=20)
        print(f"{'cupyflash fwd, same inputs':44s} {ms:.2f} ms, "
              f"{_bench.flops(1, h, s, s, 128, False, 'fwd') / ms / 1e9:.1f} TFLOP/s")
    print("all within the allowed bytes" if good else "SOME ROWS OVER THE ALLOWED BYTES")
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
