# Question: Does a kernels_cu/ refactor leave the SASS of every representative variant byte-for-byte identical?
"""SASS identity gate for pure refactors of kernels_cu/ (moves, headers, include structure).

Compiles a representative set of variants (at least two of every kernel family and every helper
kernel: portable fwd / bwd / dbias / pre / dq and the split-KV decode (with its combine / kvcache
helpers, under plan_decode.build_options()) for sm_80 and sm_90a; Hopper fwd 16-bit and float32,
Hopper bwd 16-bit (+ pre / dq) and float32 (+ pre), Hopper dbias for sm_90a; varlen, bias,
window, softcap, split, max-free and deterministic variants among them) with NVRTC through
``cupyflash.gpu.compile.program`` (the package's own sources, options and name expressions),
disassembles each cubin with nvdisasm, and keeps one normalized text per kernel function. The key
is (arch, kernel symbol), which does not depend on the file layout, so a baseline recorded from
the old tree compares against the new one:

    python lab/sass_identity.py --save /tmp/sass_base        # on the unmodified tree
    python lab/sass_identity.py --compare /tmp/sass_base     # after the move: prints each
                                                             # kernel IDENTICAL / DIFFERENT

Normalization drops only what does not come from the code: nvdisasm's header comments and file /
line directives, its cubin-wide numbering of local labels (renumbered per section), and the
translation-unit part of internal-linkage names (file name and hash: one placeholder). ``-D`` / ``-I`` options (the source hash, include paths) do not reach the SASS.
``--only fam,...`` limits the families; ``--workers`` sets the compile processes. A template
parameter added with a default changes the default instantiation's symbol but not its code:
``--sub PATTERN REPL`` (a regex, repeatable) rewrites the new tree's keys and texts before the
comparison, e.g. ``--sub 'Li0ELb0EEv6Params' 'Li0EEv6Params' --sub ', false>' '>'`` for a
trailing ``bool DET = false``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pick(vs, **want):
    """The first variant of ``vs`` whose fields equal ``want`` (KeyError naming it if none)."""
    for v in vs:
        if all(getattr(v, k) == x for k, x in want.items()):
            return v
    raise KeyError(f"no variant with {want}")


def families():
    """{family: [(arch, variant), ...]}: the representative set."""
    from cupyflash.gpu import (plan_bwd, plan_bwd_sm90, plan_bwd_sm90_f32, plan_dbias_sm90,
                               plan_decode, plan_fwd, plan_fwd_sm90)
    both = ("sm_80", "sm_90a")
    fwd = list(plan_fwd.variants())
    bwd = list(plan_bwd.variants())
    dbias = list(plan_bwd.dbias_variants())
    f90 = list(plan_fwd_sm90.variants())
    f90f = list(plan_fwd_sm90.f32_variants())
    b90 = list(plan_bwd_sm90.variants())
    b90f = list(plan_bwd_sm90_f32.variants())
    d90 = list(plan_dbias_sm90.variants())
    out = {
        "fwd_portable": [
            _pick(fwd, elem="bf16_t", d=128, window=False, score_mod=False, general=0),
            _pick(fwd, elem="f16_t", d=64, window=True, score_mod=True, general=0),
            _pick(fwd, elem="bf16_t", d=128, general=1),      # varlen
            _pick(fwd, elem="f16_t", d=64, general=3),        # varlen + bias / mask
            _pick(fwd, elem="tf32_t", d=64, window=True, general=0),
        ],
        "bwd_portable(+pre,dq)": [
            _pick(bwd, elem="bf16_t", d=128, window=False, score_mod=False, general=False),
            _pick(bwd, elem="f16_t", d=64, window=True, score_mod=True, general=False),
            _pick(bwd, elem="bf16_t", d=128, general=True),   # bias / dbias / mask / varlen
            _pick(bwd, elem="tf32_t", d=64, general=False),
            _pick(bwd, elem="bf16_t", d=128, window=False, score_mod=False, pair=False,
                  wms=2, wnkv=4, wmq=2),                     # flash_bwd_2d
            _pick(bwd, elem="f16_t", d=64, window=True, score_mod=True, wms=4, wnkv=4, wmq=4),
        ],
        "f64_portable": [   # float64 (DMMA): the partial-unroll tile copies, the wide-d_v pieces
            _pick(fwd, elem="f64_t", d=64, window=False, general=0),
            _pick(fwd, elem="f64_t", d=256, window=True, general=0),
            _pick(bwd, elem="f64_t", d=64, window=False, general=False),
            _pick(bwd, elem="f64_t", d=128, window=True, general=True),
        ],
        "dbias_portable": [
            _pick(dbias, elem="bf16_t", d=128),
            _pick(dbias, elem="tf32_t", d=64),
        ],
        "fwd_sm90_16bit": [
            _pick(f90, elem="bf16_t", d=128, window=False, softcap=False, varlen=False, bias=0,
                  split=False, maxfree=False),
            _pick(f90, elem="f16_t", d=64, window=True, softcap=True, varlen=False, bias=0),
            _pick(f90, elem="bf16_t", d=128, varlen=True, bias=0),
            _pick(f90, elem="bf16_t", d=128, bias=1),
            _pick(f90, elem="f16_t", d=64, bias=2),
            _pick(f90, elem="bf16_t", d=128, split=True),
            _pick(f90, elem="bf16_t", d=128, maxfree=True),
            _pick(f90, elem="bf16_t", d=256, window=True),
        ],
        "fwd_sm90_f32": [
            _pick(f90f, elem="f32x3_t", d=64, window=True),
            _pick(f90f, elem="tf32_t", d=128, window=False),
            _pick(f90f, elem="f32x3_t", d=128, window=False),
        ],
        "bwd_sm90_16bit(+pre,dq)": [
            _pick(b90, elem="bf16_t", d=128, window=False, varlen=False, bias=0),
            _pick(b90, elem="f16_t", d=64, window=True, varlen=False, bias=0),
            _pick(b90, elem="bf16_t", d=128, varlen=True),
            _pick(b90, elem="bf16_t", d=128, bias=1),
            _pick(b90, elem="f16_t", d=64, bias=3),
            _pick(b90, elem="bf16_t", d=128, window=False, varlen=False, det=True),
            _pick(b90, elem="f16_t", d=64, window=True, varlen=True, det=True),
        ],
        "bwd_sm90_f32(+pre)": [
            _pick(b90f, d=64, window=False),
            _pick(b90f, d=128, window=True),
        ],
        "dbias_sm90": [
            _pick(d90, elem="f16_t", d=64, window=True),
            _pick(d90, elem="bf16_t", d=128, bias_f32=True, window=False),
        ],
    }
    jobs = {}
    for fam, vs in out.items():
        archs = both if "portable" in fam else ("sm_90a",)
        jobs[fam] = [(a, v, ()) for v in vs for a in archs]
    # decode: each arch's own ring depths (opt-in shared memory of an A100 / H100), compiled with
    # the options the package passes (plan_decode.build_options)
    jobs["decode"] = []
    for a, optin in (("sm_80", 166912), ("sm_90a", 232448)):
        dec = plan_decode.variants(optin)
        jobs["decode"] += [(a, v, plan_decode.build_options()) for v in (
            _pick(dec, elem="bf16_t", d=128, mt=2),
            _pick(dec, elem="f16_t", d=64, mt=1),
            _pick(dec, elem="bf16_t", d=256),
        )]
    return jobs


def nvdisasm():
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    import nvidia
    for root in nvidia.__path__:
        for cand in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(cand)
    raise SystemExit("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


_DROP = re.compile(r"^\s*(//|\.file|\.loc|\.headerflags|\.elftype)")


def split_functions(sass: str) -> dict:
    """{section name: normalized text} of nvdisasm output: one entry per section (kernel
    .text.<symbol>, its .nv.info / constant banks ...), comments and line directives dropped."""
    out, cur, lines = {}, "(header)", []
    for ln in sass.splitlines():
        if _DROP.match(ln) or not ln.strip():
            continue
        m = re.match(r"\s*\.section\s+([^,\s]+)", ln)
        if m:
            out[cur] = "\n".join(lines)
            cur, lines = m.group(1), []
        lines.append(ln.rstrip())
    out[cur] = "\n".join(lines)
    return {k: _renumber_labels(_internal_names(t)) for k, t in out.items()}


def _internal_names(text: str) -> str:
    """Mangled internal-linkage names (``<len>_INTERNAL_<hash>_<len>_<file>_cu_<hash>_<n>``: a
    namespace-scope constant's name carries the source file's name and a hash of the translation
    unit) made one placeholder, so that moving a constant between files is not a difference."""
    out, i = [], 0
    for m in re.finditer(r"(\d+)_INTERNAL_", text):
        if m.start() < i:
            continue
        n = int(m.group(1))
        out.append(text[i:m.start()] + "#INTERNAL#")
        i = m.start(2) if False else m.end(1) + n
    out.append(text[i:])
    return "".join(out)


def _renumber_labels(text: str) -> str:
    """Local labels (.L_x_N, .L_N) renumbered in order of first use within one section: nvdisasm
    numbers them across the whole cubin, so one label more or fewer in another kernel of the same
    program shifts every later number without any code change."""
    names = {}
    return re.sub(r"\.L_(x_)?\d+\b",
                  lambda m: names.setdefault(m.group(0), f".L_{m.group(1) or ''}#{len(names)}"), text)


def _job(args):
    arch, variant, extra = args
    from cupyflash.gpu import compile as gc
    _, _, cubin = gc.nvrtc_compile(gc.program([variant], extra), arch, variant.file)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm(), f.name], capture_output=True, text=True, check=True).stdout
    return arch, variant.name_expression, split_functions(sass)


def run(jobs, workers):
    res = {}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        futs = {ex.submit(_job, j): j for j in jobs}
        for fut in cf.as_completed(futs):
            arch, name, secs = fut.result()
            print(f"  compiled {arch} {name}", flush=True)
            for sec, text in secs.items():
                res[f"{arch} {name} | {sec}"] = text
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path, help="directory to write the baseline into")
    g.add_argument("--compare", type=Path, help="baseline directory to compare with")
    ap.add_argument("--only", default="", help="comma-separated family names (default: all)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sub", nargs=2, action="append", default=[], metavar=("PATTERN", "REPL"),
                    help="--compare: rewrite the new keys and texts (regex) before comparing")
    a = ap.parse_args(argv)
    fams = families()
    if a.only:
        fams = {f: j for f, j in fams.items() if any(f.startswith(o) for o in a.only.split(","))}
    jobs = [j for js in fams.values() for j in js]
    print(f"{len(jobs)} (arch, variant) programs in {len(fams)} families")
    res = run(jobs, a.workers)
    for pat, repl in a.sub:
        res = {re.sub(pat, repl, k): re.sub(pat, repl, t) for k, t in res.items()}
    digest = {k: hashlib.sha256(t.encode()).hexdigest() for k, t in res.items()}
    if a.save:
        a.save.mkdir(parents=True, exist_ok=True)
        old = {}
        if (a.save / "index.json").is_file():
            old = json.loads((a.save / "index.json").read_text())
        old.update(digest)
        (a.save / "index.json").write_text(json.dumps(old, indent=1, sort_keys=True))
        for k, t in res.items():
            (a.save / (hashlib.sha256(k.encode()).hexdigest()[:20] + ".sass")).write_text(k + "\n" + t)
        print(f"saved {len(digest)} sections to {a.save}")
        return 0
    base = json.loads((a.compare / "index.json").read_text())
    same = diff = 0
    kernels = {}
    for k, h in sorted(digest.items()):
        kern = k.split(" | ")[0]
        if k not in base:
            print(f"NEW (not in baseline): {k}")
            diff += 1
            kernels[kern] = False
            continue
        ok = base[k] == h
        same += ok
        diff += not ok
        kernels[kern] = kernels.get(kern, True) and ok
        if not ok:
            print(f"DIFFERENT: {k}  (baseline text: "
                  f"{a.compare / (hashlib.sha256(k.encode()).hexdigest()[:20] + '.sass')})")
    compared = {k.split(" | ")[0] for k in base} & set(kernels)
    for kern in sorted(kernels):
        print(f"{'IDENTICAL' if kernels[kern] else 'DIFFERENT'}  {kern}")
    n_id = sum(kernels.values())
    print(f"programs: {len(jobs)}; sections compared: {same + diff}, identical: {same}; "
          f"kernel-level: {n_id}/{len(kernels)} identical ({len(compared)} in baseline)")
    return 0 if diff == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
