"""``python -m cupyflash``: every option validated (usage error, exit 2), help on every option,
--version, --device gpu without a GPU an error, bench and demo on the CPU."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cupyflash
from cupyflash import __main__ as cli
from cupyflash import _interop

ROOT = Path(__file__).resolve().parents[2]


def _run(argv):
    """main(argv) -> exit code (argparse's SystemExit turned into its code)."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def _subparsers(parser):
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_version(capsys):
    assert _run(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"cupyflash {cupyflash.__version__}")


def test_every_option_of_every_command_has_help():
    parser, _ = cli.build_parser()
    missing = [f"{name} {'/'.join(a.option_strings)}"
               for name, sub in _subparsers(parser).items() for a in sub._actions
               if a.option_strings and not a.help]
    assert missing == []


@pytest.mark.parametrize("argv, option", [
    (["demo", "--batch", "0"], "--batch"),
    (["demo", "--seqlen", "-5"], "--seqlen"),
    (["demo", "--seqlen", "lots"], "--seqlen"),
    (["demo", "--heads", "0"], "--heads"),
    (["demo", "--head-dim", "300"], "--head-dim"),
    (["demo", "--head-dim", "0"], "--head-dim"),
    (["demo", "--dtype", "fp64"], "--dtype"),
    (["demo", "--device", "tpu"], "--device"),
    (["precompile", "--workers", "0"], "--workers"),
    (["precompile", "--head-dims", "64,x"], "--head-dims"),
    (["precompile", "--head-dims", "64,512"], "--head-dims"),
    (["bench", "--seqlen", "0"], "--seqlen"),
    (["bench", "--head-dim", "257"], "--head-dim"),
    (["bench", "--rep", "0"], "--rep"),
    (["bench", "--causal", "maybe"], "--causal"),
    (["bench", "--direction", "sideways"], "--direction"),
    (["bench", "--batch", "-1"], "--batch"),
    (["bench", "--heads", "two"], "--heads"),
    (["bench", "--kv-heads", "0"], "--kv-heads"),
    (["bench", "--device", "cpu", "--heads", "4", "--kv-heads", "3"], "--kv-heads"),
    (["bench", "--device", "tpu"], "--device"),
    (["bench", "--smem-limit", "0"], "--smem-limit"),
    (["bench", "--device", "cpu", "--smem-limit", "101376"], "--smem-limit"),
    ([], "required"),
    (["frobnicate"], "invalid choice"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_option_is_a_usage_error(capsys, argv, option):
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and option in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_device_gpu_without_a_gpu_is_an_error(capsys, monkeypatch, command):
    monkeypatch.setattr(_interop, "gpu_available", lambda: False)
    assert _run([command, "--device", "gpu"]) == 2
    assert "no usable CUDA GPU" in capsys.readouterr().err


def test_demo_on_the_cpu(capsys):
    code = _run(["demo", "--device", "cpu", "--batch", "2", "--seqlen", "96", "--heads", "3",
                 "--head-dim", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "attention on the CPU: q, k, v (2, 96, 3, 16) float32" in out
    assert "check       ok" in out


def test_demo_tiny_sizes_are_checked_too(capsys):
    assert _run(["demo", "--device", "cpu", "--seqlen", "5", "--heads", "1", "--head-dim", "4"]) == 0
    assert "check       ok" in capsys.readouterr().out


def test_bench_on_the_cpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(_interop, "gpu_available", lambda: False)   # auto: the CPU bench
    path = tmp_path / "bench.json"
    code = _run(["bench", "--seqlen", "128", "--head-dim", "16", "--heads", "2", "--rep", "1",
                 "--direction", "fwd", "bwd", "--causal", "false", "true", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cupyflash ms" in out and "textbook ms" in out
    rows = json.loads(path.read_text())["rows"]
    assert {(r["direction"], r["causal"]) for r in rows} == {
        ("fwd", False), ("fwd", True), ("bwd", False), ("bwd", True)}
    for r in rows:
        assert r["cupyflash_ms"] > 0 and r["textbook_ms"] > 0
        assert r["cupyflash_peak_mib"] > 0 and r["textbook_peak_mib"] > 0


def test_bench_on_the_cpu_with_gqa(capsys, tmp_path):
    path = tmp_path / "bench.json"
    code = _run(["bench", "--device", "cpu", "--seqlen", "64", "--head-dim", "8", "--heads", "4",
                 "--kv-heads", "2", "--rep", "1", "--direction", "fwd", "bwd", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(1, 64, 4/2, 8)" in out
    rows = json.loads(path.read_text())["rows"]
    assert {(r["heads"], r["kv_heads"]) for r in rows} == {(4, 2)}


def test_gpu_bench_heads_rule():
    from cupyflash import _bench
    assert _bench.heads_for(128) == (16, 16) and _bench.heads_for(64, 32, 8) == (32, 8)
    assert _bench.heads_for(256, kv_heads=1) == (8, 1)
    with pytest.raises(ValueError, match="--kv-heads 3"):
        _bench.heads_for(128, 16, 3)


def test_textbook_peer_matches_the_reference(rng):
    import numpy as np

    from cupyflash import _cpubench, reference

    q, k, v, dout = (rng.standard_normal((1, 7, 4, 8)) for _ in range(4))
    k, v = k[:, :, :2], v[:, :, :2]   # GQA: two query heads per key / value head
    for causal in (False, True):
        out = _cpubench.textbook_forward(q, k, v, causal)
        np.testing.assert_allclose(out, reference.attention(q, k, v, causal=causal), atol=1e-12)
        grads = _cpubench.textbook_backward(dout, q, k, v, causal)
        want = cupyflash.attention_backward(dout, q, k, v, *cupyflash.attention(
            q, k, v, causal=causal, return_lse=True, device="cpu"), causal=causal, device="cpu")
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g, w, atol=1e-10)


def test_module_entry_point_runs_as_a_process():
    done = subprocess.run([sys.executable, "-m", "cupyflash", "demo", "--batch", "0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2 and "--batch" in done.stderr


def test_bench_on_a_gpu_gets_the_gpu_sweep_defaults(monkeypatch):
    from cupyflash import _bench

    seen = {}
    monkeypatch.setattr(_interop, "gpu_available", lambda: True)
    monkeypatch.setattr(_bench, "main", lambda args: seen.update(vars(args)) or 0)
    assert _run(["bench"]) == 0
    defaults = {a.dest: a.default for a in _bench_parser_actions()}
    for name in ("dtype", "head_dim", "seqlen", "causal", "direction", "rep"):
        assert seen[name] == defaults[name], name
    assert _run(["bench", "--seqlen", "1024", "--rep", "2"]) == 0
    assert seen["seqlen"] == [1024] and seen["rep"] == 2


def test_bench_smem_limit_plans_the_sweep_under_the_limit(monkeypatch, tmp_path):
    """--smem-limit: the sweep runs inside limit_shared_memory(limit), which ends with it."""
    pytest.importorskip("cupy")
    from cupyflash import _bench
    from cupyflash.gpu import device

    seen = []
    monkeypatch.setattr(_interop, "gpu_available", lambda: True)
    monkeypatch.setattr(_bench, "device_line", lambda: "test device")
    monkeypatch.setattr(_bench, "plot", lambda rows, path: None)
    monkeypatch.setattr(_bench, "sweep", lambda *a, **kw: seen.append(device._smem_cap[0]) or [])
    before = device._smem_cap[0]
    for argv, cap in (([], before), (["--smem-limit", "101376"], 101376)):
        assert _run(["bench", "--json", str(tmp_path / "b.json"), *argv]) == 0
        assert seen.pop() == cap and device._smem_cap[0] == before


def _bench_parser_actions():
    from cupyflash import _bench

    p = argparse.ArgumentParser()
    _bench.add_arguments(p)
    return p._actions
