# Question: What does each part of a Hopper forward work tile's fixed cost cost? (kernel trees with one part removed, timing only)
"""Probe of the Hopper forward's fixed cost per work tile (docs/hopper.md, "Where it stands":
the non-causal cells fit peak · n / (n + x) with x ≈ 2 key-tile steps for us, ≈ 1 for cuDNN).

Writes kernels_cu trees that each take one part of a work tile's fixed cost away, for timing
only (their results are wrong on purpose), then (with --run) times them against an unchanged
copy with lab/ab_fwd_kernels.py in one process, cuDNN in the rotation:

    python lab/fwd_tile_probe.py --out /tmp/probe            # the trees, and the command
    python lab/fwd_tile_probe.py --out /tmp/probe --run -- --seqlens 512 1024 16384

Probes (each a textual patch of hopper/fwd.cu; a patch whose anchor is gone stops the script):
- ``nostore``: the epilogue (O / l, its stores, lse) never executes (a return on a condition
  that is true at run time): what the epilogue costs.
- ``static``: the producer takes work tiles i, i + grid, ... instead of drawing each from the
  global counter (an atomicAdd, an L2 round trip, between releasing one Q and loading the next):
  what drawing costs on the tile boundary (the same tiles, the same results, another order).
- ``qonce``: the producer loads Q for a block's first work tile only (later tiles reuse it):
  what waiting for the next Q costs.
- ``pad``: the same kernel, bit for bit, plus code that never runs: the empty turns that
  the idle-consumer candidate added to fetch_tile, behind a condition that is false at
  run time. That candidate ran 2–10 % slower even where it never took them (docs/hopper.md,
  "Tuning notes"); this says whether the code's presence alone does that (layout, instruction fetch,
  register allocation) before any such A/B difference is read as the candidate's effect.
- ``halfkv``: every K and V tile loads only its first 64-column panel (half the bytes the ring
  reads from L2 at hd >= 128; hd 64 is unchanged): whether the K / V traffic from L2 limits the
  key-tile loop, i.e. whether sharing each tile between two SMs (TMA multicast in a cluster of
  two) could pay. ``halfk`` / ``halfv``: the same for K tiles or V tiles alone.
- ``nosoftmax`` / ``noexp``: the key-tile loop without its softmax (P = S as it is, alpha = 1),
  and the softmax without its exp2s: how much of the step the softmax, and its exp2 unit, cost.
- ``trace``: the same kernel, bit for bit, with SM clock stamps at the tile-boundary events of
  the first TRACE_TILES work tiles of every block (``cf_trace``); lab/fwd_trace.py reads
  and summarises them. Not in the timed set by default (``--probes`` picks).
- ``epitrace``: the same with stamps inside the epilogue of a variant that stages O
  (``fwd_trace.py --epilogue``).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: probe name -> [(anchor, replacement)] in the Hopper forward's sources (FILES below)
PROBES = {
    "nostore": [(
        "    auto store_tile = [&]() {\n",
        "    auto store_tile = [&]() {\n        if (p.b > 0) return;   // probe: always at run time\n",
    )],
    "static": [(
        "w = sched_draw(p.sched, drawn);",
        "w = sched_draw(nullptr, drawn);   // probe: static order",
    )],
    "qonce": [(
        "            mbar_arrive_expect_tx(q_full, BM * D * 2);\n",
        "            if (tile_i > 0) { mbar_arrive(q_full); } else {   // probe: Q loaded once\n"
        "            mbar_arrive_expect_tx(q_full, BM * D * 2);\n",
    ), (
        "wt.q_row + wt.m0, wt.head, wt.tma_b);\n",
        "wt.q_row + wt.m0, wt.head, wt.tma_b);\n            }\n",
    )],
    "pad": [(
        "            if (sees_keys(wt)) return true;\n",
        "            if (sees_keys(wt) && p.b >= 0) return true;   // probe: p.b >= 0 always\n"
        "            if (wt.n_tiles > 0) {                // probe: never runs (session 11's empty turns)\n"
        "                for (int it = 0; it <= wt.n_tiles; ++it) {\n"
        "                    named_bar_sync(TURN_BAR + cw, 256);\n"
        "                    named_bar_arrive(next_turn, 256);\n"
        "                    if (t == 0) {\n"
        "                        if (it < wt.n_tiles) mbar_arrive(k_empty + 8 * ((kv_it + it) % STAGES));\n"
        "                        if (it > 0) mbar_arrive(v_empty + 8 * ((kv_it + it - 1) % STAGES));\n"
        "                        if (it + 1 == wt.n_tiles) mbar_arrive(q_empty);\n"
        "                    }\n"
        "                }\n"
        "                kv_it += wt.n_tiles;\n"
        "                continue;\n"
        "            }\n",
    )],
}


def _half_panels(which: str):
    """The ``half*`` probes: K and / or V tiles (``which``: a C++ condition on the load's
    tensor map ``desc``) load only the first half of their 64-column panels (a part of the
    tile left without panels expects no bytes: its barrier completes on the arrival)."""
    return [(
        "            const int c0 = h * L::PANELS / parts, c1 = (h + 1) * L::PANELS / parts;   // its panels\n",
        f"            const bool half = L::PANELS > 1 && ({which});   // probe\n"
        "            const int c_end = half ? L::PANELS / 2 : L::PANELS;   // probe: half the panels\n"
        "            const int c0 = min(h * L::PANELS / parts, c_end), c1 = min((h + 1) * L::PANELS / parts, c_end);\n",
    )]


#: ``nosoftmax``: the key-tile loop's softmax (masks, max, exp2, sum) is skipped, alpha = 1 and P
#: is S packed as it is (a work tile's first key tile keeps its softmax): the products, loads,
#: turns and O rescale alone, what the loop's structure allows with a softmax that cost nothing.
#: ``noexp``: the softmax without its exp2s (P = s·scale·log2e − shift on the FMA pipe): what the
#: exp2 unit costs. Both are compile-time changes (no branch in the loop).
PROBES["nosoftmax"] = [(
    "            online_softmax<NS, BN, WINDOW, false>(s_acc, m_run, l_run, alpha, p, wt, n0, row0, col_in_8, sl2);\n",
    "            { alpha[0] = alpha[1] = 1.f; }   // probe: no softmax in the key-tile loop\n",
)]
PROBES["noexp"] = [(
    "        s_acc[i] = fast_exp2(s_acc[i] * sl2 - shift[0]);\n"
    "        s_acc[i + 1] = fast_exp2(s_acc[i + 1] * sl2 - shift[0]);\n"
    "        s_acc[i + 2] = fast_exp2(s_acc[i + 2] * sl2 - shift[1]);\n"
    "        s_acc[i + 3] = fast_exp2(s_acc[i + 3] * sl2 - shift[1]);\n",
    "        s_acc[i] = s_acc[i] * sl2 - shift[0];   // probe: no exp2\n"
    "        s_acc[i + 1] = s_acc[i + 1] * sl2 - shift[0];\n"
    "        s_acc[i + 2] = s_acc[i + 2] * sl2 - shift[1];\n"
    "        s_acc[i + 3] = s_acc[i + 3] * sl2 - shift[1];\n",
)]
PROBES["halfkv"] = _half_panels("true")
PROBES["halfk"] = _half_panels("desc == &p.tma_k")
PROBES["halfv"] = _half_panels("desc == &p.tma_v")

#: SM clock stamps (``trace``): cf_trace [block < TRACE_BLOCKS][role 0 producer, 1 + consumer]
#: [work tile < TRACE_TILES][event < TRACE_EVENTS], written by lane 0 of each role's warpgroup;
#: cf_clock [block][start, end][clock64, globaltimer ns] (producer) calibrates cycles to time.
TRACE_BLOCKS, TRACE_ROLES, TRACE_TILES, TRACE_EVENTS = 132, 4, 32, 8
#: event names per role (index = event number)
TRACE_EVENTS_PRODUCER = ["q_empty wait", "q_empty done", "tile published (drawn ahead)", "Q issued", "K/V issued"]
TRACE_EVENTS_CONSUMER = ["q_full wait", "q_full done", "first turn", "first S done",
                         "first softmax done", "last turn", "last PV done", "stored"]


def _stamp(role: str, ev: int, tile: str = "tile_i") -> str:
    return f"CF_TRACE({role}, {tile}, {ev});"


_TRACE_DEFS = f"""
// probe: SM clock stamps of tile-boundary events (lab/fwd_trace.py reads them)
extern "C" __device__ long long cf_trace[{TRACE_BLOCKS * TRACE_ROLES * TRACE_TILES * TRACE_EVENTS}];
extern "C" __device__ long long cf_clock[{TRACE_BLOCKS * 4}];
__device__ __forceinline__ long long cf_clock64() {{
    long long c; asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory"); return c;
}}
__device__ __forceinline__ long long cf_globaltimer() {{
    long long c; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c) :: "memory"); return c;
}}
#define CF_TRACE(role, tile, ev) do {{ if (threadIdx.x % 128 == 0 && blockIdx.x < {TRACE_BLOCKS} && (tile) < {TRACE_TILES}) \
    cf_trace[((blockIdx.x * {TRACE_ROLES} + (role)) * {TRACE_TILES} + (tile)) * {TRACE_EVENTS} + (ev)] = cf_clock64(); }} while (0)
