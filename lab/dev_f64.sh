#!/usr/bin/env bash
# Question: on an H200, do the float64 (f64_t, DMMA) kernels compile, pass their accuracy grid and how fast are they?
# One call from the checkout root, under 4 minutes (each step has its own time limit):
#   1. precompile the f64_t variants the tests and the benchmark use (16 processes)
#   2. lab/probe_dmma.py: four m8n8k4 DMMAs = one m16n8k8 product on the tf32 fragments
#   3. tests/gpu/test_gpu_float64.py (extended-precision reference; one line per case)
#   4. benchmarks/bench_f64.py: TFLOP/s beside cuBLAS DGEMM and the plain CuPy float64 recipe
# Logs under $OUT (default ./device-out); a compact summary on stdout.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
say() { echo "== $*"; }

say "precompile f64_t"
timeout 100 python -m cupyflash precompile --workers 16 --elems f64_t \
    --head-dims 32,64,96,128,160,256 > "$OUT/f64_precompile.log" 2>&1
echo "rc $?"; tail -2 "$OUT/f64_precompile.log"

say "probe_dmma"
timeout 30 python lab/probe_dmma.py 2>&1 | tee "$OUT/f64_probe.log" | tail -6

say "tests/gpu/test_gpu_float64.py"
timeout 130 python -m pytest -q -s tests/gpu/test_gpu_float64.py -p no:cacheprovider -rfs \
    --tb=short --durations=5 > "$OUT/f64_tests.log" 2>&1
echo "rc $?"
grep -oE "(grid|option|bias|mask \+|varlen) [^.].*: out .*" "$OUT/f64_tests.log" | sort | awk '
    { n++; print } END { print n " case lines" }' | tail -40
grep -E "FAILED|Error|error:|passed|failed" "$OUT/f64_tests.log" | tail -25

say "benchmarks/bench_f64.py"
timeout 180 python benchmarks/bench_f64.py --bwd-ab --mma16 --json "$OUT/bench_f64.json" 2>&1 | tee "$OUT/f64_bench.log"
