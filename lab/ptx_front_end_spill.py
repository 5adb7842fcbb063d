# Question: Does a portable variant's spill on sm_120 (or sm_100) come from NVRTC's newer front end (the PTX it writes for sm_100+) or from ptxas for that target?
"""NVRTC compiles sm_100+ targets with a newer NVVM front end than sm_80..sm_90a (the PTX header
names the NVVM version). This probe compiles one planner variant:

1. with NVRTC for each target (ptxas -v through NVRTC): registers, spill bytes;
2. to PTX for compute_86 and for the new target: NVVM version, PTX lines;
3. with a standalone ptxas (PATH, $CUDA_HOME/bin or /usr/local/cuda*/bin; skipped without one):
   both PTX texts assembled for the new target, so the only difference left is the front end.

    python lab/ptx_front_end_spill.py fwd_bf16_d128_128x64w4s2 --smem 101376
    python lab/ptx_front_end_spill.py bwd_f64_d160_16x16w4s4b1 --smem 101376 --target sm_120

The variant is looked up by name in plan_fwd.variants / plan_bwd.variants (+ dbias) /
plan_decode.variants for the given opt-in shared memory. Findings: docs/kernels.md (ptxas,
99 KB targets).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cupyflash.gpu import compile as gc, plan_bwd, plan_decode, plan_fwd  # noqa: E402


def find_variant(name, smem):
    pool = plan_fwd.variants(smem) + plan_bwd.variants(smem) + plan_bwd.dbias_variants(smem) \
        + plan_decode.variants(smem)
    for v in pool:
        if v.name == name:
            return v
    raise SystemExit(f"no variant {name} at {smem} bytes")


def ptx(parts, arch):
    """(PTX text, NVVM version line) of ``parts`` for compute_<arch digits>."""
    from cupy_backends.cuda.libs import nvrtc

    src, opts, names = parts
    prog = nvrtc.createProgram(src, "probe.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        nvrtc.compileProgram(prog, [o for o in opts if not o.startswith("-arch")]
                             + [f"-arch=compute_{arch[3:]}"])
        text = nvrtc.getPTX(prog).replace(b"\0", b"").decode()
        lowered = nvrtc.getLoweredName(prog, names[0])
    finally:
        nvrtc.destroyProgram(prog)
    nvvm = next((ln.strip("/ ") for ln in text.splitlines() if "Based on NVVM" in ln), "?")
    return text, nvvm, lowered


def standalone_ptxas():
    cands = [shutil.which("ptxas")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "ptxas"))
    cands += sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))
    return next((c for c in cands if c and os.path.exists(c)), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--smem", type=int, default=99 * 1024)
    ap.add_argument("--target", default="sm_120")
    ap.add_argument("--archs", default="sm_80,sm_86,sm_90a,sm_100,sm_120")
    a = ap.parse_args()
    v = find_variant(a.name, a.smem)
    parts = gc.program([v], plan_decode.build_options() if isinstance(v, plan_decode.DecodeVariant)
                       else ())
    print(f"{v.name} = {v.name_expression}")
    for arch in a.archs.split(","):
        regs, spill = gc.nvrtc_report(parts, arch, "probe.cu")[v.name_expression]
        print(f"  NVRTC {arch:7s} {regs:4d} registers {spill:5d} B spill")
    texts = {}
    for arch in ("sm_86", a.target):
        text, nvvm, lowered = ptx(parts, arch)
        texts[arch] = text
        print(f"  PTX for compute_{arch[3:]}: {nvvm}, {len(text.splitlines())} lines")
    ptxas = standalone_ptxas()
    if ptxas is None:
        print("  no standalone ptxas: step 3 skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for arch, text in texts.items():
            text = re.sub(r"^\.target \S+", f".target {a.target}", text, flags=re.M)
            path = os.path.join(tmp, f"{arch}.ptx")
            open(path, "w").write(text)
            log = subprocess.run([ptxas, "-v", f"-arch={a.target}", path, "-o",
                                  os.path.join(tmp, "out.cubin")], capture_output=True,
                                 text=True).stderr
            m = re.search(re.escape(lowered) + r".*?(\d+) bytes spill stores.*?Used (\d+) registers",
                          log, re.S)
            got = f"{m.group(2)} registers {m.group(1)} B spill" if m else log.strip()[-300:]
            print(f"  {ptxas} -arch={a.target} on the compute_{arch[3:]} PTX: {got}")


if __name__ == "__main__":
    main()
