#!/bin/bash
# Session 19: the W4A16 A/B against the filing code (staged as filing_kernels, carry .stage/filing) at the M
# buckets README's tables do not show, on README's shapes: filing / this checkout / filing again, one process each.
#   bash bench/device_w4a16_buckets_s19.sh BUDGET_S
set -o pipefail
export PYTHONUNBUFFERED=1
BUDGET=${1:-400}
t0=$(date +%s)
source bench/device_budget.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
export PYTHONPATH=$PWD/.stage/filing
SH=${SH:-28672x8192,8192x28672,14336x4096,4096x4096}
MS=${MS:-32,64,256,2048}
for who in filing new filing2; do
    mod=$([ $who = new ] && echo quantkit.kernels.w4a16 || echo filing_kernels.w4a16)
    step 120 env QUANTKIT_W4A16_MODULE=$mod python3 bench/bench_w4a16.py --shapes $SH --ms $MS --deadline 100 \
        --out $OUT/ab_w4a16_buckets_$who.json 2>&1 | grep -v "^  " | grep -v "^N=" | tail -20
done
rm -f $OUT/*.png