#define CF_CLOCK(i) do {{ if (blockIdx.x < {TRACE_BLOCKS}) {{ cf_clock[blockIdx.x * 4 + 2 * (i)] = cf_clock64(); \
    cf_clock[blockIdx.x * 4 + 2 * (i) + 1] = cf_globaltimer(); }} }} while (0)
"""

PROBES["trace"] = [
    # the stamp definitions, in the layout header both roles include
    ("constexpr int WG_ROWS = 64;", _TRACE_DEFS + "constexpr int WG_ROWS = 64;"),
    # producer
    ("    tma_prefetch_desc(&p.tma_q);\n", "    CF_CLOCK(0);\n    tma_prefetch_desc(&p.tma_q);\n"),
    ("    if (p.sched) sched_finish(p.sched);", "    CF_CLOCK(1);\n    if (p.sched) sched_finish(p.sched);"),
    ("        if (tile_i > 0) mbar_wait(q_empty, (tile_i - 1) & 1);\n",
     f"        {_stamp(0, 0)}\n        if (tile_i > 0) mbar_wait(q_empty, (tile_i - 1) & 1);\n"
     f"        {_stamp(0, 1)}\n"),
    ("        *tile_smem = w;  ", f"        {_stamp(0, 2)}\n        *tile_smem = w;  "),
    ("wt.q_row + wt.m0, wt.head, wt.tma_b);\n", f"wt.q_row + wt.m0, wt.head, wt.tma_b);\n            {_stamp(0, 3)}\n"),
    ("                load_v(wt, it);\n            }\n",
     f"                load_v(wt, it);\n            }}\n"
     f"            {_stamp(0, 4)}\n"),
    # consumers
    ("            mbar_wait(q_full, tile_i & 1);\n",
     f"            {_stamp('1 + cw', 0)}\n            mbar_wait(q_full, tile_i & 1);\n            {_stamp('1 + cw', 1)}\n"),
    ("        take_turn();\n        issue_s(kv_it);\n",
     f"        take_turn();\n        {_stamp('1 + cw', 2)}\n        issue_s(kv_it);\n"),
    ("        wgmma_wait<0>();\n        s_done(kv_it, wt.n_tiles == 1);\n        start_tile();\n",
     f"        wgmma_wait<0>();\n        {_stamp('1 + cw', 3)}\n        s_done(kv_it, wt.n_tiles == 1);\n"
     f"        start_tile();\n        {_stamp('1 + cw', 4)}\n"),
    ("        take_turn();\n        issue_pv(kv_it, p_frag);\n",
     f"        take_turn();\n        {_stamp('1 + cw', 5)}\n        issue_pv(kv_it, p_frag);\n"),
    ("        wgmma_wait<0>();\n        pv_done(kv_it, p_frag);\n        ++kv_it;\n",
     f"        wgmma_wait<0>();\n        {_stamp('1 + cw', 6)}\n        pv_done(kv_it, p_frag);\n        ++kv_it;\n"),
    ("            if (!SPLIT || wt.parts == 1 || merge_pieces()) store_tile();\n",
     f"            if (!SPLIT || wt.parts == 1 || merge_pieces()) store_tile();\n            {_stamp('1 + cw', 7)}\n"),
]
#: ``epitrace``: stamps inside the epilogue of an O_SMEM variant (staged O, TMA store) instead
TRACE_EVENTS_EPILOGUE = ["last PV done", "finish_rows (1 / l, lse)", "o_smem address (its barrier: in the last turn)",
                         "stmatrix + fence", "barrier 2 (rows staged)", "TMA store issued",
                         "back in the loop"]
PROBES["epitrace"] = [
    *PROBES["trace"][:3],   # the stamp definitions and the producer's clock calibration
    ("        wgmma_wait<0>();\n        pv_done(kv_it, p_frag);\n        ++kv_it;\n",
     f"        wgmma_wait<0>();\n        {_stamp('1 + cw', 0)}\n        pv_done(kv_it, p_frag);\n        ++kv_it;\n"),
    ("            finish_rows<VARLEN>(p, wt, m_run, l_run, sl2, row0, t % 4 == 0, inv_l);\n",
     "            finish_rows<VARLEN>(p, wt, m_run, l_run, sl2, row0, t % 4 == 0, inv_l);\n"
     f"            {_stamp('1 + cw', 1)}\n"),
    ("            const u32 o_wg = smem + L::O + cw * L::O_WG;   // [PANELS][64][64] (free: last_turn)\n",
     "            const u32 o_wg = smem + L::O + cw * L::O_WG;   // [PANELS][64][64] (free: last_turn)\n"
     f"            {_stamp('1 + cw', 2)}\n"),
    ("            fence_proxy_async();                  // the rows visible to the TMA unit,\n",
     "            fence_proxy_async();                  // the rows visible to the TMA unit,\n"
     f"            {_stamp('1 + cw', 3)}\n"),
    ("            named_bar_sync(WG_BAR + cw, 128);     // ... all four warps' rows staged\n",
     "            named_bar_sync(WG_BAR + cw, 128);     // ... all four warps' rows staged\n"
     f"            {_stamp('1 + cw', 4)}\n"),
    ("                bulk_commit();\n            }\n        } else {\n",
     f"                bulk_commit();\n            }}\n            {_stamp('1 + cw', 5)}\n        }} else {{\n"),
    ("            if (!SPLIT || wt.parts == 1 || merge_pieces()) store_tile();\n",
     f"            if (!SPLIT || wt.parts == 1 || merge_pieces()) store_tile();\n            {_stamp('1 + cw', 6)}\n"),
]
TIMED = ["nostore", "static", "qonce"]


def patched(source: str, patches) -> str:
    """``source`` with each (anchor, replacement) applied once; ValueError if an anchor is not
    there exactly once (the kernel changed: the probe must be redone, not silently skipped)."""
    for anchor, replacement in patches:
        if source.count(anchor) != 1:
            raise ValueError(f"anchor found {source.count(anchor)} times, expected once: {anchor!r}")
        source = source.replace(anchor, replacement)
    return source


#: the Hopper forward's sources the probes patch (kernels_cu/...): the entry and its headers
FILES = ["hopper/fwd.cu", "hopper/fwd_producer.cuh", "hopper/fwd_consumer.cuh", "hopper/fwd_layout.cuh",
         "hopper/softmax.cuh", "hopper/epilogue.cuh", "hopper/sched.cuh"]


def patched_tree(tree: Path, patches) -> None:
    """Applies each (anchor, replacement) of ``patches`` to the one file of FILES under ``tree``
    that holds the anchor exactly once (ValueError otherwise, as ``patched``)."""
    texts = {f: (tree / f).read_text() for f in FILES}
    for anchor, replacement in patches:
        where = [f for f, t in texts.items() if anchor in t]
        if len(where) != 1:
            raise ValueError(f"anchor found in {len(where)} files, expected one: {anchor!r}")
        texts[where[0]] = patched(texts[where[0]], [(anchor, replacement)])
    for f, t in texts.items():
        if t != (tree / f).read_text():
            (tree / f).write_text(t)


def make_trees(out: Path, kernels: Path = ROOT / "kernels_cu", probes=None) -> list:
    """Writes out/base/kernels_cu (a copy) and out/<probe>/kernels_cu for each of ``probes``
    (default: every probe); returns the kernels_cu paths, base first."""
    trees = []
    for name in ["base", *(PROBES if probes is None else probes)]:
        tree = out / name / "kernels_cu"
        if tree.exists():
            shutil.rmtree(tree)
        shutil.copytree(kernels, tree)
        if name != "base":
            patched_tree(tree, PROBES[name])
        trees.append(tree)
    return trees


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the trees")
    ap.add_argument("--run", action="store_true", help="time them (needs the GPU)")
    ap.add_argument("--probes", nargs="+", choices=list(PROBES), default=TIMED,
                    help=f"probes to time beside the base (default {' '.join(TIMED)})")
    args = ap.parse_args(argv)
    trees = make_trees(args.out, probes=args.probes)
    cmd = [sys.executable, str(ROOT / "lab" / "ab_fwd_kernels.py"), "--trees",
           *map(str, trees), "--dtype", "bfloat16", "--peer", "cudnn", *rest]
    print("# trees: " + ", ".join(f"[{i}] {t.parent.name}" for i, t in enumerate(trees)))
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd) if args.run else 0


if __name__ == "__main__":
    sys.exit(main())
