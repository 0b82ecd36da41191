#!/bin/bash
# The lead's two back-to-back device calls at the end of session 20 (issue #23); the GGUF travels in halves as in
# bench/device_stage.sh (call B must follow call A at once).
#
#   call A, carry [.stage/smolA, .stage/pplwhl]:  bash bench/device_final_s20.sh fp8 BUDGET_S
#     README's FP8-call table with fp8="auto" beside fp8=True, bf16 and the other paths (16/16/128, 2K-16K tokens).
#   call B at once, carry [.stage/smolB, .stage/data]:  bash bench/device_final_s20.sh suite BUDGET_S
#     the whole GPU suite with the GGUF and WikiText-2 in place.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
BUDGET=${2:-300}
t0=$(date +%s)
source bench/device_budget.sh
source bench/device_stage.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
case "$1" in
fp8)
    stage_first_half
    step 200 python3 bench/bench_attention.py --skip-sweep --sections fp8call --seqlens 2048,4096,8192,16384 \
        --out $OUT --name attention_fp8call.json 2>&1 | grep -v Warning | grep -v "^fp8_call" | grep -v "ref = torch" \
        | tail -14
    ;;
suite)
    gpu_suite 420
    ;;
*) echo "usage: device_final_s20.sh fp8|suite BUDGET_S"; exit 2 ;;
esac
rm -f $OUT/*.png
