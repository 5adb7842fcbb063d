#!/usr/bin/env bash
# Question: does the whole GPU test suite pass, run as parallel pytest shards after one precompile (H100: precompile about 2 minutes with 16 processes, the shards about 4 side by side)?
# From the checkout root on a GPU machine:  bash lab/gpu_suite.sh [shard ...]
# Shards (default: all): fwd90 fwd90b biasvarlen bias fwd bwdp bwd90 f32f64 misc smem99 smem99b smem99c
# kvcache sanitizer (a file split by -k where one shard would run longest).
# Logs: $OUT/suite_<shard>.log (default ./device-out); one summary line per shard on stdout.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T=tests/gpu
declare -A SHARD=(
  [fwd90]="$T/test_gpu_forward_sm90.py -k test_seqlens"
  [fwd90b]="$T/test_gpu_forward_sm90.py -k 'not test_seqlens'"
  [biasvarlen]="$T/test_gpu_bias_varlen.py -k 'not test_bias_hopper_backward'"
  [bias]="$T/test_gpu_bias_varlen.py -k test_bias_hopper_backward"
  [fwd]="$T/test_gpu_forward.py $T/test_gpu_api.py $T/test_launch.py $T/test_tolerance.py"
  [bwdp]="$T/test_gpu_backward.py"
  [bwd90]="$T/test_gpu_backward_sm90.py"
  [f32f64]="$T/test_gpu_backward_sm90_f32.py $T/test_gpu_forward_sm90_f32.py $T/test_gpu_float64.py"
  [misc]="$T/test_ring_gpu.py $T/test_fuzz.py $T/test_exact_size.py"
  [smem99]="$T/test_gpu_smem99.py -k 'float16 and not bfloat16'"
  [smem99b]="$T/test_gpu_smem99.py -k bfloat16"
  [smem99c]="$T/test_gpu_smem99.py -k float32"
  [kvcache]="$T/test_gpu_kvcache.py"
  [sanitizer]="$T/test_sanitizer.py -s"
)
shards=("$@"); [ ${#shards[@]} -eq 0 ] && shards=(fwd90 fwd90b biasvarlen bias fwd bwdp bwd90 f32f64 misc smem99 smem99b smem99c kvcache sanitizer)
if [ "${PRECOMPILE:-1}" = 1 ]; then
  t0=$SECONDS
  timeout ${PRECOMPILE_TIMEOUT:-200} python -m cupyflash precompile --workers 16 > "$OUT/suite_precompile.log" 2>&1
  echo "precompile rc $? in $((SECONDS - t0)) s: $(tail -1 "$OUT/suite_precompile.log")"
fi
t0=$SECONDS
for s in "${shards[@]}"; do
  eval "timeout ${SHARD_TIMEOUT:-420} python -m pytest -q ${SHARD[$s]} -p no:cacheprovider -rfs \
      --tb=short" > "$OUT/suite_$s.log" 2>&1 &
done
wait
for s in "${shards[@]}"; do
  echo "$s: $(grep -E '^(FAILED|ERROR)' "$OUT/suite_$s.log" | head -5 | tr '\n' ' ')$(tail -1 "$OUT/suite_$s.log")"
done
echo "tests wall $((SECONDS - t0)) s"
