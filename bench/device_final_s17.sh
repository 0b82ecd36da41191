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
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
case "$1" in
ab)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/pplwhl/*.whl 2>&1 | tail -2
    cp .stage/smolA/part /tmp/partA && echo "GGUF half A in /tmp ($(stat -c %s /tmp/partA) bytes)"
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
    G=$HOME/.cache/quantkit/smollm2
    mkdir -p $G && cat /tmp/partA .stage/smolB/part > $G/SmolLM2-135M-Instruct.Q4_1.gguf && ls -l $G
    mkdir -p ../shared/data/wikitext2 && cp .stage/data/*.txt ../shared/data/wikitext2/ && ls ../shared/data/wikitext2
    export PYTHONPATH=/tmp/site
    step 560 python3 -m pytest -m gpu tests -n 12 -q -rfE -p no:cacheprovider 2>&1 | tee $OUT/gpu_pytest.txt | tail -40
    ;;
*) echo "usage: device_final_s17.sh ab|suite BUDGET_S"; exit 2 ;;
esac
rm -f $OUT/*.png
