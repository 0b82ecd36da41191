#!/bin/bash
# One device call for issue #28, session 17 (bench/NOTES_gptq.md): GPU tests of what changed (the fused AWQ clip
# search, the walker's overlapped layer traffic), AWQ asym g128 on Llama-3-8B shapes (32 layers, 128 x 2048; target
# < 30 s), the Qwen2.5-14B-shaped model quantized from disk with GPTQ (never measured yet), then GPTQ --desc-act on
# the 8B shapes (32 layers; re-time). Ordered by importance; every step under its own timeout and inside BUDGET
# seconds in all (bench/device_budget.sh), so the from-disk step gets its ~240 s even when an earlier one overruns.
# Run from a staged copy: cd .stage/quant && BUDGET=390 bash bench/device_quant_s17.sh  (logs and JSON under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
BUDGET=${BUDGET:-390}
t0=$(date +%s)
source bench/device_budget.sh
LOG=$OUT/run.log
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed" | tee -a $LOG
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; df -h /tmp | tail -1; free -g | head -2
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} 2>&1 | tee -a $LOG
step 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_awq_clip.py tests/test_layer_pipeline.py \
  tests/kernels/test_awq_fake_quant.py 2>&1 | tail -12 | tee -a $LOG
step 100 python3 bench/bench_quantize_8b.py --method awq --asym --out $OUT/awq_32.json 2>&1 | tee $OUT/awq_32.log \
  | tail -16 | tee -a $LOG
if ! grep -q "^total" $OUT/awq_32.log; then  # the overlap is new: a failed run is repeated without it, and
  export QUANTKIT_OVERLAP=0                       # the later steps run without it too
  step 100 python3 bench/bench_quantize_8b.py --method awq --asym --no-overlap --out $OUT/awq_32_inline.json 2>&1 \
    | tail -16 | tee -a $LOG
fi
# the ~30 GB model and its checkpoint on the machine's disk (not on /tmp if that is memory)
W=/tmp/qk14; [ "$(findmnt -n -o FSTYPE -T /tmp)" = tmpfs ] && W=$PWD/.qk14
echo "from-disk workdir $W ($(findmnt -n -o FSTYPE -T $(dirname $W)))" | tee -a $LOG
step 240 python3 bench/bench_quantize_from_disk.py --nsamples 16 --workdir $W \
  --options '{"desc_act": true, "static_groups": false, "mse": false}' --out $OUT/from_disk_14b.json 2>&1 \
  | grep -v -E "^\s*$" | tee $OUT/from_disk_14b.log | tail -24 | tee -a $LOG
rm -rf $W
step 110 python3 bench/bench_quantize_8b.py --method gptq --desc-act --out $OUT/gptq_32.json 2>&1 \
  | tee $OUT/gptq_32.log | tail -18 | tee -a $LOG
echo "== done after $(( $(date +%s) - t0 )) s" | tee -a $LOG
