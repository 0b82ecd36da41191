#!/bin/bash
# The lead's two back-to-back device calls at the end of session 19 (issue #23); the GGUF travels in halves as in
# bench/device_stage.sh (call B must follow call A at once).
#
#   call A, carry [.stage/smolA, .stage/pplwhl, .stage/filing, .stage/main]:  bash bench/device_final_s19.sh ab BUDGET_S
#     the decode rows of README's attention A/B against the filing code (its split-K kernel against today's fused
#     one; the prefill kernels did not change since session 18's A/B), then the fused decode kernel against main's
#     (staged as main_kernels) and the split-K kernel of bench/experimental on 18 decode rows.
#   call B at once, carry [.stage/smolB, .stage/data]:  bash bench/device_final_s19.sh suite BUDGET_S
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
ab)
    stage_first_half
    export PYTHONPATH=$PWD/.stage/filing:$PWD/.stage/main
    step 120 python3 bench/ab_attention_versions.py --old filing_kernels --deadline 0 --out $OUT/ab_decode_vs_filing.json \
        2>&1 | grep -v Warning | tail -8
    step 150 python3 bench/experimental/decode_split_k.py --old-fused main_kernels --out $OUT/decode_kernels.json \
        2>&1 | grep -v Warning | tail -20
    ;;
suite)
    gpu_suite 420
    ;;
*) echo "usage: device_final_s19.sh ab|suite BUDGET_S"; exit 2 ;;
esac
rm -f $OUT/*.png
