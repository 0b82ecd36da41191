#!/bin/bash
# One device call (session 15, issue #23): the GPU tests of the fp8 attention call, the fp8-call benchmark
# (bf16 against the public fp8 call, the former call and the pre-quantized paths, 2K/8K/16K tokens, causal and
# not), the W4A16 re-tune of 28672 x 8192 at M = 1 (tuner timing and benchmark timing of the leaders and of the
# table's entry), then bench_w4a16 on that cell with the new table. Each step gets at most its cap and what is
# left of BUDGET seconds; logs and JSON go to $OUT.
#     OUT=/tmp/out BUDGET=200 bash bench/device_fp8_call.sh
set -o pipefail
OUT=${OUT:-bench/results}
BUDGET=${BUDGET:-200}
t0=$(date +%s)
STEP_MIN_S=15
source "$(dirname "${BASH_SOURCE[0]}")/device_budget.sh"  # step CAP CMD...
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
step 60 python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/kernels/test_attention_fp8.py \
    tests/kernels/test_attention.py::test_gpu_fp8 2>&1 | tee "$OUT/pytest_gpu_fp8_call.txt"
step 80 python3 bench/bench_attention.py --skip-sweep --sections fp8call --seqlens 2048,8192,16384 \
    --out "$OUT" --name attention_fp8call_h200.json 2>&1 | tee "$OUT/attention_fp8call.log"
step 80 python3 bench/tune_w4a16.py --shapes 28672x8192 --ms 1 --replays 20 --confirm 3 \
    --out kernels/w4a16_h200.json 2>&1 | tee "$OUT/tune_w4a16_28672x8192_m1.log"
cp kernels/w4a16_h200.json "$OUT/w4a16_h200.json"
step 40 python3 bench/bench_w4a16.py --shapes 28672x8192 --ms 1 --out "$OUT/w4a16_28672x8192_m1.json" 2>&1 \
    | tail -5
echo "== done after $(( $(date +%s) - t0 )) s"
