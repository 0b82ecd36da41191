#!/bin/bash
# Session 20's first device call (issue #23), carrying .stage/filing (the kernels at the issue's filing, staged as
# the package filing_kernels):
#   bash bench/device_probe_s20.sh BUDGET_S
# 1. the public fp8=True call against bf16 on a grid of lengths and head shapes (where FP8 on 16-bit inputs starts
#    to pay for its quantization pass: the data behind attention_select's FP8 rule);
# 2. the W4A16 A/B at the M buckets README's tables do not show (bench/device_w4a16_buckets_s19.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
BUDGET=${1:-560}
t0=$(date +%s)
source bench/device_budget.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
step 260 python3 bench/bench_attention.py --skip-sweep --sections fp8call --heads 16/16/128,32/8/128,16/16/64 \
    --seqlens 1024,1536,2048,3072,4096,8192 --fp8call-paths bf16,fp8_public,fp8_kernel_only,quantize_only \
    --out $OUT --name fp8_crossover.json 2>&1 | grep -v Warning | grep -v "^fp8_call" | tail -45
BUDGET=$(( BUDGET )) step 300 bash bench/device_w4a16_buckets_s19.sh $(( BUDGET - ($(date +%s) - t0) - 5 ))
