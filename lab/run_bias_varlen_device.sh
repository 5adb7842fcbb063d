#!/bin/bash
# Question: in one GPU run, do the bias / mask / varlen tests and a dense regression subset pass, and what do their tables read?
# One device run for issue 6 (bias / mask / varlen): precompile the variants the tests touch, the
# new GPU tests, a regression subset of the dense GPU tests (Params changed for every kernel),
# then the benchmark tables. Logs under $OUT (the device tool's output folder).
#   bash lab/run_bias_varlen_device.sh
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 70 python -m cupyflash precompile --workers 16 --elems f16_t,bf16_t,f32x3_t \
    --head-dims 32,64,96,128 2>&1 | tee "$OUT/precompile.log"
timeout 110 python -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu_bias_varlen.py \
    tests/test_gpu_api.py 2>&1 | tee "$OUT/tests_new.log" | tail -40
timeout 50 python -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu_forward.py \
    tests/test_gpu_backward.py -k "options or gqa or fully_masked or deterministic" 2>&1 \
    | tee "$OUT/tests_regress.log" | tail -25
timeout 70 python lab/bench_bias_varlen.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
