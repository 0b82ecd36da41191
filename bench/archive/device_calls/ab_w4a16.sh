#!/usr/bin/env bash
# One device call for the kernels work: tune the selection table, A/B bench_w4a16 of main's kernels (staged as the
# package main_kernels, see below) against this branch's, and the GPU tests of tests/kernels. Outputs go to $OUT.
#   bash bench/ab_w4a16.sh   (run from the repository root, main_kernels/ staged beside quantkit's sources:
#   cp -r MAIN/kernels main_kernels && sed -i 's/quantkit\.kernels/main_kernels/g' main_kernels/*.py)
set -o pipefail
OUT=${OUT:-bench/results}
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
SHAPES=${SHAPES:-4096x4096,14336x4096,28672x8192}
MS=${MS:-1,16,1024}
{
  echo "== tuner"; timeout ${TUNE_S:-170} python3 bench/tune_w4a16.py --deadline ${TUNE_DEADLINE:-120} --out kernels/w4a16_h200.json
  cp kernels/w4a16_h200.json $OUT/w4a16_h200.json
  echo "== A/B: main"; QUANTKIT_W4A16_MODULE=main_kernels.w4a16 timeout ${AB_S:-75} python3 bench/bench_w4a16.py \
      --shapes $SHAPES --ms $MS --out $OUT/ab_main.json
  echo "== A/B: branch"; timeout ${AB_S:-75} python3 bench/bench_w4a16.py --shapes $SHAPES --ms $MS --out $OUT/ab_branch.json
  echo "== pytest -m gpu tests/kernels"; timeout ${TEST_S:-170} python3 -m pytest -q -m gpu tests/kernels -n 8 -p no:cacheprovider 2>&1 | tail -40
} 2>&1 | tee $OUT/gpu_log.txt
rm -f $OUT/*.png
