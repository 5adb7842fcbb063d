#!/usr/bin/env bash
# Question: in one GPU run, do every GPU test, the notebooks and the demo pass, and where do overhead and the benchmark stand? (logs under $OUT)
# One call on a GPU machine: every GPU test, notebooks, demo, host overhead, and a benchmark
# check beside the peers; logs under $OUT (default ./device-out). From the checkout:
#     bash lab/run_device.sh            # FULL=1 adds the whole FA benchmark grid
#     SKIP="cupy memeff portable" ...           # peers to leave out of the bench (default: cupy memeff)
# Time limits are set so that the whole script stays well under ten minutes on an H200.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
say() { echo "== $*" | tee -a "$OUT/misc.log"; }

say info; python -m cupyflash info >> "$OUT/misc.log" 2>&1; tail -3 "$OUT/misc.log"
say precompile
timeout 150 python -m cupyflash precompile --workers 16 >> "$OUT/misc.log" 2>&1
tail -1 "$OUT/misc.log"

say "GPU tests"
timeout 330 python -m pytest -q -m gpu tests/ -p no:cacheprovider -rfs --tb=short > "$OUT/tests.log" 2>&1
tail -4 "$OUT/tests.log"
say "host overhead"; timeout 60 python benchmarks/overhead.py >> "$OUT/misc.log" 2>&1; tail -6 "$OUT/misc.log"
say "bench (bf16, fwd + bwd, beside PyTorch SDPA)"
if [ "${FULL:-0}" = 1 ]; then SEQ="512 1024 2048 4096 8192 16384"; else SEQ="1024 4096 16384"; fi
timeout 200 python -m cupyflash bench --seqlen $SEQ --skip-peers ${SKIP:-cupy memeff} --peers benchmarks.peers \
    --json "$OUT/bench.json" --png "$OUT/bench.png" > "$OUT/bench.log" 2>"$OUT/bench_progress.log"
cat "$OUT/bench.log"
say "bench hd256 forward"
timeout 60 python -m cupyflash bench --head-dim 256 --seqlen 1024 4096 16384 --direction fwd \
    --skip-peers ${SKIP:-cupy memeff} --peers benchmarks.peers --json "$OUT/bench256.json" \
    --png "$OUT/bench256.png" >> "$OUT/bench.log" 2>>"$OUT/bench_progress.log"
tail -8 "$OUT/bench.log"
say notebooks
timeout 90 python -m pytest -q tests/test_notebooks.py -p no:cacheprovider -rf --tb=short >> "$OUT/misc.log" 2>&1
tail -1 "$OUT/misc.log"
say demo; timeout 60 python -m cupyflash demo >> "$OUT/misc.log" 2>&1; tail -4 "$OUT/misc.log"

