"""Decode speed: attention_with_kvcache beside PyTorch SDPA's cuDNN and flash (FA2) backends.

bf16, head dim 128, one query row per sequence, every cache row attended. GB/s = bytes of K and V
read (2 · batch · seqlen · heads_k · head_dim · 2 B) / time; CUDA events around a loop of calls,
median of 5 loops after warm-up. The copy bandwidth is a CuPy device-to-device copy of a 4 GiB
buffer in the same run, counted as bytes read + bytes written over time (the HBM traffic of a
copy, as the decode's bytes read are its HBM traffic).

Columns: ``cupyflash`` with cache_seqlens an int and ``set_device_checks(False)`` (lengths
checked on the host; the paged rows' device block table not read back: the decode-loop
setting); ``dev-lens`` with cache_seqlens a device array and the default pre-launch check of
lengths and block indices (one read-back, i.e. one synchronization, per call; device-held
lengths also keep multi-head rows on the decode kernel); the peers attend to the same keys of a
contiguous cache (SDPA has no paged cache). ``splits``: the decode kernel's split count, or
``fwd`` where the call ran on the Hopper forward (decode_route). ``host us`` is the wall time per
cupyflash call of the timing loop. ``--ab`` adds plan_decode.TUNING's alternatives as columns.

    PYTHONPATH=. python benchmarks/bench_kvcache.py [--rows NAME ...] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
ROWS = [
    # name, batch, seqlen, heads, heads_k, page (None: contiguous)
    ("1x131072x32/8", 1, 131072, 32, 8, None),
    ("8x8192x32/8", 8, 8192, 32, 8, None),
    ("64x4096x32/32", 64, 4096, 32, 32, None),
    ("4x32768x32/32", 4, 32768, 32, 32, None),
    ("32x16384x32/8", 32, 16384, 32, 8, None),
    ("32x16384x32/8 page16", 32, 16384, 32, 8, 16),
    ("32x16384x32/8 page256", 32, 16384, 32, 8, 256),
]
D = 128


def _time(cp, fn, target_s=0.03, loops=5):
    """Median seconds per call of fn (CUDA events around loops of n calls) and wall seconds per
    call of those loops."""
    for _ in range(3):
        fn()
    cp.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    fn()
    cp.cuda.get_current_stream().synchronize()
    one = max(time.perf_counter() - t0, 1e-5)
    n = max(3, min(200, int(target_s / one)))
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times, walls = [], []
    for _ in range(loops):
        w0 = time.perf_counter()
        start.record()
        for _ in range(n):
            fn()
        stop.record()
        stop.synchronize()
        walls.append((time.perf_counter() - w0) / n)
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / n)
    return statistics.median(times), statistics.median(walls)


def copy_bandwidth(cp, nbytes=4 << 30):
    a = cp.empty(nbytes, np.uint8)
    b = cp.empty_like(a)
    a.fill(1)
    t, _ = _time(cp, lambda: cp.copyto(b, a), target_s=0.1, loops=3)
    return 2 * nbytes / t / 1e9


def row_arrays(cp, b, s, h, hk, page, rng):
    """One row's bf16 GPU arrays: q (b, 1, h, D), the contiguous k, v (b, s, hk, D) and the cache
    the call reads: k, v themselves (``page`` None) or pages of ``page`` keys in ``rng``'s
    shuffled order with their block table (b, s / page)."""
    q = cp.random.standard_normal((b, 1, h, D), dtype=np.float32).astype(BF16)
    k = cp.random.standard_normal((b, s, hk, D), dtype=np.float32).astype(BF16)
    v = cp.random.standard_normal((b, s, hk, D), dtype=np.float32).astype(BF16)
    if page is None:
        return q, k, v, k, v, None
    nb = b * s // page
    perm = cp.asarray(rng.permutation(nb).astype(np.int32))
    kc = cp.empty((nb, page, hk, D), BF16)
    vc = cp.empty((nb, page, hk, D), BF16)
    kc[perm] = k.reshape(nb, page, hk, D)
    vc[perm] = v.reshape(nb, page, hk, D)
    return q, k, v, kc, vc, perm.reshape(b, s // page)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    ap.add_argument("--ab", action="store_true",
                    help="also time plan_decode.TUNING's alternatives (multi-head rows on the "
                         "decode kernel instead of the Hopper forward; a separate combine kernel; "
                         "3 CTAs per SM)")
    ap.add_argument("--extra-splits", nargs="*", type=int, default=[],
                    help="also time these forced num_splits per row (GB/s printed after the table)")
    args = ap.parse_args(argv)

    import cupy as cp

    import cupyflash as cf
    from cupyflash import kvcache
    from cupyflash.gpu import decode_route, device, plan_decode

    def with_tuning(fn, **kw):
        """fn timed under plan_decode.TUNING changed by kw (repeated-call caches cleared)."""
        old = dict(plan_decode.TUNING)
        plan_decode.TUNING.update(kw)
        kvcache._FAST.clear()
        try:
            return _time(cp, fn)[0]
        finally:
            plan_decode.TUNING.update(old)
            kvcache._FAST.clear()

    try:
        sys.path.insert(0, ".")
        from benchmarks.peers import try_peer
    except ImportError:
        try_peer = None
    dev = cp.cuda.Device()
    _, smem, sms = device.info(dev.id)
    print(f"device: {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, {sms} SMs")
    copy_gbs = copy_bandwidth(cp)
    cp.get_default_memory_pool().free_all_blocks()
    print(f"copy bandwidth (4 GiB cupy copy, read + write): {copy_gbs:.0f} GB/s")
    rng = np.random.default_rng(0)
    cp.random.seed(0)
    table = []
    hdr = (f"| {'batch x cache x heads/kv':26s} | {'GiB':>5s} | {'splits':>6s} | {'cupyflash':>9s} | "
           f"{'dev-lens':>8s} | {'FA2':>6s} | {'cuDNN':>6s} | {'/best':>5s} | {'/copy':>5s} | {'host us':>7s} |"
           + (f" {'no fwd route':>12s} | {'2 kernels':>9s} | {'3 CTAs/SM':>9s} |"
              if args.ab else ""))
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    contiguous_gbs = {}
    extra = []
    for name, b, s, h, hk, page in ROWS:
        if args.rows and name not in args.rows:
            continue
        cp.get_default_memory_pool().free_all_blocks()
        nbytes = 2 * b * s * hk * D * 2
        q, k, v, kc, vc, bt = row_arrays(cp, b, s, h, hk, page, rng)
        lens_dev = cp.full(b, s, np.int32)
        kvcache.set_device_checks(False)     # the block table's values: no read-back per call
        kvcache._FAST.clear()
        try:
            t_cf, wall = _time(cp, lambda: cf.attention_with_kvcache(q, kc, vc, cache_seqlens=s, block_table=bt))
        finally:
            kvcache.set_device_checks(True)
        routed = any(isinstance(e.launch, decode_route.ForwardRoute) for e in kvcache._FAST.values())
        t_dev, _ = _time(cp, lambda: cf.attention_with_kvcache(q, kc, vc, cache_seqlens=lens_dev, block_table=bt))
        plan = plan_decode.plan_decode("bfloat16", b, 1, h, hk, D, s, 0, sms, smem)
        gbs = nbytes / t_cf / 1e9
        peers = {}
        if page is None and try_peer is not None:
            for peer in ("flash", "cudnn"):
                fn = try_peer(peer, q, k, v, False, "fwd")
                peers[peer] = nbytes / _time(cp, fn)[0] / 1e9 if fn is not None else None
            contiguous_gbs[(b, s, h, hk)] = (gbs, peers)
        else:
            peers = contiguous_gbs.get((b, s, h, hk), (None, {}))[1]
        ab = ""
        if args.ab:
            call = lambda: cf.attention_with_kvcache(q, kc, vc, cache_seqlens=s, block_table=bt)  # noqa: E731
            kvcache.set_device_checks(False)
            try:
                ts = [with_tuning(call, mha_forward=False), with_tuning(call, fused_combine=False),
                      with_tuning(call, ctas_per_sm=3)]
            finally:
                kvcache.set_device_checks(True)
            ab = "".join(f" {nbytes / t / 1e9:{w}.0f} |" for t, w in zip(ts, (12, 9, 9)))
        kvcache.set_device_checks(False)
        try:
            for ns in args.extra_splits:
                t_ns, _ = _time(cp, lambda: cf.attention_with_kvcache(q, kc, vc, cache_seqlens=s, block_table=bt,
                                                                        num_splits=ns))
                extra.append(f"{name}: num_splits={ns}: {nbytes / t_ns / 1e9:.0f} GB/s")
        finally:
            kvcache.set_device_checks(True)
        best = max([x for x in peers.values() if x] or [float("nan")])
        fmt = lambda x: f"{x:6.0f}" if x else "     -"   # noqa: E731
        splits = "fwd" if routed else str(plan.num_splits)
        print(f"| {name:26s} | {nbytes / 2**30:5.2f} | {splits:>6s} | {gbs:9.0f} | "
              f"{nbytes / t_dev / 1e9:8.0f} | {fmt(peers.get('flash'))} | {fmt(peers.get('cudnn'))} | "
              f"{gbs / best:5.2f} | {gbs / copy_gbs:5.2f} | {wall * 1e6:7.1f} |" + ab, flush=True)
        table.append(dict(row=name, gib=nbytes / 2**30, splits=plan.num_splits,
                          variant="sm90_forward" if routed else plan.variant.name,
                          cupyflash=gbs, dev_lens=nbytes / t_dev / 1e9, fa2=peers.get("flash"),
                          cudnn=peers.get("cudnn"), copy=copy_gbs, host_us=wall * 1e6))
    for name, b, s, h, hk, page in ROWS:
        if page is not None and (b, s, h, hk) in contiguous_gbs:
            cont = contiguous_gbs[(b, s, h, hk)][0]
            row = next((r for r in table if r["row"] == name), None)
            if row:
                print(f"{name}: {row['cupyflash'] / cont:.3f} x contiguous")
    for line in extra:
        print(line)
    # host overhead of a repeated call (tiny cache: the GPU waits for the host)
    q = cp.asarray(rng.standard_normal((1, 1, 32, D), np.float32)).astype(BF16)
    kc = cp.asarray(rng.standard_normal((1, 256, 8, D), np.float32)).astype(BF16)
    t0 = time.perf_counter()
    for _ in range(200):
        cf.attention_with_kvcache(q, kc, kc, cache_seqlens=256)
    cp.cuda.get_current_stream().synchronize()
    print(f"host time per repeated call (1 x 256 x 32/8): {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
    # the plain attention call on decode shapes: its own forward vs the split-KV route
    from cupyflash import _checks as ck
    from cupyflash.gpu import decode, fwd
    for b, s, h, hk in ((1, 131072, 32, 8), (8, 8192, 32, 8), (4, 32768, 32, 32)):
        q = cp.random.standard_normal((b, 1, h, D), dtype=np.float32).astype(BF16)
        k = cp.random.standard_normal((b, s, hk, D), dtype=np.float32).astype(BF16)
        v = cp.random.standard_normal((b, s, hk, D), dtype=np.float32).astype(BF16)
        opts = ck.make_options(ck.Dims(b, 1, s, h, hk, D, D), cp)
        out = cp.empty((b, 1, h, D), BF16)
        lse = cp.empty((b, h, 1), np.float32)
        nbytes = 2 * b * s * hk * D * 2
        t_f = _time(cp, lambda: fwd.forward(q, k, v, out, lse, opts))[0]
        if decode.forward_few_rows(q, k, v, out, lse, opts) is None:
            print(f"attention {b}x{s}x{h}/{hk}: forward {nbytes / t_f / 1e9:.0f} GB/s "
                  "(split-KV route not taken)")
            continue
        t_d = _time(cp, lambda: decode.forward_few_rows(q, k, v, out, lse, opts))[0]
        print(f"attention {b}x{s}x{h}/{hk}: forward {nbytes / t_f / 1e9:.0f} GB/s, "
              f"split-KV route {nbytes / t_d / 1e9:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbs=copy_gbs, rows=table), f, indent=1)


if __name__ == "__main__":
    main()
