#!/bin/bash
# Session 19's first device call (issue #23), carrying .stage/filing (the kernels at the issue's filing, staged as
# the package filing_kernels: see bench/ab_attention_versions.py):
#   bash bench/device_probe_s19.sh BUDGET_S
# 1. re-tune the W4A16 table at 4096x4096 for M = 2, 4, 8 with every candidate re-timed the benchmark's way
#    (--confirm 14), into $OUT/w4a16_h200_tuned.json, then install it in this checkout;
# 2. the W4A16 A/B at 4096x4096 and 14336x4096, M = 2, 4, 8: filing code, this checkout, filing again;
# 3. the general split-K decode kernel against the fused one the runtime runs (bench/experimental/decode_split_k.py).
set -o pipefail
export PYTHONUNBUFFERED=1
BUDGET=${1:-400}
t0=$(date +%s)
source bench/device_budget.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
export PYTHONPATH=$PWD/.stage/filing
step 200 python3 bench/tune_w4a16.py --shapes 4096x4096 --ms 4,2,8 --confirm 14 --deadline 150 \
    --out $OUT/w4a16_h200_tuned.json 2>&1 | grep -v Warning | tail -60
[ -s $OUT/w4a16_h200_tuned.json ] && cp $OUT/w4a16_h200_tuned.json kernels/w4a16_h200.json
SH=4096x4096,14336x4096
for who in filing new filing2; do
    mod=$([ $who = new ] && echo quantkit.kernels.w4a16 || echo filing_kernels.w4a16)
    step 50 env QUANTKIT_W4A16_MODULE=$mod python3 bench/bench_w4a16.py --shapes $SH --ms 2,4,8 --deadline 40 \
        --out $OUT/ab_w4a16_m248_$who.json 2>&1 | grep -v "^  " | tail -12
done
step 90 python3 bench/experimental/decode_split_k.py --out $OUT/decode_kernels.json 2>&1 | grep -v Warning | tail -14
rm -f $OUT/*.png
