#!/usr/bin/env bash
# Question: in one GPU run, do the float32 Hopper forward's variants compile and pass their tests, and how fast are they?
# The float32 Hopper forward (kernels_cu/hopper/fwd_f32.cu) on an H200, in one call from the
# checkout, under 150 s in all (each step has its own time limit; a hang costs only its step):
#   1. compile the planned float32 Hopper variants and the portable float32 ones (16 processes)
#   2. one small forced case (a hang or a wrong layout shows here in seconds)
#   3. tests/test_gpu_forward_sm90_f32.py (float64 reference, out rel. error <= 1e-5)
#   4. lab/bench_f32.py: TFLOP/s of the Hopper kernel, the portable one, SDPA memeff
# Logs under $OUT (default ./device-out). TUNE=1 adds the tile alternatives (up to 75 s more).
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
say() { echo "== $*" | tee -a "$OUT/f32.log"; }

say "compile (float32 Hopper + portable variants)"
timeout 40 python -m cupyflash precompile --workers 16 --elems f32x3_t,tf32_t --head-dims 64,128 \
    >> "$OUT/f32.log" 2>&1   # (the Hopper float32 variants too: SM90_FLOAT32_AUTO)
tail -1 "$OUT/f32.log"

say "smoke: one forced case per head dim"
timeout 25 python -m pytest -x -q tests/test_gpu_forward_sm90_f32.py -p no:cacheprovider \
    -k "test_seqlens and 113-203 and True" -rfs --tb=short >> "$OUT/f32.log" 2>&1
rc=$?
tail -3 "$OUT/f32.log"
if [ $rc -ne 0 ]; then say "smoke failed (rc $rc): skipping the rest"; exit $rc; fi

say "GPU tests (float32 Hopper forward)"
timeout 65 python -m pytest -q tests/test_gpu_forward_sm90_f32.py -p no:cacheprovider -rfs \
    --tb=short > "$OUT/f32_tests.log" 2>&1
tail -5 "$OUT/f32_tests.log"

say "bench (float32 forward: sm90 / portable / SDPA memeff)"
timeout 40 python lab/bench_f32.py --budget 30 > "$OUT/f32_bench.log" 2>&1
cat "$OUT/f32_bench.log"

if [ "${TUNE:-0}" = 1 ]; then   # optional (up to 75 s more): the tile alternatives at s = 4k
    say "tune: alternatives (d,bn,stages,nc,qreg) at s = 4096"
    for v in 64,64,2,2,0 128,32,2,1,0 128,64,1,1,0; do
        timeout 25 python lab/bench_f32.py --head-dims ${v%%,*} --seqlens 4096 --no-peers \
            --variant $v --budget 15 2>&1 | tail -3 | sed "s/^/$v  /" | tee -a "$OUT/f32_bench.log"
    done
fi
