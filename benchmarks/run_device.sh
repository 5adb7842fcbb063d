#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, notebooks, CLI demo, and the benchmark tables beside the
# peers, logs under $OUT (default ./device-out). Run from the checkout:  bash benchmarks/run_device.sh
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
say() { echo "== $*" | tee -a "$OUT/misc.log"; }

say info; python -m cupyflash info >> "$OUT/misc.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >> "$OUT/misc.log" 2>&1
say precompile
timeout 150 python -m cupyflash precompile --workers 16 >> "$OUT/misc.log" 2>&1
tail -1 "$OUT/misc.log"

say "GPU tests"
timeout 300 python -m pytest -q -m gpu tests/ -p no:cacheprovider -rf --tb=short > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
say notebooks
timeout 120 python -m pytest -q tests/test_notebooks.py -p no:cacheprovider -rf --tb=short >> "$OUT/misc.log" 2>&1
tail -1 "$OUT/misc.log"
say demo; timeout 60 python -m cupyflash demo >> "$OUT/misc.log" 2>&1; tail -4 "$OUT/misc.log"

say "bench bf16"
timeout 240 python -m cupyflash bench --peers benchmarks.peers --json "$OUT/bench.json" --png "$OUT/bench.png" > "$OUT/bench.log" 2>"$OUT/bench_progress.log"
cat "$OUT/bench.log"
say "bench fp32"
timeout 120 python -m cupyflash bench --dtype fp32 --seqlen 1024 4096 --peers benchmarks.peers --json "$OUT/bench_fp32.json" --png "$OUT/bench_fp32.png" >> "$OUT/bench.log" 2>>"$OUT/bench_progress.log"
tail -12 "$OUT/bench.log"
say "memory, host overhead, compile"
timeout 90 python benchmarks/bench_forward.py --skip bf16,f32,tune >> "$OUT/misc.log" 2>&1
say "pytest-benchmark suite (s=4096 subset)"
timeout 120 python -m pytest benchmarks/test_bench_gpu.py --benchmark-only -q -k "s4096" -p no:cacheprovider --benchmark-columns=median,rounds >> "$OUT/misc.log" 2>&1
tail -3 "$OUT/misc.log"
