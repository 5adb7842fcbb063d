"""GPU benchmark suite (pytest-benchmark): cupyflash beside its peers on FlashAttention's shapes.

``PYTHONPATH=. pytest benchmarks --benchmark-only`` on a GPU machine. Each case times one
implementation with a device synchronize inside the timed call (pytest-benchmark's clock), and
puts the CUDA-event median and TFLOP/s in ``extra_info``. Peers that are not importable or refuse a
problem are skipped. The bf16 grid is the README's table; fp16 and fp32 run a shorter one.
"""
import math

import numpy as np
import pytest

from cupyflash import _bench
from cupyflash._interop import gpu_available

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")

try:
    from benchmarks.peers import PEERS as TORCH_PEERS
except ImportError:  # run from elsewhere
    TORCH_PEERS = {}

IMPLS = {"cupyflash": _bench.cupyflash_peer, **_bench.BUILTIN_PEERS, **TORCH_PEERS}
CASES = ([("bf16", hd, s) for hd in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384)]
         + [(dt, 128, s) for dt in ("fp16", "fp32") for s in (1024, 4096)])


@pytest.fixture(scope="module")
def inputs():
    """(dtype, hd, seqlen) -> q, k, v on the GPU, kept for the module (one shape at a time)."""
    import cupy as cp

    cache = {}

    def get(dt, hd, s):
        key = (dt, hd, s)
        if key not in cache:
            cache.clear()
            cp.get_default_memory_pool().free_all_blocks()
            rng = np.random.default_rng(0)
            b, h = _bench.TOKENS // s, _bench.HIDDEN // hd
            cache[key] = tuple(cp.asarray(rng.standard_normal((b, s, h, hd), np.float32))
                               .astype(_bench.DTYPES[dt]) for _ in range(3))
        return cache[key]

    return get


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt, hd, s", CASES, ids=[f"{dt}-hd{hd}-s{s}" for dt, hd, s in CASES])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_attention_speed(benchmark, inputs, impl, dt, hd, s, causal, direction):
    import cupy as cp

    q, k, v = inputs(dt, hd, s)
    try:
        fn = IMPLS[impl](q, k, v, causal, direction)
    except Exception as exc:
        pytest.skip(f"{impl} refuses this problem: {type(exc).__name__}")
    if fn is None:
        pytest.skip(f"{impl} does not run this case")
    ms = _bench.time_ms(fn)
    b, _, h, _ = q.shape
    benchmark.extra_info.update(
        impl=impl, dtype=dt, head_dim=hd, seqlen=s, causal=causal, direction=direction,
        event_median_ms=ms, tflops=_bench.flops(b, h, s, s, hd, causal, direction) / ms / 1e9)

    def synced():
        fn()
        cp.cuda.Device().synchronize()

    benchmark.pedantic(synced, rounds=10, warmup_rounds=2, iterations=1)
    assert math.isfinite(ms) and ms > 0
