"""Ring attention on the GPU: simulated ranks on one GPU (InProcessTransport, CuPy bfloat16 and
float16), simulated ranks on two GPUs, and two processes over NCCL (launched with
``python -m cupyflash.distributed.run``) when two GPUs are present.

Criterion (docs/semantics.md §9, as tests/test_gpu_backward.py): against the float64 reference on the
whole sequence, max|x - ref| <= 2 * max|x_naive - ref| + floor for out, lse, dq, dk, dv, where
x_naive is the materialized computation in the input dtype on the whole sequence
(gpu_util.naive_attention) and the floor is gpu_util.grad_tolerance's. World size 1 must give
exactly the plain call's result (the ring then makes that one call).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_util import DTYPES, FLOOR, cp, grad_tolerance, keep_mask, naive_attention  # noqa: E402

import cupyflash as cf  # noqa: E402
from cupyflash import reference  # noqa: E402
from cupyflash.distributed import (InProcessTransport, ring_attention,  # noqa: E402
                                   ring_attention_backward, shard, unshard)
from cupyflash.distributed import ring as ring_mod  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class Case:
    """One problem on the host (inputs in ``dtype``), its float64 reference and the naive
    computation's errors on the whole sequence."""

    def __init__(self, seed, dtype_name="bfloat16", b=2, s=256, h=4, h_k=2, d=64, causal=False,
                 window=None):
        rng = np.random.default_rng(seed)
        dt = DTYPES[dtype_name]
        draw = lambda shape: rng.standard_normal(shape, dtype=np.float32).astype(dt)  # noqa: E731
        self.dtype_name, self.dtype = dtype_name, dt
        self.opts = dict(causal=causal, window=window)
        self.q, self.k, self.v = draw((b, s, h, d)), draw((b, s, h_k, d)), draw((b, s, h_k, d))
        self.do = draw((b, s, h, d))
        out, lse = reference.attention(self.q, self.k, self.v, return_lse=True, **self.opts)
        grads = reference.attention_backward(self.do, self.q, self.k, self.v, **self.opts)[:3]
        self.ref = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
        wl, wr = (-1, -1) if window is None else tuple(-1 if x is None else x for x in window)
        keep, _ = keep_mask(s, s, wl, 0 if causal else wr, True)
        n_out, n_lse, n_dq, n_dk, n_dv, _ = naive_attention(
            *(cp.asarray(x) for x in (self.q, self.k, self.v, self.do)), dt, 1.0 / math.sqrt(d),
            keep)
        naive = dict(out=n_out, lse=n_lse, dq=n_dq, dk=n_dk, dv=n_dv)
        self.tol = {}
        for name, r in self.ref.items():
            n = cp.asnumpy(naive[name]).astype(np.float64)
            fin = np.isfinite(r)
            n_err = float(np.abs(n[fin] - r[fin]).max()) if fin.any() else 0.0
            if name == "lse":
                self.tol[name] = 2 * n_err + FLOOR[dtype_name] * max(1.0, float(np.abs(r[fin]).max()))
            else:
                self.tol[name] = grad_tolerance(dtype_name, r, n_err)

    def check(self, name, got, rank=None, world=None, scheme="contiguous"):
        """``got``: the whole array, or rank ``rank``'s shard of it."""
        want = self.ref[name]
        axis = 2 if name == "lse" else 1
        if rank is not None:
            want = shard(want, rank, world, axis=axis, scheme=scheme)
        got = cp.asnumpy(got).astype(np.float64)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{name}: -inf rows differ"
        fin = np.isfinite(want)
        assert np.isfinite(got[fin]).all(), f"{name}: NaN or inf"
        err = float(np.abs(got[fin] - want[fin]).max()) if fin.any() else 0.0
        assert err <= self.tol[name], f"{name}: error {err:.3g} > {self.tol[name]:.3g}"
        return err


def _ring_in_process(case, world, scheme, devices=None, deterministic=False, comm=None):
    devices = devices or [None] * world

    def put(x, r):
        part = shard(x, r, world, scheme=scheme)
        if devices[r] is None:
            return cp.asarray(part)
        with cp.cuda.Device(devices[r]):
            return cp.asarray(part)

    qs, ks, vs, dos = ([put(x, r) for r in range(world)] for x in (case.q, case.k, case.v, case.do))
    t = InProcessTransport(world) if comm is None else comm
    outs, lses = ring_attention(qs, ks, vs, t, return_lse=True, scheme=scheme, **case.opts)
    grads = ring_attention_backward(dos, qs, ks, vs, outs, lses, t, scheme=scheme,
                                    deterministic=deterministic, **case.opts)
    host = lambda xs, axis=1: unshard([cp.asnumpy(x) for x in xs], world, axis=axis,  # noqa: E731
                                      scheme=scheme)
    return dict(out=host(outs), lse=host(lses, 2), dq=host([g[0] for g in grads]),
                dk=host([g[1] for g in grads]), dv=host([g[2] for g in grads]))


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_in_process_one_gpu(rng, world, causal, scheme, dtype_name):
    case = Case(int(rng.integers(2**31)), dtype_name, s=64 * world * 2, causal=causal)
    got = _ring_in_process(case, world, scheme)
    for name in ("out", "lse", "dq", "dk", "dv"):
        case.check(name, got[name])


