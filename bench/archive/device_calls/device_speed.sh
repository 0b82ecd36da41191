#!/bin/bash
# One device call for issue #28 (speed, device memory) and #25 (GPU test, A/B); see bench/NOTES_gptq.md.
# Run from the repository root of a staged copy: .stage/speed (this branch) beside .stage/speed_base
# (`git archive fe609c5`, the commit before the distributed code). Logs and JSON go to $OUT.
# Needs ~6 minutes on a warm H200 (the 2026-12-02 call gave the GPTQ step 85 s: too short by ~5 s).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
t0=$SECONDS
timeout 120 python3 bench/bench_quantize_8b.py --method gptq --desc-act --out $OUT/gptq_32.json 2>&1 \
  | tee $OUT/gptq_32.log | tail -16
echo "[gptq step $((SECONDS - t0)) s]"; t0=$SECONDS
timeout 100 python3 bench/bench_quantize_8b.py --method awq --asym --out $OUT/awq_32.json 2>&1 \
  | tee $OUT/awq_32.log | tail -14
echo "[awq step $((SECONDS - t0)) s]"; t0=$SECONDS
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_walker_activations.py \
  tests/distributed/test_ranks.py 2>&1 | tee $OUT/tests.log | tail -6
echo "[tests step $((SECONDS - t0)) s]"; t0=$SECONDS
# A/B (#25): the same 4-layer GPTQ work (single pass, column loop) on this branch with --gpus 1 ...
timeout 60 python3 bench/bench_quantize_8b.py --method gptq --layers 4 --gpus 1 --solver torch \
  --single-pass-tokens 524288 --out $OUT/ab_branch.json 2>&1 | tee $OUT/ab.log | grep -E "^total|layer total"
# ... and on the commit before the distributed code (no --gpus, --solver or --single-pass-tokens there).
cd ../speed_base && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 60 python3 bench/bench_quantize_8b.py --method gptq --layers 4 --out $OUT/ab_base.json 2>&1 \
  | tee -a $OUT/ab.log | grep -E "^total|layer total"
echo "[ab step $((SECONDS - t0)) s]"
