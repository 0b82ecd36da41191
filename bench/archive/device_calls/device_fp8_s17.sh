#!/bin/bash
# One device call (session 17, issue #23), run from the repository root of the device's copy of main, with this
# branch staged as .stage/fp8. It ran at commit 85cef16, the library with bench/experimental/
# fp8_q_in_kernel_one_launch_kv.patch applied (not kept: bench/NOTES_attention.md, session 17); apply the patch
# to run it again:
#   1. the one-launch k/v pass's GPU test alone first (its in-launch wait per head is what could hang: a short cap);
#   2. the GPU tests of the fp8 call (the fused passes bit for bit against prepare_fp8, the public call against the
#      kernel on prepare_fp8's operands, the descale paths, the Triton kernel's fp8 tests); their parallel
#      compiles also fill the Triton cache for the benchmark;
#   3. the fp8-call benchmark at 2K/8K/16K tokens, causal and not: the new public call (Q quantized in the
#      warp-specialized kernel, k and v by the one-launch pass) and the session-15 call (two-launch pass over q,
#      k, v + the kernel on e4m3 Q) in the same process (the A/B), each pass and each kernel alone, the error
#      against float32;
#   4. the Gluon attention tests' fp8 cases (the public call through the warp-specialized kernel at GQA 8/2 and
#      varlen), if time is left.
# Each step gets at most its cap and what is left of BUDGET seconds; logs and JSON go to $OUT.
#     OUT=/tmp/out BUDGET=245 bash .stage/fp8/bench/device_fp8_s17.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-245}
ROOT=$(pwd)
t0=$(date +%s)
source "$(dirname "${BASH_SOURCE[0]}")/device_budget.sh"  # step CAP CMD...
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
(cd "$ROOT/.stage/fp8" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) \
    || echo "install failed"
cd "$ROOT/.stage/fp8" || exit 1
python3 -c "import quantkit.kernels.attention as a; print('quantkit.kernels from', a.__file__)"
step 40 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_fp8.py -k one_launch 2>&1 \
    | tee "$OUT/pytest_gpu_one_launch.txt" | tail -6
step 75 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_attention_fp8.py \
    tests/kernels/test_attention.py -k "fp8 and not one_launch" 2>&1 | tee "$OUT/pytest_gpu_fp8.txt" | tail -12
step 130 python3 bench/bench_attention.py --skip-sweep --sections fp8call --seqlens 2048,8192,16384 \
    --out "$OUT" --name s17_fp8_attention_fp8call_h200.json 2>&1 | tee "$OUT/s17_fp8call.log" | tail -12
step 60 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_attention_gluon.py -k "fp8" 2>&1 \
    | tee "$OUT/pytest_gpu_gluon_fp8.txt" | tail -8
echo "== done after $(( $(date +%s) - t0 )) s"
