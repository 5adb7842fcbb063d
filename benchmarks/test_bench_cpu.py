"""cpu.forward against naive materialized NumPy attention: time and peak traced memory.

The issue's bar, at b=1, h=8, s=4096, d=64, float32:
- time: cpu.forward within 2x of naive softmax(Q Kᵀ) V (measured, reported in extra_info, not
  asserted: time depends on the machine);
- memory: cpu.forward's peak traced memory (tracemalloc) under a quarter of the N×N float32
  score matrix, 8·4096·4096·4 bytes (asserted: it is deterministic).

Run: python -m pytest benchmarks/test_bench_cpu.py --benchmark-only
"""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from cupyflash import cpu
from cupyflash._options import Options

B, H, S, D = 1, 8, 4096, 64
SCORES_BYTES = B * H * S * S * 4             # the float32 N×N score matrix: 512 MiB
MEMORY_LIMIT = SCORES_BYTES // 4             # 128 MiB
MiB = 1 << 20


def naive_attention(q, k, v, scale):
    """softmax(scale · Q Kᵀ) V, materialized: q, k, v bshd [b, s, h, d] -> out [b, s, h, d]."""
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))          # [b, h, s, d] views
    s = np.matmul(qt * np.float32(scale), kt.swapaxes(-1, -2))          # [b, h, s, s]
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, vt).transpose(0, 2, 1, 3)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((B, S, H, D), dtype=np.float32) for _ in range(3))
    return q, k, v, Options(scale=1.0 / np.sqrt(D))


def run_cpu(problem):
    q, k, v, opts = problem
    return cpu.forward(q, k, v, opts)


def run_naive(problem):
    q, k, v, opts = problem
    return naive_attention(q, k, v, opts.scale)


def peak_traced_bytes(fn, *args):
    """Peak bytes traced by tracemalloc (NumPy reports its buffers to it) while fn runs."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def best_time(fn, *args, repeat=3):
    fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def test_bench_cpu_forward(benchmark, problem):
    if benchmark.disabled:
        pytest.skip("timing needs pytest-benchmark enabled (the memory bound has its own test)")
    benchmark.group = f"forward b={B} h={H} s={S} d={D} float32"
    out, _ = benchmark.pedantic(run_cpu, args=(problem,), rounds=3, iterations=1, warmup_rounds=1)
    peak = peak_traced_bytes(run_cpu, problem)
    naive_s = best_time(run_naive, problem)
    cpu_s = benchmark.stats.stats.min
    benchmark.extra_info.update(
        cpu_forward_min_s=round(cpu_s, 4), naive_min_s=round(naive_s, 4),
        time_ratio_vs_naive=round(cpu_s / naive_s, 3),
        cpu_forward_peak_MiB=round(peak / MiB, 1), scores_MiB=SCORES_BYTES // MiB,
        memory_limit_MiB=MEMORY_LIMIT // MiB)
    print(f"\ncpu.forward {cpu_s:.3f} s, naive {naive_s:.3f} s (ratio {cpu_s / naive_s:.2f}); "
          f"cpu.forward peak traced {peak / MiB:.1f} MiB (limit {MEMORY_LIMIT // MiB} MiB)")
    np.testing.assert_allclose(out, run_naive(problem), rtol=1e-4, atol=1e-5)
    assert peak < MEMORY_LIMIT


def test_bench_naive(benchmark, problem):
    if benchmark.disabled:
        pytest.skip("timing needs pytest-benchmark enabled (the memory bound has its own test)")
    benchmark.group = f"forward b={B} h={H} s={S} d={D} float32"
    benchmark.pedantic(run_naive, args=(problem,), rounds=3, iterations=1, warmup_rounds=1)
    peak = peak_traced_bytes(run_naive, problem)
    benchmark.extra_info.update(naive_min_s=round(benchmark.stats.stats.min, 4),
                                naive_peak_MiB=round(peak / MiB, 1))
    print(f"\nnaive {benchmark.stats.stats.min:.3f} s, peak traced {peak / MiB:.1f} MiB")
    assert peak >= SCORES_BYTES          # tracemalloc does see NumPy's buffers


def test_cpu_forward_memory_bound(problem):
    """Deterministic: cpu.forward never holds memory anywhere near the N×N score matrix."""
    peak_cpu = peak_traced_bytes(run_cpu, problem)
    peak_naive = peak_traced_bytes(run_naive, problem)
    print(f"\npeak traced: cpu.forward {peak_cpu / MiB:.1f} MiB, naive {peak_naive / MiB:.1f} MiB, "
          f"limit {MEMORY_LIMIT // MiB} MiB")
    assert peak_naive >= SCORES_BYTES
    assert peak_cpu < MEMORY_LIMIT
