#!/bin/bash
# Session 17: is bench_w4a16's 28672 x 8192, M = 1 cell (45-47 us, against 40.2-40.5 for the same config in
# bench/experimental/w4a16_timing_gap.py and 42.0 for the code at #23's filing) a first-timing effect? The same
# cell timed three times in one process (M = 1, 16, 1, 1), for this checkout, the filing code and this checkout
# again, in one call. Carry [.stage/filing]:  bash bench/device_w4a16_first_cell.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.stage/filing
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
for run in new filing new2; do
    mod=quantkit.kernels.w4a16; [ $run = filing ] && mod=filing_kernels.w4a16
    echo "== $run ($mod)"
    QUANTKIT_W4A16_MODULE=$mod timeout 60 python3 bench/bench_w4a16.py --shapes 28672x8192 --ms 1,16,1,1 \
        --out $OUT/first_cell_$run.json 2>&1 | grep "N="
done
rm -f $OUT/*.png
