#!/bin/bash
# One device call for issue #28, session 16 (bench/NOTES_gptq.md): GPU tests of what changed, AWQ and
# GPTQ --desc-act on Llama-3-8B shapes (32 layers, 128 x 2048), llm-compressor's GPTQ on 8 layers of the
# same model, then the Qwen2.5-14B-shaped model quantized from disk. Ordered by importance, each step
# under its own timeout; one log ($OUT/run.log) and one JSON per step under $OUT.
# Run from a staged copy: cd .stage/quant && bash bench/device_quant_s16.sh  (wheels copied into .whl_llmc/ of the staged copy)
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LOG=$OUT/run.log
t00=$SECONDS
step() { echo "[$1: $((SECONDS - t0)) s, $((SECONDS - t00)) s in all]" | tee -a $LOG; t0=$SECONDS; }
t0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed" | tee -a $LOG
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; df -h /tmp | tail -1; free -g | head -2
  python3 -m pip list 2>/dev/null | grep -i -E "^(pyarrow|fsspec|typing.extensions|accelerate|huggingface.hub|transformers|torch) "; } 2>&1 | tee -a $LOG
step setup
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_awq_fake_quant.py 2>&1 \
  | tail -8 | tee -a $LOG
step tests
timeout 100 python3 bench/bench_quantize_8b.py --method awq --asym --out $OUT/awq_32.json 2>&1 | tee -a $LOG | tail -14
step awq
timeout 110 python3 bench/bench_quantize_8b.py --method gptq --desc-act --out $OUT/gptq_32.json 2>&1 \
  | tee -a $LOG | tail -16
step gptq
# llm-compressor from carried wheels, in /tmp/site for this step only (its pydantic/typing_extensions)
( python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl_llmc/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site
  mkdir -p /tmp/llmc && cd /tmp/llmc && timeout 150 python3 $OLDPWD/bench/peer_llmcompressor_gptq_8b.py --layers 8 \
    --out $OUT/llmc_gptq_8.json 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -40 ) 2>&1 | tee -a $LOG
step llmcompressor
# the ~30 GB model and its checkpoint on the machine's disk (not on /tmp if that is memory)
W=/tmp/qk14; [ "$(findmnt -n -o FSTYPE -T /tmp)" = tmpfs ] && W=$PWD/.qk14
echo "from-disk workdir $W ($(findmnt -n -o FSTYPE -T $(dirname $W)))" | tee -a $LOG
timeout 400 python3 bench/bench_quantize_from_disk.py --nsamples 16 --workdir $W \
  --options '{"desc_act": true, "static_groups": false, "mse": false}' --out $OUT/from_disk_14b.json 2>&1 \
  | tee -a $LOG | tail -30
step from_disk
