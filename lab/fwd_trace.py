# Question: How does a Hopper forward work tile's time split into its intervals (SM clock stamps)?
"""Timeline of the Hopper forward's work tiles: runs the ``trace`` probe of
lab/fwd_tile_probe.py (the kernel with SM clock stamps at its tile-boundary events) once
per cell and prints, per cell, the median over blocks and work tiles of each interval, in SM
cycles and in key-tile steps (one step = the consumer's mean cycles per key tile inside a work
tile), so that a work tile's fixed cost splits into its parts:

    python lab/fwd_trace.py --out /tmp/trace --head-dims 128 --seqlens 1024 16384

Consumer intervals (each consumer warpgroup's lane 0): Q wait (q_full), turn wait before the
first S, first S (issue to done), first softmax, the key-tile loop (per key tile), turn wait
plus last P·V, the epilogue (O / l, stores), and the whole tile (stored to stored). Producer:
q_empty wait, the draw (atomicAdd and fwd_work_tile), the Q issue, and how long after the draw the
consumer saw Q land. ``--epilogue``: the parts of the epilogue of a variant that stages O
(probe epitrace; steps in the printout use a nominal 2900 cycles). Needs the GPU.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from cupyflash import _bench  # noqa: E402
from cupyflash.gpu import compile as gpu_compile, fwd as gpu_fwd, fwd_sm90
from cupyflash._options import Options  # noqa: E402

import fwd_tile_probe as probe  # noqa: E402
from ab_fwd_kernels import kernels_tree, using  # noqa: E402


def traced_function(tree: Path, variant):
    """(kernel, cf_trace, cf_clock) of ``variant`` built from the trace tree"""
    with kernels_tree(tree):
        src, opts, names = gpu_compile.program([variant])
    mod = cp.RawModule(code=src, options=opts + ("-DCUPYFLASH_TRACE=1",), name_expressions=names)
    fn = mod.get_function(names[0])
    if variant.smem_bytes > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = variant.smem_bytes
    n = probe.TRACE_BLOCKS * probe.TRACE_ROLES * probe.TRACE_TILES * probe.TRACE_EVENTS
    trace = cp.ndarray((n,), cp.int64, mod.get_global("cf_trace"))
    clock = cp.ndarray((probe.TRACE_BLOCKS * 4,), cp.int64, mod.get_global("cf_clock"))
    return fn, trace, clock


def summarise(tr: np.ndarray, n_key_tiles: int, blocks: int) -> dict:
    """Median intervals (cycles) from cf_trace [blocks, roles, tiles, events] (0 = not written)."""
    out = {}
    cons = tr[:blocks, 1:]                       # [blocks, consumers, tiles, events]
    prod = tr[:blocks, 0]                        # [blocks, tiles, events]
    # tiles 1 .. the last fully written one minus one (skip the start-up and the last tile)
    def med(vals):
        vals = [v for v in vals if v >= 0]
        return statistics.median(vals) if vals else math.nan
    rows = {k: [] for k in ["q wait", "turn wait (first)", "first S", "first softmax", "loop / key tile",
                            "last turn wait + P.V", "epilogue", "tile (stored to stored)",
                            "boundary (tile - n steps)"]}
    pr = {k: [] for k in ["q_empty wait", "q_empty to publish (drawn ahead)", "Q issue", "publish (q_empty) to consumer's Q landed"]}
    for b in range(cons.shape[0]):
        for c in range(cons.shape[1]):
            ev = cons[b, c]
            for i in range(1, probe.TRACE_TILES - 1):
                e, prev, nxt = ev[i], ev[i - 1], ev[i + 1]
                if (e == 0).any() or prev[7] == 0 or nxt[0] == 0:
                    continue
                rows["q wait"].append(e[1] - e[0])
                rows["turn wait (first)"].append(e[2] - e[1])
                rows["first S"].append(e[3] - e[2])
                rows["first softmax"].append(e[4] - e[3])
                step = (e[5] - e[4]) / max(1, n_key_tiles - 1)
                rows["loop / key tile"].append(step)
                rows["last turn wait + P.V"].append(e[6] - e[5])
                rows["epilogue"].append(e[7] - e[6])
                rows["tile (stored to stored)"].append(e[7] - prev[7])
                rows["boundary (tile - n steps)"].append(e[7] - prev[7] - n_key_tiles * step)
                if c == 0 and prod[b, i, 2] and prod[b, i, 1]:
                    pr["q_empty wait"].append(prod[b, i, 1] - prod[b, i, 0])
                    pr["q_empty to publish (drawn ahead)"].append(prod[b, i, 2] - prod[b, i, 1])
                    pr["Q issue"].append(prod[b, i, 3] - prod[b, i, 2])
                    pr["publish (q_empty) to consumer's Q landed"].append(e[1] - prod[b, i, 2])
    for k, v in {**rows, **pr}.items():
        out[k] = med(v) if k != "boundary (tile - n steps)" else (statistics.median(v) if v else math.nan)
    out["_samples"] = len(rows["q wait"])
    return out


def summarise_epilogue(tr: np.ndarray, n_key_tiles: int, blocks: int) -> dict:
    """Median cycles between consecutive epilogue stamps (probe epitrace) over blocks, consumers
    and work tiles 1 .. TRACE_TILES - 2."""
    names = probe.TRACE_EVENTS_EPILOGUE
    parts = {f"{names[k]} -> {names[k + 1]}": [] for k in range(len(names) - 1)}
    cons = tr[:blocks, 1:]
    for b in range(cons.shape[0]):
        for c in range(cons.shape[1]):
            for i in range(1, probe.TRACE_TILES - 1):
                e = cons[b, c, i]
                if (e[:len(names)] == 0).any():
                    continue
                for k, key in enumerate(parts):
                    parts[key].append(e[k + 1] - e[k])
    out = {k: statistics.median(v) if v else math.nan for k, v in parts.items()}
    out["_samples"] = len(next(iter(parts.values())))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the trace tree")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="no")
    ap.add_argument("--epilogue", action="store_true",
                    help="time the parts of the epilogue instead (probe epitrace; variants that stage O)")
    args = ap.parse_args(argv)
    tree = probe.make_trees(args.out, probes=["epitrace" if args.epilogue else "trace"])[1]
    dev_id = cp.cuda.Device().id
    print(f"# {_bench.device_line()}; trace tree {tree}")
    for d in args.head_dims:
        for s in args.seqlens:
            for causal in {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]:
                b, h = _bench.TOKENS // s, _bench.HIDDEN // d
                q, k, v = (cp.random.standard_normal((b, h, s, d), dtype=cp.float32)
                           .astype(ml_dtypes.bfloat16).transpose(0, 2, 1, 3) for _ in range(3))
                out = cp.empty((b, h, s, d), ml_dtypes.bfloat16).transpose(0, 2, 1, 3)
                lse = cp.empty((b, h, s), cp.float32)
                opts = Options(scale=1 / math.sqrt(d), window_right=0 if causal else -1)
                name = gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
                variant = fwd_sm90.variant_by_name(name)
                ref = (out.copy(), lse.copy())
                fn, trace, clock = traced_function(tree, variant)
                ent = using(fn, q, k, v, out, opts)
                for _ in range(3):                    # warm-up
                    gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
                trace.fill(0)
                clock.fill(0)
                out.fill(math.nan)
                gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
                cp.cuda.Device().synchronize()
                same = bool(cp.array_equal(out, ref[0]) and cp.array_equal(lse, ref[1]))
                tr = trace.get().reshape(probe.TRACE_BLOCKS, probe.TRACE_ROLES, probe.TRACE_TILES,
                                         probe.TRACE_EVENTS)
                ck = clock.get().reshape(probe.TRACE_BLOCKS, 2, 2)
                ok = (ck[:, 1, 0] > 0) & (ck[:, 0, 0] > 0)
                ghz = float(np.median((ck[ok, 1, 0] - ck[ok, 0, 0]) / (ck[ok, 1, 1] - ck[ok, 0, 1])))
                kernel_us = float(np.median(ck[ok, 1, 1] - ck[ok, 0, 1])) / 1e3
                n_key = math.ceil(s / variant.bn) if hasattr(variant, "bn") else math.ceil(s / 128)
                blocks = int(ok.sum())
                summ = (summarise_epilogue if args.epilogue else summarise)(tr, n_key, blocks)
                step = summ.get("loop / key tile", 2900.0)   # epilogue mode: a typical step
                print(f"\nhd {d} s {s} causal {causal}: {name}; results identical to the kernel "
                      f"without stamps: {same}; {blocks} blocks, {summ['_samples']} tile samples; "
                      f"SM clock {ghz:.3f} GHz; producer lifetime {kernel_us:.1f} us; key tiles per "
                      f"work tile {n_key}")
                for key, val in summ.items():
                    if key.startswith("_"):
                        continue
                    print(f"  {key:<30} {val:10.0f} cyc  {val / ghz / 1e3:8.3f} us  {val / step:6.2f} steps")
                del q, k, v, out, lse
                cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
