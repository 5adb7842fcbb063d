# Question: Where do the warps of one kernel wait, per SASS instruction (a summary of Nsight Compute's source page)?
"""Where the warps of one kernel wait, per SASS instruction: a summary of Nsight Compute's source
page (``ncu -i REP --page source --csv --print-source sass > page.csv``, from a report collected
with ``--set full --import-source yes``; gzip'd CSVs are read too).

    python lab/ncu_sass_stalls.py page.csv                # stall reasons, top 30 instructions
    python lab/ncu_sass_stalls.py page.csv --range a4200 a5000   # every instruction there
    python lab/ncu_sass_stalls.py page.csv --by-count     # samples per execution count

--by-count groups instructions by how often they ran (the page's "Instructions Executed", per
warp): in a persistent kernel that separates the key-tile loop (k iterations per work tile)
from the once-per-tile code (the tile boundary) and the producer, without reading addresses.

Samples are per warp: the producer's and the consumers' warps alike. On the H200 this found the
forward's hoisted P·V wait and its descriptor arithmetic (docs/hopper.md, "Forward design").
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_page(path):
    """(kernel name, [row dicts]) of an ncu source-page CSV: one row per SASS instruction."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    kernel = rows[0][1] if rows and len(rows[0]) > 1 else "?"
    header = rows[1]
    return kernel, [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def stall_columns(row):
    return [k for k in row if k.startswith("stall_") and "Not Issued" not in k]


def _n(x):
    try:
        return int(x)
    except (TypeError, ValueError):
        return 0


def summary(rows, top=30):
    """Lines: total samples, each stall reason's share, then the ``top`` instructions by samples
    (address, samples, share, SASS, their three largest reasons)."""
    total = sum(_n(r[SAMPLES]) for r in rows) or 1
    reasons = collections.Counter()
    for r in rows:
        for k in stall_columns(r):
            reasons[k] += _n(r[k])
    out = [f"total samples {total}"]
    out += [f"  {k[6:]:24s} {v:8d} {100 * v / total:5.1f} %" for k, v in reasons.most_common(12)]
    for r in sorted(rows, key=lambda r: -_n(r[SAMPLES]))[:top]:
        why = sorted(((_n(r[k]), k[6:]) for k in stall_columns(r)), reverse=True)[:3]
        why = " ".join(f"{k}:{v}" for v, k in why if v)
        out.append(f"{r['Address'][-5:]} {_n(r[SAMPLES]):6d} {100 * _n(r[SAMPLES]) / total:5.1f} % "
                   f"{r['Source'].strip()[:60]:60s} {why}")
    return out


def by_count(rows, top=12):
    """Lines: per distinct execution count (most samples first), the instructions with that count,
    their samples and share, and their three largest stall reasons."""
    total = sum(_n(r[SAMPLES]) for r in rows) or 1
    groups = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for r in rows:
        g = groups[_n(r.get("Instructions Executed"))]
        g[0] += 1
        g[1] += _n(r[SAMPLES])
        for k in stall_columns(r):
            g[2][k[6:]] += _n(r[k])
    out = [f"total samples {total}"]
    for count, (n, samples, why) in sorted(groups.items(), key=lambda x: -x[1][1])[:top]:
        reasons = " ".join(f"{k}:{v}" for k, v in why.most_common(3) if v)
        out.append(f"executed {count:9d}  instructions {n:5d}  samples {samples:7d} {100 * samples / total:5.1f} %  {reasons}")
    return out


def span(rows, lo, hi):
    """Every instruction whose address (its last five hex digits) lies in [lo, hi]."""
    out = []
    for r in rows:
        a = int(r["Address"], 16) & 0xFFFFF
        if lo <= a <= hi:
            out.append(f"{a:05x} {_n(r[SAMPLES]):6d} {r['Source'].strip()[:70]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--range", nargs=2, metavar=("LO", "HI"), help="hex addresses (last 5 digits)")
    ap.add_argument("--by-count", action="store_true", help="samples per execution count")
    a = ap.parse_args(argv)
    kernel, rows = read_page(a.csv)
    print(kernel)
    if a.range:
        lines = span(rows, int(a.range[0], 16), int(a.range[1], 16))
    else:
        lines = by_count(rows, a.top) if a.by_count else summary(rows, a.top)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
