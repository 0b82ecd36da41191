#!/bin/bash
# Issue 21's sweep on the GPU machine (bench/NOTES_gptq.md, "Session 16"): run from the staged tree
# (.stage/ppl, a copy of the worktree) after the wheels are in /tmp/site and the GGUF is in /tmp/smol.gguf.
#   bash bench/device_gptq_sweep.sh SWEEP_BUDGET_S CLI_LIMIT_S
# In the background: the user's command through the CLI (bench/gptq_target_smollm2.py), as typed and
# with each --mse-weight; in the foreground: bench/gptq_sweep_smollm2.py. Results land in $OUT.
set -o pipefail
export OUT
export PYTHONUNBUFFERED=1 QK_GGUF=/tmp/smol.gguf QK_DATA=$PWD/data
rm -rf /tmp/qk && mkdir -p /tmp/qk && cp -r quantkit /tmp/qk/ && cp -r kernels /tmp/qk/quantkit/kernels \
  && cp -r cli /tmp/qk/quantkit/cli && cp -r calib_data /tmp/qk/quantkit/calib_data || exit 1
export PYTHONPATH=/tmp/qk:/tmp/site
cd bench  # python puts the working folder first on sys.path: not one holding the unmapped quantkit/
python3 -c "import torch; assert not torch.backends.cuda.matmul.allow_tf32; print(torch.get_float32_matmul_precision())"
timeout ${2:-240} bash -c '
  i=0
  for extra in "" "--mse-weight residual" "--mse-weight hessian"; do
    echo "== cli run $i: extra [$extra] t=$SECONDS"
    python3 gptq_target_smollm2.py --out /tmp/ck$i -- $extra && cp results/gptq_target_smollm2_*.json $OUT/cli_$i.json
    rm -f results/gptq_target_smollm2_*.json
    i=$((i + 1))
  done' > $OUT/cli.log 2>&1 &
python3 gptq_sweep_smollm2.py --out $OUT --budget-s ${1:-200} 2>&1 | tee $OUT/sweep.log
wait
cat $OUT/cli.log | grep -v "layer " | tail -40
