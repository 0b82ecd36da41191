#!/bin/bash
# Issue 21's sweep on the GPU machine (bench/NOTES_gptq.md, "Session 16"). Run from a staged copy of the
# worktree (.stage/ppl: the tree without .git/.venv/bench/results, plus data/{valid.tokens.txt,test.raw.txt})
# once the wheels are in /tmp/site and the GGUF in /tmp/smol.gguf. The GGUF is over one call's 64 MiB:
#   call 1, carry [.stage/smolA, .stage/ppl, .stage/pplwhl]:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/pplwhl/*.whl &&
#     cp .stage/smolA/part /tmp/partA          # a carried path is gone in the next call; /tmp stays while warm
#   call 2 at once, carry [.stage/smolB, .stage/ppl]:
#     cat /tmp/partA .stage/smolB/part > /tmp/smol.gguf && cd .stage/ppl && bash bench/device_gptq_sweep.sh 200 230
#
#   bash bench/device_gptq_sweep.sh SWEEP_BUDGET_S CLI_LIMIT_S
# Environment: ROWS (comma-separated rows of bench/gptq_sweep_smollm2.py; default: its phases A, B, C),
# CLI_EXTRAS ('|'-separated extra gptq options, one CLI run each; default: the command as typed, then
# with --mse-weight none). Session 16's call ran CLI_EXTRAS='|--mse-weight residual|--mse-weight hessian'
# (the default then being none). In the background: the user's command through the CLI
# (bench/gptq_target_smollm2.py); in the foreground: bench/gptq_sweep_smollm2.py. Results land in $OUT.
set -o pipefail
export OUT
export PYTHONUNBUFFERED=1 QK_GGUF=/tmp/smol.gguf QK_DATA=$PWD/data CLI_EXTRAS="${CLI_EXTRAS-|--mse-weight none}"
rm -rf /tmp/qk && mkdir -p /tmp/qk && cp -r quantkit /tmp/qk/ && cp -r kernels /tmp/qk/quantkit/kernels \
  && cp -r cli /tmp/qk/quantkit/cli && cp -r calib_data /tmp/qk/quantkit/calib_data || exit 1
export PYTHONPATH=/tmp/qk:/tmp/site
cd bench  # python puts the working folder first on sys.path: not one holding the unmapped quantkit/
python3 -c "import torch; assert not torch.backends.cuda.matmul.allow_tf32; print(torch.get_float32_matmul_precision())"
timeout ${2:-240} bash -c '
  i=0
  IFS="|" read -ra runs <<< "$CLI_EXTRAS|"
  for extra in "${runs[@]}"; do
    [ $i -gt 0 ] && [ -z "$extra" ] && continue  # only the first run may be the bare command
    echo "== cli run $i: extra [$extra] t=$SECONDS"
    python3 gptq_target_smollm2.py --out /tmp/ck$i -- $extra && cp results/gptq_target_smollm2_*.json $OUT/cli_$i.json
    rm -f results/gptq_target_smollm2_*.json
    i=$((i + 1))
  done' > $OUT/cli.log 2>&1 &
python3 gptq_sweep_smollm2.py --out $OUT --budget-s ${1:-200} ${ROWS:+--rows $ROWS} 2>&1 | tee $OUT/sweep.log
wait
grep -v "layer " $OUT/cli.log | tail -40
