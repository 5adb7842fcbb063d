"""The forward and backward grid on a GPU that allows 99 KB of shared memory per block (sm_86,
sm_89, sm_120: RTX 30xx / 40xx / 50xx, A10, L4, L40), emulated on a larger GPU with
cupyflash.gpu.device.limit_shared_memory: every dtype and head dim up to 256 plans kernels within
99 KB (portable ones: the Hopper kernels need more) and matches the float64 reference with the
project's criterion (test_fuzz.run_case: docs/semantics.md §9)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gpu_util import BF16, cp  # noqa: E402
from test_fuzz import run_case  # noqa: E402

from cupyflash._options import Options  # noqa: E402
from cupyflash.gpu import bwd as gpu_bwd, device, fwd as gpu_fwd, plan_bwd, plan_fwd  # noqa: E402

pytestmark = pytest.mark.gpu

LIMIT = 99 * 1024
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16, "float32": np.dtype(np.float32)}
HEAD_DIMS = [16, 40, 64, 72, 96, 128, 160, 192, 224, 256]
#: option sets of the grid (test_fuzz.draw_case's case keys)
OPTIONS = {
    "plain": dict(h=4, h_k=4),
    "causal_gqa": dict(h=4, h_k=2, causal=True),
    "window_softcap_alibi": dict(h=2, h_k=1, window=(40, 17), softcap=20.0, alibi="bh"),
    "bias": dict(h=2, h_k=2, bias=(1, 2, 200, 333)),
}


@pytest.fixture(autouse=True)
def limited():
    with device.limit_shared_memory(LIMIT):
        yield


@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernels_fit_99kb(dtype, d):
    """The variants the dispatchers pick under the limit are portable and need <= 99 KB."""
    dt = DTYPES[dtype]
    rng = np.random.default_rng()
    q, k, v, dout = (cp.asarray(rng.standard_normal((1, 200, 2, d)).astype(dt)) for _ in range(4))
    out = cp.full(q.shape, cp.nan, dt)
    lse = cp.full((1, 2, 200), cp.nan, cp.float32)
    opts = Options(scale=1.0 / math.sqrt(d), window_left=-1, window_right=0, bottom_right=True)
    fwd_name = gpu_fwd.forward(q, k, v, out, lse, opts)
    grads = [cp.full(x.shape, cp.nan, dt) for x in (q, k, v)]
    bwd_name = gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts)
    fwd_v = {x.name: x for x in plan_fwd.variants(LIMIT)}.get(fwd_name)
    bwd_v = {x.name: x for x in plan_bwd.variants(LIMIT)}.get(bwd_name)
    assert fwd_v is not None and fwd_v.smem_bytes <= LIMIT, (fwd_name, fwd_v)
    assert bwd_v is not None and bwd_v.smem_bytes <= LIMIT, (bwd_name, bwd_v)
    assert bool(cp.isfinite(out).all()) and all(bool(cp.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grid_under_99kb(dtype, d, opt):
    case = dict(dtype=dtype, b=2, s_q=200, s_k=333, d=d, d_v=d, layout="bshd", backward=True,
                **OPTIONS[opt])
    fails = run_case(case, random.Random())
    assert not fails, f"{case}: " + "; ".join(fails)


@pytest.mark.parametrize("d", [64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_kvcache_decode_under_99kb(rng, d):
    """attention_with_kvcache on the split-KV decode kernel the planner picks under the limit
    (two warps at d 192 / 256: four warps' 2-stage rings need 106 / 140 KB) and the plain
    attention call's split-KV route, against the float64 reference (test_gpu_kvcache's bound)."""
    import cupyflash as cf
    from cupyflash.gpu import plan_decode
    from test_gpu_kvcache import _check, _make
    from tests.kvcache_cases import appended_caches

    v, _ = plan_decode.variant_for("bf16_t", d, 4, LIMIT)
    assert v.smem_bytes <= LIMIT and v.nw == (2 if d > 128 else 4), v.name
    sizes = dict(b=2, s_q=1, h=8, hk=2, d=d, lens=[1500, 33], s_new=1, page=16)
    q, kc, vc, k, v_new, bt, tabs, lens = _make(rng, dtype=BF16, **sizes)
    kc2, vc2 = appended_caches(kc, vc, k, v_new, lens, bt, tabs, False, BF16)
    g = cp.asarray
    out, lse = cf.attention_with_kvcache(g(q), g(kc), g(vc), g(k), g(v_new),
                                         cache_seqlens=g(lens.astype(np.int32)), block_table=g(bt),
                                         return_lse=True, causal=True, num_splits=3)
    _check(cp.asnumpy(out), cp.asnumpy(lse), q, kc2, vc2, lens, 1, bt, tabs, False, BF16,
           "bfloat16", dict(causal=True))
