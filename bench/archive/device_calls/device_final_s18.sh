#!/bin/bash
# The lead's two back-to-back device calls at the end of session 18 (issue #23). The GGUF is over one call's
# 64 MiB of carried paths, so each call carries one half (carried paths are gone in the next call; /tmp stays
# while the machine is warm, and it is released after 30 s idle: call B must follow call A at once).
#
#   call A, carry [.stage/smolA, .stage/pplwhl, .stage/filing]:  bash bench/device_final_s18.sh ab BUDGET_S
#     GGUF half A to /tmp, wheels (gguf, typer, pydantic) into /tmp/site; the attention and decode A/B against the
#     code at the filing (304145d staged as the package filing_kernels, see bench/ab_attention_versions.py),
#     every cell of README's prefill table; then the FP8 public-call table (bf16 against fp8=True and e4m3 inputs
#     with descale factors, 2K/8K/16K, causal and not, errors against float32).
#   call B at once, carry [.stage/smolB, .stage/data, .stage/filing]:  bash bench/device_final_s18.sh suite BUDGET_S
#     the W4A16 A/B on README's shapes (filing code, then this checkout, one process each), then the GGUF whole
#     into the test cache, WikiText-2 into ../shared, and the whole GPU suite.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
BUDGET=${2:-300}
t0=$(date +%s)
source bench/device_budget.sh
source bench/device_stage.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
export PYTHONPATH=$PWD/.stage/filing
case "$1" in
ab)
    stage_first_half
    python3 -c "import filing_kernels.attention, filing_kernels.w4a16; print('filing kernels import')"
    step 350 python3 bench/ab_attention_versions.py --old filing_kernels --deadline 330 --out $OUT/ab_attention.json \
        2>&1 | tail -24
    step 100 python3 bench/bench_attention.py --skip-sweep --sections fp8call --seqlens 2048,8192,16384 \
        --out $OUT --name attention_fp8call.json 2>&1 | grep -v Warning | tail -30
    ;;
suite)
    SH=28672x8192,14336x4096,4096x4096
    step 60 env QUANTKIT_W4A16_MODULE=filing_kernels.w4a16 python3 bench/bench_w4a16.py --shapes $SH --ms 1,16,1024 \
        --deadline 45 --out $OUT/ab_w4a16_filing.json 2>&1 | grep -v "^  " | tail -25
    step 60 python3 bench/bench_w4a16.py --shapes $SH --ms 1,16,1024 --deadline 45 --out $OUT/ab_w4a16_new.json 2>&1 \
        | grep -v "^  " | tail -25
    gpu_suite 380
    ;;
*) echo "usage: device_final_s18.sh ab|suite BUDGET_S"; exit 2 ;;
esac
rm -f $OUT/*.png
