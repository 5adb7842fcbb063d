# Question: How fast are a (1, h, s, s) bias with dbias and native varlen beside SDPA's memory-efficient backend, and at what extra memory?
"""Bias (with gradient) and native varlen speed on the GPU (issue 6's two tables).

Table 1: bias (1, h, s, s) bf16, head dim 128, hidden 2048 (16 heads), 16k tokens (batch = 16k / s),
s = 1k..8k, forward and backward, beside PyTorch SDPA's memory-efficient backend with the same
float attn_mask (the SDPA backend that returns a bias gradient), same run. Backward includes
dbias (ours: dbias in the bias's shape, float32 accumulation; SDPA: attn_mask.grad). "extra MiB":
device memory the backward allocates beyond dq, dk, dv and dbias (CuPy pool / torch allocator).

Table 2: varlen, 16k tokens in sequences of mixed lengths (64..4096, log-uniform, fixed seed) in
one packed batch, against the dense call at the longest length (batch = 16k / 4096), bf16, head
dim 128, 16 heads, causal and not, forward and backward. Work-normalized: TFLOP/s of each (FLOPs
= Σ 4·h·s_i²·d, halved for causal; backward 2.5x) and the ratio varlen / dense; tokens/s also.

CUDA events around each call, warm-up first, median of the repeats. PyTorch is a benchmark peer
only (imported here, never by cupyflash).

    python lab/bench_bias_varlen.py [--seqlens 1024,2048,4096,8192] [--reps 5] [--json F]
        [--skip bias|varlen] [--bwd-kernel auto|portable|sm90]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _checks  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, fwd as gpu_fwd

BF16 = np.dtype(ml_dtypes.bfloat16)
TOKENS = 16384
H, D = 16, 128


def _time(fn, warmup, reps, event):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = event(), event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) if hasattr(a, "elapsed_time") else cp.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def _cp_time(fn, warmup, reps):
    return _time(fn, warmup, reps, cp.cuda.Event)


def _rnd(shape):
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(BF16)


def bench_bias_ours(s, warmup, reps, bwd_kernel=None):
    b = TOKENS // s
    q, k, v, dout = (_rnd((b, s, H, D)) for _ in range(4))
    bias = _rnd((1, H, s, s))
    dims = _checks.check_qkv(q, k, v)
    opts = _checks.make_options(dims, cp, bias=bias)
    out = cp.empty_like(q)
    lse = cp.empty((b, H, s), cp.float32)
    fwd = lambda: gpu_fwd.forward(q, k, v, out, lse, opts)  # noqa: E731
    name = fwd()
    t_f = _cp_time(fwd, warmup, reps)
    grads = [cp.empty_like(x) for x in (q, k, v)]
    dbias = cp.empty(bias.shape, BF16)
    bwd = lambda: gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, dbias=dbias,  # noqa: E731
                                    kernel=bwd_kernel)
    bname = bwd()
    cp.cuda.Device().synchronize()
    t_b = _cp_time(bwd, warmup, reps)
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    bwd()
    cp.cuda.Device().synchronize()
    extra = pool.total_bytes() - before     # blocks the call allocated (freed ones stay cached)
    del q, k, v, dout, bias, out, lse, grads, dbias
    pool.free_all_blocks()
    return t_f, t_b, extra, name, bname


def bench_bias_sdpa(s, warmup, reps):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    b = TOKENS // s
    mk = lambda *sh: torch.randn(*sh, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (mk(b, H, s, D) for _ in range(3))
    bias = mk(1, H, s, s)

    def fwd(q, k, v, bias):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    with torch.no_grad():
        t_f = _time(lambda: fwd(q, k, v, bias), warmup, reps, ev)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
    out = fwd(*leaves)
    dout = torch.randn_like(out)
    bwd = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)  # noqa: E731
    t_b = _time(bwd, warmup, reps, ev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    g = bwd()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - sum(x.numel() * x.element_size() for x in g)
    del q, k, v, bias, leaves, out, dout, g
    torch.cuda.empty_cache()
    return t_f, t_b, extra


def _lengths(seed=0, lo=64, hi=4096, total=TOKENS):
    """Mixed lengths in [lo, hi], log-uniform, summing to ``total`` (the last one trimmed);
    includes hi once so the dense comparison at hi is the longest sequence."""
    rng = np.random.default_rng(seed)
    lens = [hi]
    while sum(lens) < total:
        lens.append(int(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    lens[-1] -= sum(lens) - total
    if lens[-1] < lo:
        lens[-2] += lens.pop()
    return lens


def bench_varlen(causal, warmup, reps):
    lens = _lengths()
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    tot, longest = sum(lens), max(lens)
    q, k, v, dout = (_rnd((1, tot, H, D)) for _ in range(4))
    dims = _checks.Dims(len(lens), tot, tot, H, H, D, D)
    opts = _checks.make_options(dims, cp, causal=causal)
    out = cp.empty_like(q)
    lse = cp.empty((H, tot), cp.float32)
    fwd = lambda: gpu_fwd.forward_varlen(q, k, v, cu, cu, longest, longest, out, lse, opts)  # noqa: E731
    name = fwd()
    t_f = _cp_time(fwd, warmup, reps)
    grads = [cp.empty_like(x) for x in (q, k, v)]
    bwd = lambda: gpu_bwd.backward_varlen(dout, q, k, v, out, lse, cu, cu, longest, longest,  # noqa: E731
                                           *grads, opts)
    bname = bwd()
    t_b = _cp_time(bwd, warmup, reps)
    flops = sum(4.0 * H * s * s * D for s in lens) / (2 if causal else 1)
    # dense at the longest length, same token count
    b = TOKENS // longest
    qd, kd, vd, dod = (_rnd((b, longest, H, D)) for _ in range(4))
    optd = _checks.make_options(_checks.check_qkv(qd, kd, vd), cp, causal=causal)
    outd = cp.empty_like(qd)
    lsed = cp.empty((b, H, longest), cp.float32)
    fwdd = lambda: gpu_fwd.forward(qd, kd, vd, outd, lsed, optd)  # noqa: E731
    fwdd()
    td_f = _cp_time(fwdd, warmup, reps)
    gd = [cp.empty_like(x) for x in (qd, kd, vd)]
    bwdd = lambda: gpu_bwd.backward(dod, qd, kd, vd, outd, lsed, *gd, optd)  # noqa: E731
    bnamed = bwdd()
    td_b = _cp_time(bwdd, warmup, reps)
    flops_d = 4.0 * b * H * longest * longest * D / (2 if causal else 1)
    return dict(lens=lens, name=name, bname=bname, bnamed=bnamed, t_f=t_f, t_b=t_b, flops=flops, td_f=td_f, td_b=td_b,
                flops_d=flops_d, tokens=tot, tokens_d=b * longest)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", default="1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list: bias,varlen")
    ap.add_argument("--bwd-kernel", default="auto", choices=("auto", "portable", "sm90"),
                    help="our backward with a bias: the planner's choice (auto), or forced")
    a = ap.parse_args(argv)
    res = {"bias": [], "varlen": []}
    skip = set(a.skip.split(",")) - {""}
    if "bias" not in skip:
        print("bias (1, h, s, s) bf16, hd 128, 16 heads, 16k tokens; ms (TFLOP/s); vs = SDPA ms / ours ms")
        print("    s |   ours fwd        memeff fwd       vs  |   ours bwd        memeff bwd       vs  |"
              " extra MiB ours / memeff | dbias MiB")
        for s in (int(x) for x in a.seqlens.split(",")):
            b = TOKENS // s
            fl = 4.0 * b * H * s * s * D
            of, ob, oextra, name, bname = bench_bias_ours(
                s, a.warmup, a.reps, None if a.bwd_kernel == "auto" else a.bwd_kernel)
            sd = bench_bias_sdpa(s, a.warmup, a.reps)
            sf, sb, sextra = sd if sd else (math.nan, math.nan, math.nan)
            dbias_mib = H * s * s * 2 / 2**20
            print(f"{s:5d} | {of:8.3f} ({fl / of / 1e9:5.1f}) {sf:8.3f} ({fl / sf / 1e9:5.1f}) {sf / of:5.2f}x |"
                  f" {ob:8.3f} ({2.5 * fl / ob / 1e9:5.1f}) {sb:8.3f} ({2.5 * fl / sb / 1e9:5.1f}) {sb / ob:5.2f}x |"
                  f" {oextra / 2**20:9.0f} / {sextra / 2**20:9.0f} | {dbias_mib:8.0f}   {name} {bname}",
                  flush=True)
            res["bias"].append(dict(s=s, ours_fwd_ms=of, ours_bwd_ms=ob, memeff_fwd_ms=sf,
                                    memeff_bwd_ms=sb, ours_extra_bytes=oextra,
                                    memeff_extra_bytes=sextra, kernels=[name, bname]))
    if "varlen" not in skip:
        print("\nvarlen: 16k tokens, mixed lengths 64..4096, bf16 hd 128, 16 heads; vs dense at the longest length")
        print(" causal | dir |  varlen ms  TFLOP/s  Mtok/s |  dense ms  TFLOP/s  Mtok/s | TFLOP/s ratio")
        for causal in (False, True):
            r = bench_varlen(causal, a.warmup, a.reps)
            for dname, tv, td, mult in (("fwd", r["t_f"], r["td_f"], 1.0), ("bwd", r["t_b"], r["td_b"], 2.5)):
                tv_tf = mult * r["flops"] / tv / 1e9
                td_tf = mult * r["flops_d"] / td / 1e9
                kern = f"   {r['name']}" if dname == "fwd" else f"   {r['bname']} / {r['bnamed']}"
                print(f" {str(causal):6s} | {dname} | {tv:9.3f} {tv_tf:8.1f} {r['tokens'] / tv / 1e3:7.1f} |"
                      f" {td:8.3f} {td_tf:8.1f} {r['tokens_d'] / td / 1e3:7.1f} | {tv_tf / td_tf:5.2f}{kern}",
                      flush=True)
            res["varlen"].append({k_: v_ for k_, v_ in r.items()} | {"causal": causal})
        print(f" lengths ({len(r['lens'])} sequences): {r['lens']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
