#!/bin/bash
# The lead's two back-to-back device calls at the end of session 17 (the GGUF is over one call's 64 MiB, see
# bench/device_gptq_sweep.sh's header; carried paths are gone in the next call, /tmp stays while the machine is warm).
#
#   call A, carry [.stage/smolA, .stage/pplwhl, .stage/filing]:  bash bench/device_final_s17.sh ab BUDGET_S
#     wheels (gguf, typer, pydantic) into /tmp/site, GGUF half A to /tmp; then issue #23's A/B: this checkout's
#     kernels against the code at the filing (304145d, staged as the package filing_kernels: see
#     bench/ab_attention_versions.py) in one process each: bench_w4a16 on README's shapes, the attention and decode
#     tables, and the W4A16 tuner/benchmark timing gap.
#   call B at once, carry [.stage/smolB, .stage/data]:  bash bench/device_final_s17.sh suite BUDGET_S
#     GGUF whole into the test cache, WikiText-2 into ../shared, then the whole GPU suite.
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
    export PYTHONPATH=$PWD/.stage/filing
    python3 -c "import filing_kernels.attention, filing_kernels.w4a16; print('filing kernels import')"
    # issue #28: AWQ on the 8B shapes on the merged code (the walker's timer now waits for the compute stream only)
    step 90 python3 bench/bench_quantize_8b.py --method awq --asym --out $OUT/awq_32_final.json 2>&1 | tail -14
    step 200 python3 bench/ab_attention_versions.py --old filing_kernels --deadline 160 --out $OUT/ab_attention.json \
        2>&1 | tail -30
    SH=28672x8192,14336x4096,4096x4096
    step 70 env QUANTKIT_W4A16_MODULE=filing_kernels.w4a16 python3 bench/bench_w4a16.py --shapes $SH --ms 1,16,1024 \
        --deadline 55 --out $OUT/ab_w4a16_filing.json 2>&1 | grep -v "^  " | tail -25
    step 70 python3 bench/bench_w4a16.py --shapes $SH --ms 1,16,1024 --deadline 55 --out $OUT/ab_w4a16_new.json 2>&1 \
        | grep -v "^  " | tail -25
    step 45 python3 bench/experimental/w4a16_timing_gap.py --out $OUT 2>&1 | tail -20
    ;;
suite)
    gpu_suite 560
    ;;
*) echo "usage: device_final_s17.sh ab|suite BUDGET_S"; exit 2 ;;
esac
rm -f $OUT/*.png