@pytest.mark.parametrize("window", [(48, 16), (100, None)], ids=["window_48_16", "window_100_left"])
def test_in_process_window(rng, window):
    case = Case(int(rng.integers(2**31)), "bfloat16", s=384, window=window)
    got = _ring_in_process(case, 3, "zigzag")
    for name in ("out", "lse", "dq", "dk", "dv"):
        case.check(name, got[name])


def test_world_one_is_the_plain_call(rng):
    q, k, v = (cp.asarray(rng.standard_normal((1, 1000, 8, 128), dtype=np.float32)).astype(DTYPES["bfloat16"])
               for _ in range(3))
    out, lse = cf.attention(q, k, v, causal=True, return_lse=True)
    (r_out,), (r_lse,) = ring_attention([q], [k], [v], InProcessTransport(1), causal=True,
                                        return_lse=True)
    assert cp.array_equal(out, r_out) and cp.array_equal(lse, r_lse)


def test_fused_merge_matches_array_operations(rng):
    """The one-kernel merge (CuPy ElementwiseKernel) and the plain CuPy array operations give
    the same out (to one bfloat16 rounding) and the same lse."""
    case = Case(int(rng.integers(2**31)), "bfloat16", s=384, causal=True)
    qs, ks, vs = ([cp.asarray(shard(x, r, 3)) for r in range(3)] for x in (case.q, case.k, case.v))
    t = InProcessTransport(3)
    fused = ring_attention(qs, ks, vs, t, causal=True, return_lse=True)
    assert ring_mod._FUSED["enabled"], "the merge kernel failed and was switched off"
    ring_mod._FUSED["enabled"] = False
    try:
        plain = ring_attention(qs, ks, vs, t, causal=True, return_lse=True)
    finally:
        ring_mod._FUSED["enabled"] = True
    for a, b in zip(fused[0], plain[0]):
        a, b = (cp.asnumpy(x).astype(np.float64) for x in (a, b))
        assert (np.abs(a - b) <= 2.0 ** -7 * np.abs(b) + 1e-6).all()
    for a, b in zip(fused[1], plain[1]):
        cp.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _gpu_count():
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


two_gpus = pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs")


@two_gpus
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_in_process_two_gpus(rng, causal):
    case = Case(int(rng.integers(2**31)), "bfloat16", s=512, causal=causal)
    got = _ring_in_process(case, 2, "zigzag", devices=[0, 1])
    for name in ("out", "lse", "dq", "dk", "dv"):
        case.check(name, got[name])


WORKER = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {tests_gpu!r}]
    import cupy as cp
    import test_ring_gpu as T
    from cupyflash.distributed import (init_process_group, ring_attention,
                                       ring_attention_backward, shard)

    seed, causal, scheme = int(sys.argv[1]), sys.argv[2] == "causal", sys.argv[3]
    comm, rank, world = init_process_group()
    case = T.Case(seed, "bfloat16", s=1024, causal=causal)
    mine = lambda x: cp.asarray(shard(x, rank, world, scheme=scheme))
    q, k, v, do = (mine(x) for x in (case.q, case.k, case.v, case.do))
    for _ in range(2):  # the second run reuses the transport's stream and pool blocks
        out, lse = ring_attention(q, k, v, comm, causal=causal, scheme=scheme, return_lse=True)
        dq, dk, dv = ring_attention_backward(do, q, k, v, out, lse, comm, causal=causal,
                                             scheme=scheme)
    cp.cuda.Device().synchronize()
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        err = case.check(name, x, rank, world, scheme)
        print(f"rank {{rank}} {{name}} err {{err:.3g}} tol {{case.tol[name]:.3g}}", flush=True)
""")


def _nccl_usable():
    try:
        from cupy.cuda import nccl
        return bool(getattr(nccl, "available", True)) and hasattr(nccl, "NcclCommunicator")
    except Exception:  # noqa: BLE001
        return False


@two_gpus
@pytest.mark.skipif(not _nccl_usable(), reason="needs NCCL (pip install nvidia-nccl-cu12)")
@pytest.mark.parametrize("scheme,causal", [("contiguous", "full"), ("zigzag", "causal"),
                                           ("contiguous", "causal")])
def test_nccl_two_processes(rng, tmp_path, scheme, causal):
    worker = tmp_path / "ring_worker.py"
    worker.write_text(WORKER.format(tests=str(ROOT / "tests"), tests_gpu=str(ROOT / "tests" / "gpu")))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "cupyflash.distributed.run", "--nproc", "2",
                           str(worker), str(int(rng.integers(2**31))), causal, scheme],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count(" err ") == 10, done.stdout


@two_gpus
@pytest.mark.skipif(not _nccl_usable(), reason="needs NCCL (pip install nvidia-nccl-cu12)")
def test_nccl_one_process_two_gpus(rng):
    """A list of communicators from NcclCommunicator.initAll: one process drives both GPUs."""
    from cupy.cuda import nccl

    comms = nccl.NcclCommunicator.initAll([0, 1])
    case = Case(int(rng.integers(2**31)), "bfloat16", s=512, causal=True)
    got = _ring_in_process(case, 2, "zigzag", devices=[0, 1], comm=comms)
    for name in ("out", "lse", "dq", "dk", "dv"):
        case.check(name, got[name])
