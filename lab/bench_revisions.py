# Question: Are `python -m cupyflash bench`'s ratios to a peer the same on this tree as on an older revision of it (e.g. before a refactor), cell by cell, in one run?
"""Benchmark an older tree and this one alternately, then compare each cell's ratio to a peer.

The older tree is a plain directory (the device copy of the repository has no git history):

    git archive REV | tar -x -C .devout/old      # here; carry .devout/old to the device
    python lab/bench_revisions.py --old .devout/old --rounds 2 -- \\
        --head-dim 64 128 --seqlen 1024 4096 16384 --peers benchmarks.peers \\
        --skip-peers cupy portable memeff flash

Each round runs the bench command (everything after ``--``) in the old tree, then in this one,
each in its own process with its own JSON; the table shows per cell the median over rounds of
cupyflash / peer for each tree and their quotient (new / old), and the worst quotient.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tree: str, bench_args, json_path: str, timeout: float) -> int:
    """``python -m cupyflash bench`` in ``tree`` (its own package and kernels) into ``json_path``."""
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "cupyflash", "bench", *bench_args, "--json", json_path,
           "--png", json_path[:-5] + ".png"]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        print(f"{tree}: rc {p.returncode}\n{p.stderr[-2000:]}", file=sys.stderr)
    return p.returncode


def ratios(paths, peer: str) -> dict:
    """{(head_dim, seqlen, causal, direction): [cupyflash / peer per run]} from bench JSONs."""
    out = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                t = r["tflops"]
                if t.get(peer):
                    key = (r["head_dim"], r["seqlen"], r["causal"], r["direction"])
                    out.setdefault(key, []).append(t["cupyflash"] / t[peer])
    return out


def compare(old: dict, new: dict, peer: str) -> float:
    """Print the per-cell table; return the worst new / old quotient of the medians."""
    print(f" hd  seqlen causal dir | old /{peer:<6} new /{peer:<6} | new / old")
    worst = float("inf")
    for key in sorted(set(old) & set(new)):
        o, n = statistics.median(old[key]), statistics.median(new[key])
        worst = min(worst, n / o)
        print(f"{key[0]:3d} {key[1]:7d} {str(key[2]):6s} {key[3]} | {o:11.3f} {n:11.3f} | {n / o:9.3f}")
    print(f"worst new / old: {worst:.3f}")
    return worst


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the older tree (a directory)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peer", default="cudnn", help="the peer column the ratios use")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per bench run")
    ap.add_argument("--out", default=None, help="where the JSONs go (default: a temporary folder)")
    a = ap.parse_args(own)
    out = a.out or tempfile.mkdtemp(prefix="bench_revisions_")
    os.makedirs(out, exist_ok=True)
    trees = {"old": os.path.abspath(a.old), "new": ROOT}
    paths = {"old": [], "new": []}
    for i in range(1, a.rounds + 1):
        for tag, tree in trees.items():
            path = os.path.join(out, f"{tag}{i}.json")
            if run_bench(tree, bench_args, path, a.timeout) == 0:
                paths[tag].append(path)
            print(f"round {i} {tag}: {'ok' if path in paths[tag] else 'failed'}", flush=True)
    if not paths["old"] or not paths["new"]:
        return 1
    compare(ratios(paths["old"], a.peer), ratios(paths["new"], a.peer), a.peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
