#!/bin/bash
# det: deterministic Hopper backward (flash_bwd_sm90<..., DET>). Runs from the repository root
# with PYTHONPATH=.; logs into $OUT (4 files); <= 4 minutes (each part under its own timeout).
# 1. precompile the bf16 / fp16 hd 64 / 128 variants (the new _det ones among them)
# 2. bench table: deterministic (current order, and the first version's) vs default Hopper
#    backward (+ cuDNN where torch exists)
# 3. GPU tests: deterministic Hopper backward (bits over runs and two streams, accuracy, every
#    addition order / draw-group size), varlen, launcher choice, the launcher's workspace
set -u
export PYTHONPATH=.
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache_det}
OUT=${OUT:-/tmp/det_out}
mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | head -1

echo "== precompile"
timeout 80 python -m cupyflash precompile --elems bf16_t,f16_t --head-dims 64,128 --workers 16 \
    > "$OUT/precompile.log" 2>&1
echo "rc=$? $(tail -1 "$OUT/precompile.log")  [$(( $(date +%s) - T0 )) s]"

echo "== bench (bf16, 16k tokens, hidden 2048)"
timeout -s INT 75 python lab/bench_det_bwd.py --rounds 5 --rep 10 2>&1 | tee "$OUT/bench.log" | grep -v "^  cudnn:"
echo "[$(( $(date +%s) - T0 )) s]"

echo "== GPU tests"
LEFT=$(( 232 - ($(date +%s) - T0) ))
timeout -s INT $LEFT python -m pytest -q -p no:cacheprovider --durations=8 \
    tests/gpu/test_gpu_backward_sm90.py tests/gpu/test_launch.py tests/gpu/test_gpu_bias_varlen.py \
    -k "deterministic or det_workspace or launcher" \
    > "$OUT/tests.log" 2>&1
echo "rc=$?"
grep -E "passed|failed|error|FAILED|Timeout" "$OUT/tests.log" | tail -15
echo "[$(( $(date +%s) - T0 )) s]"
