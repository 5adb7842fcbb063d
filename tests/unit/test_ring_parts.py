"""The pieces of cupyflash.distributed that need no attention call: sharding, the per-pair call
planner (against dense masks), the in-process transport, the NCCL helpers (with a stand-in
binding), the launcher, and importing without CuPy."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from cupyflash.distributed import InProcessTransport, Shift, shard, shard_lengths, unshard
from cupyflash.distributed import blocks, nccl as dnccl, run as drun
from cupyflash.distributed.sharding import segments

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- sharding

@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_unshard_round_trip(rng, world, scheme):
    n = 4 * world if scheme == "zigzag" else 4 * world + world // 2
    x = rng.standard_normal((2, n, 3))
    parts = [shard(x, r, world, scheme=scheme) for r in range(world)]
    assert [p.shape[1] for p in parts] == shard_lengths(n, world, scheme)
    assert np.array_equal(unshard(parts, world, scheme=scheme), x)
    y = rng.standard_normal((3, 2, n))  # lse-like: sequence on the last axis
    assert np.array_equal(unshard([shard(y, r, world, axis=-1, scheme=scheme)
                                   for r in range(world)], axis=-1, scheme=scheme), y)


def test_zigzag_chunks_and_lengths():
    x = np.arange(12)[None]
    assert shard(x, 0, 3, scheme="zigzag").tolist() == [[0, 1, 10, 11]]
    assert shard(x, 1, 3, scheme="zigzag").tolist() == [[2, 3, 8, 9]]
    assert shard(x, 2, 3, scheme="zigzag").tolist() == [[4, 5, 6, 7]]
    assert shard_lengths(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="multiple of 2 \\* world"):
        shard_lengths(10, 4, "zigzag")
    with pytest.raises(ValueError, match="rank"):
        shard(x, 3, 3)


# ---------------------------------------------------------------------------------- planner

def _dense_global(s_q, s_k, lo, hi):
    i = np.arange(s_q)[:, None] + (s_k - s_q)
    d = np.arange(s_k)[None, :] - i
    return (d >= lo) & (d <= hi)


def _box_mask(lq, lk, causal, window):
    """The mask cupyflash.attention applies to an lq x lk call (bottom-right aligned)."""
    lo, hi = blocks.band(causal, window)
    i = np.arange(lq)[:, None] + (lk - lq)
    d = np.arange(lk)[None, :] - i
    return (d >= lo) & (d <= hi)


def _check_plan(lens_q, lens_k, scheme, lo, hi):
    world = len(lens_q)
    s_q, s_k = sum(lens_q), sum(lens_k)
    want = _dense_global(s_q, s_k, lo, hi)
    qsegs = segments(lens_q, scheme, s_k - s_q)
    ksegs = segments(lens_k, scheme)
    pos = lambda segs: [np.concatenate([np.arange(p, p + n) for p, _, n in sg] or [np.zeros(0, int)])
                        for sg in segs]  # noqa: E731
    qpos = [p - (s_k - s_q) for p in pos(qsegs)]
    kpos = pos(ksegs)
    work = []
    for r in range(world):
        plan = blocks.plan_rank(r, qsegs, ksegs, lo, hi)
        cells = 0
        for t, step in enumerate(plan):
            s = (r - t) % world
            got = np.zeros((lens_q[r], lens_k[s]), int)
            for b in step:
                got[b.q0:b.q1, b.k0:b.k1] += _box_mask(b.q1 - b.q0, b.k1 - b.k0,
                                                       **b.attention_options())
                cells += (b.q1 - b.q0) * (b.k1 - b.k0)
            assert got.max(initial=0) <= 1, "two calls cover one entry"
            assert np.array_equal(got.astype(bool), want[np.ix_(qpos[r], kpos[s])]), (r, t, step)
        work.append(cells)
    return work


@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
def test_plan_reproduces_the_global_mask(rng, scheme):
    """Every (rank, step) call set covers exactly the kept entries of the global mask, each once,
    for random lengths, worlds and windows."""
    for _ in range(150):
        world = int(rng.integers(1, 7))
        if scheme == "zigzag":
            lens_q = [2 * int(rng.integers(0, 5))] * world
            lens_k = [2 * int(rng.integers(0, 5))] * world
        else:
            lens_q = [int(n) for n in rng.integers(0, 7, world)]
            lens_k = list(lens_q) if rng.random() < 0.5 else [int(n) for n in rng.integers(0, 7, world)]
        causal = bool(rng.random() < 0.5)
        window = None
        if rng.random() < 0.7:
            window = tuple(int(x) if x >= 0 else -1 for x in rng.integers(-1, 9, 2))
        _check_plan(lens_q, lens_k, scheme, *blocks.band(causal, window))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_causal_balances_work_in_one_call_per_step(world):
    c = 16
    qsegs = segments([2 * c] * world, "zigzag")
    work = _check_plan([2 * c] * world, [2 * c] * world, "zigzag", *blocks.band(True, None))
    for r in range(world):
        plan = blocks.plan_rank(r, qsegs, qsegs, *blocks.band(True, None))
        assert [len(step) for step in plan] == [1] * world
        assert plan[0][0].attention_options() == {"causal": True, "window": None}
    # the same area every rank (a causal 2c x 2c, then 2c x c boxes), unlike contiguous
    assert len(set(work)) == 1
    contiguous = _check_plan([2 * c] * world, [2 * c] * world, "contiguous",
                             *blocks.band(True, None))
    assert contiguous[0] < contiguous[-1]


def test_plan_is_one_plain_call_without_mask():
    segs = segments([8, 8], "zigzag")
    for r in range(2):
        for step in blocks.plan_rank(r, segs, segs, *blocks.band(False, None)):
            assert [(b.q0, b.q1, b.k0, b.k1) for b in step] == [(0, 8, 0, 8)]
            assert step[0].attention_options() == {"causal": False, "window": None}


# ---------------------------------------------------------------------------------- transport

def test_in_process_shift_rotates_to_the_next_rank():
    t = InProcessTransport(4)
    got = t.shift([(np.full(2, r),) for r in range(4)])
    assert [int(g[0][0]) for g in got] == [3, 0, 1, 2]


def test_lockstep_checks_what_arrives():
    def gen(n):
        yield Shift([np.zeros(n)], [((3,), np.float64)])
        return n

    t = InProcessTransport(2)
    assert t.run([gen(3), gen(3)]) == [3, 3]
    with pytest.raises(ValueError, match="seqlens_q / seqlens_k"):
        t.run([gen(3), gen(4)])

    def short():
        return 0
        yield  # noqa: unreachable: a generator that never exchanges

    with pytest.raises(RuntimeError, match="disagree"):
        t.run([gen(3), short()])


class _FakeNccl:
    NCCL_UINT8, NCCL_FLOAT32, NCCL_BFLOAT16 = 10, 11, 12

    def __init__(self, takes_tuple=False):
        self.takes_tuple = takes_tuple
        self.made = None

    def NcclCommunicator(self, world, uid, rank):  # noqa: N802  (CuPy's name)
        if self.takes_tuple != isinstance(uid, tuple):
            raise TypeError("wrong id type")
        self.made = (world, uid, rank)
        return self.made


def test_nccl_type_sends_bfloat16_as_bfloat16_or_bytes():
    import ml_dtypes

    fake = _FakeNccl()
    assert dnccl.nccl_type(ml_dtypes.bfloat16, 64, fake) == (fake.NCCL_BFLOAT16, 32)
    assert dnccl.nccl_type(np.float32, 64, fake) == (fake.NCCL_FLOAT32, 16)
    assert dnccl.nccl_type(np.float16, 64, fake) == (fake.NCCL_UINT8, 64)  # no FLOAT16 in fake
    del _FakeNccl.NCCL_BFLOAT16
    try:
        assert dnccl.nccl_type(ml_dtypes.bfloat16, 64, fake) == (fake.NCCL_UINT8, 64)
    finally:
        _FakeNccl.NCCL_BFLOAT16 = 12


@pytest.mark.parametrize("takes_tuple", [False, True], ids=["bytes_id", "tuple_id"])
def test_unique_id_hex_reaches_the_communicator(takes_tuple):
    raw = bytes(range(120, 248))
    fake = _FakeNccl(takes_tuple)
    dnccl._communicator(fake, 2, raw.hex(), 1)
    world, uid, rank = fake.made
    assert (world, rank) == (2, 1)
    assert (bytes(b & 0xFF for b in uid) if takes_tuple else uid) == raw


def test_init_process_group_says_what_is_missing(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", dnccl.ID_ENV, dnccl.ID_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set"):
        dnccl.init_process_group()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match=dnccl.ID_ENV):
        dnccl.init_process_group()


def test_id_file_is_read_when_it_appears(tmp_path):
    path = tmp_path / "id"
    drun._write_id_file(str(path), "00ff")
    assert dnccl.read_id_file(str(path), timeout=1) == "00ff"
    with pytest.raises(TimeoutError):
        dnccl.read_id_file(str(tmp_path / "none"), timeout=0.2)


# ---------------------------------------------------------------------------------- launcher

def test_launcher_parses_its_options_then_the_script_verbatim():
    o = drun.parse(["--nproc", "2", "--id", "ab", "s.py", "--nproc", "3"])
    assert (o.nproc, o.id, o.script, o.args) == (2, "ab", "s.py", ["--nproc", "3"])
    o = drun.parse(["--nproc=4", "-m", "pkg.mod", "--x", "1"])
    assert (o.nproc, o.module, o.args) == (4, "pkg.mod", ["--x", "1"])
    cmds = drun.commands(drun.parse(["--nproc", "2", "--nnodes", "2", "--node-rank", "1",
                                     "--id", "0a0b", "s.py", "a"]))
    assert [c[0][1:] for c in cmds] == [["s.py", "a"], ["s.py", "a"]]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for _, e in cmds] == [
        ("2", "0", "4"), ("3", "1", "4")]
    assert all(e[dnccl.ID_ENV] == "0a0b" for _, e in cmds)
    with pytest.raises(SystemExit):
        drun.commands(drun.parse(["--nproc", "2", "--nnodes", "2", "s.py"]))  # no id file


def test_launcher_starts_every_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        out = sys.argv[1]
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CUPYFLASH_NCCL_ID")
        with open(os.path.join(out, os.environ["RANK"]), "w") as f:
            f.write(" ".join(os.environ[k] for k in keys))
    """))
    assert drun.main(["--nproc", "3", "--id", "c0ffee", str(script), str(tmp_path)]) == 0
    assert sorted((tmp_path / str(r)).read_text() for r in range(3)) == [
        f"{r} 3 {r} c0ffee" for r in range(3)]


def test_launcher_stops_the_others_when_a_rank_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)\n")
    t0 = time.monotonic()
    opts = drun.parse(["--nproc", "2", "--id", "00", str(script)])
    assert drun.launch(opts, grace=5) == 3
    assert time.monotonic() - t0 < 30


def test_package_imports_and_simulates_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None; import numpy as np; "
            "from cupyflash.distributed import ring_attention, InProcessTransport; "
            "x = [np.random.default_rng(0).standard_normal((1, 4, 2, 8)) for _ in range(2)]; "
            "o = ring_attention(x, x, x, InProcessTransport(2), causal=True); "
            "assert len(o) == 2 and 'cupy' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert done.returncode == 0, done.stderr
