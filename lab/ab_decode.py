# Question: which load scheme, occupancy and split count of the split-KV decode kernel reads the KV cache fastest on this GPU, and where is the device's read roof for the cache's access pattern?
"""Interleaved A/B of flash_decode candidates on benchmarks/bench_kvcache.py's rows (bf16, hd 128,
one query row, every cache row attended; GB/s = bytes of K and V read / time).

Candidates are plan_decode.TUNING overrides (``ctas_per_sm`` / ``nw``: occupancy;
``mha_forward`` off: multi-head rows on the decode kernel), a forced split count (``x2``: twice
the planner's, which also keeps multi-head rows on the decode kernel), a probe with the key
loop's math cut out of the kernel text (``nomath``: what the load machinery alone reaches; its
outputs are garbage and not compared), and for the contiguous multi-head rows the plain
``attention`` forward (the Hopper kernel on sm_90). The first device run of this script (H100)
also timed cp.async.bulk rows and L2 prefetches ahead of the ring, since removed from the kernel
(docs/kvcache.md has the figures).
Every candidate's output is compared with the default's (max |diff| printed when above 2e-2 x
max |out|). Each round times every candidate once (CUDA events around n calls, ~20 ms), so clock
drift hits all alike; medians over rounds.

Read roof: a plain 16-byte-load kernel at full occupancy reading 2 GiB as the cache is laid out,
256-byte rows of one head at a stride of heads x 256 bytes (heads 1: contiguous), each CTA one
head and a run of rows. A last row with a 16 MB cache (it stays in L2 between calls) shows the
fixed cost of a call.

    PYTHONPATH=. python lab/ab_decode.py [--rounds 5] [--rows NAME ...] [--only LABEL ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, ".")

BF16 = np.dtype(ml_dtypes.bfloat16)
D = 128
NOMATH = "-DKV_PROBE_NOMATH=1"

#: label -> (TUNING overrides, split rule, probe option)
CANDIDATES = {
    "base": ({}, None, None),
    "3cta": ({"ctas_per_sm": 3}, None, None),
    "2w4cta": ({"nw": 2, "ctas_per_sm": 4}, None, None),
    "no route": ({"mha_forward": False}, None, None),
    "x2": ({}, "x2", None),
    "nomath": ({"mha_forward": False}, None, NOMATH),
    "fwd": ({}, "fwd", None),
}

ROOF_SRC = r"""
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
extern "C" __global__ void read_rows(const uint4* __restrict__ buf, int heads, int rows_per_cta,
                                     unsigned int* sink) {
    // piece = one head's 256-byte row (16 uint4); row r of head h at uint4 (r * heads + h) * 16
    const int h = blockIdx.x % heads;
    const long long r0 = (long long)(blockIdx.x / heads) * rows_per_cta;
    uint4 acc = make_uint4(0, 0, 0, 0);
    const int n = rows_per_cta * 16;
    for (int i = threadIdx.x; i < n; i += blockDim.x * 4) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int idx = i + k * blockDim.x;
            v[k] = idx < n ? ld_stream(buf + ((r0 + idx / 16) * heads + h) * 16 + idx % 16) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) { acc.x ^= v[k].x; acc.y ^= v[k].y; acc.z ^= v[k].z; acc.w ^= v[k].w; }
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = acc.x;
}
"""


def loop_time(cp, fn, n):
    """Seconds per call of n calls between CUDA events (one untimed call first: it may rebuild
    the launch after a TUNING change)."""
    fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(n):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / n


def calls_for(cp, fn, target_s=0.02):
    for _ in range(2):
        fn()
    cp.cuda.get_current_stream().synchronize()
    t = loop_time(cp, fn, 3)
    return max(3, min(300, int(target_s / max(t, 1e-6))))


def read_roof(cp, rounds=3):
    """GB/s of read_rows over 2 GiB for heads 1 (contiguous), 8 and 32."""
    k = cp.RawKernel(ROOF_SRC, "read_rows")
    nbytes = 2 << 30
    buf = cp.ones(nbytes // 2, np.uint16)
    sink = cp.zeros(1, np.uint32)
    out = {}
    for heads in (1, 8, 32):
        rows_per_cta = 1024
        total_rows = nbytes // 256 // heads
        grid = (total_rows // rows_per_cta * heads,)
        fn = lambda: k(grid, (256,), (buf, np.int32(heads), np.int32(rows_per_cta), sink))  # noqa: E731
        n = calls_for(cp, fn)
        out[heads] = nbytes / statistics.median(loop_time(cp, fn, n) for _ in range(rounds)) / 1e9
    del buf
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", nargs="*", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="candidate labels (default: all)")
    ap.add_argument("--no-roof", action="store_true")
    args = ap.parse_args(argv)

    import cupy as cp

    import cupyflash as cf
    from benchmarks.bench_kvcache import ROWS, row_arrays
    from cupyflash import _checks as ck
    from cupyflash import kvcache
    from cupyflash.gpu import compile as C
    from cupyflash.gpu import device, fwd, plan_decode

    # the nomath probe: the kernel text with the key loop's math removed (keyed by its option)
    orig_program = C.program

    def program(variants, extra_options=()):
        src, opts, names = orig_program(variants, extra_options)
        if NOMATH in extra_options:
            a = src.index("        // S = Q K(tile)ᵀ")
            b = src.index("        __syncwarp();   // every lane finished reading this slot")
            src = src[:a] + src[b:]
        return src, opts, names

    C.program = program
    orig_opts = plan_decode.build_options
    probe = [None]
    plan_decode.build_options = lambda: orig_opts() + ((probe[0],) if probe[0] else ())

    dev = cp.cuda.Device()
    cc, smem, sms = device.info(dev.id)
    print(f"device: {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, {sms} SMs, cc {cc}")
    if not args.no_roof:
        t0 = time.time()
        roof = read_roof(cp)
        print("read roof (2 GiB, 16-byte loads, 256-byte rows at a stride of heads x 256 B): "
              + ", ".join(f"heads {h}: {g:.0f} GB/s" for h, g in roof.items())
              + f"  ({time.time() - t0:.1f} s)")
    labels = [c for c in CANDIDATES if not args.only or c in args.only or c == "base"]
    kvcache.set_device_checks(False)
    print("| row | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    summary = {c: [] for c in labels}
    for name, b, s, h, hk, page in ROWS + [("1x4096x32/8 (in L2)", 1, 4096, 32, 8, None)]:
        if args.rows and name not in args.rows:
            continue
        cp.get_default_memory_pool().free_all_blocks()
        nbytes = 2 * b * s * hk * D * 2
        q, k, v, kc, vc, bt = row_arrays(cp, b, s, h, hk, page, np.random.default_rng(0))
        del k, v
        base_plan = plan_decode.plan_decode("bfloat16", b, 1, h, hk, D, s, 0, sms, smem, cc)
        fns, notes = {}, []
        for c in labels:
            tune, rule, opt = CANDIDATES[c]
            if rule == "fwd":
                if page is not None or h != hk:
                    continue
                opts = ck.make_options(ck.Dims(b, 1, s, h, hk, D, D), cp)
                out = cp.empty((b, 1, h, D), BF16)
                lse = cp.empty((b, h, 1), np.float32)
                fns[c] = (tune, opt, lambda q=q, k=kc, v=vc, out=out, lse=lse, opts=opts:
                          fwd.forward(q, k, v, out, lse, opts), lambda out=out: out)
                continue
            ns = 0 if rule is None else 2 * base_plan.num_splits
            fn = (lambda ns=ns: cf.attention_with_kvcache(q, kc, vc, cache_seqlens=s, block_table=bt,
                                                          num_splits=ns))
            fns[c] = (tune, opt, fn, None)

        def under(c, what):
            tune, opt, fn, _ = fns[c]
            old = dict(plan_decode.TUNING)
            plan_decode.TUNING.update(tune)
            probe[0] = opt
            kvcache._FAST.clear()
            try:
                return what(fn)
            finally:
                plan_decode.TUNING.update(old)
                probe[0] = None
                kvcache._FAST.clear()

        ref = under("base", lambda fn: fn()).astype(np.float32)
        scale = float(cp.abs(ref).max())
        for c in fns:
            if c == "base" or fns[c][1]:
                continue
            got = under(c, lambda fn: fn())
            if fns[c][3] is not None:
                got = fns[c][3]()
            err = float(cp.abs(got.astype(np.float32) - ref).max())
            if not err <= 2e-2 * scale:
                notes.append(f"{c}: max|diff| {err:.3g} (max|out| {scale:.3g})")
        ncalls = {c: under(c, lambda fn: calls_for(cp, fn)) for c in fns}
        times = {c: [] for c in fns}
        for _ in range(args.rounds):
            for c in fns:
                times[c].append(under(c, lambda fn: loop_time(cp, fn, ncalls[c])))
        gbs = {c: nbytes / statistics.median(t) / 1e9 for c, t in times.items()}
        for c in labels:
            if "in L2" not in name:
                summary[c].append(gbs[c] / gbs["base"] if c in gbs else float("nan"))
        print(f"| {name} ({base_plan.num_splits} sp) | "
              + " | ".join(f"{gbs[c]:.0f}" if c in gbs else "-" for c in labels) + " |", flush=True)
        for n in notes:
            print("   MISMATCH " + n)
        del q, kc, vc, bt, fns
    print("| geomean / base | " + " | ".join(
        f"{np.exp(np.nanmean(np.log(summary[c]))):.3f}" if summary[c] else "-" for c in labels) + " |")


if __name__ == "__main__":
    main()
