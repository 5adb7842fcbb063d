#!/usr/bin/env bash
# Question: do the attention_with_kvcache GPU tests pass, and where does the split-KV decode stand
# beside cuDNN, FA2 and the copy bandwidth (benchmarks/bench_kvcache.py's table)?
# From the repository root on a GPU machine:  bash lab/dev_kvcache.sh   (about 3 minutes on an H200)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-device-out}
mkdir -p "$OUT"
echo "== NVRTC compile of the decode variants (ptxas registers / spills)"
timeout 120 python - <<'PY' 2>&1 | tail -30
import cupy
from cupyflash.gpu import compile as C, device, plan_decode as P
dev = cupy.cuda.Device().id
cc, smem, sms = device.info(dev)
arch = "sm_90a" if cc == 90 else f"sm_{cc}"
rep = C.nvrtc_report(C.program(P.variants(smem)), arch, "decode.cu")
for k, (r, s) in sorted(rep.items()):
    print(f"  {arch} {k:50s} {r:4d} regs {s:4d} B spill")
PY
echo "== GPU tests (tests/gpu/test_gpu_kvcache.py)"
timeout 200 python -m pytest -q -p no:cacheprovider -rfs --tb=short tests/gpu/test_gpu_kvcache.py \
    > "$OUT/kvcache_tests.log" 2>&1
grep -E "passed|failed|error" "$OUT/kvcache_tests.log" | tail -3
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/kvcache_tests.log" | head -40
echo "== bench (bf16, hd 128, one query row)"
timeout 200 python benchmarks/bench_kvcache.py --ab --extra-splits 2 8 --json "$OUT/bench_kvcache.json" 2>&1 | tail -40
