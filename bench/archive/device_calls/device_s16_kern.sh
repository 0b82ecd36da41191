#!/bin/bash
# One device call (session 16, issue #23), run from the repository root of the device's copy of main, with this
# branch staged as .stage/kern and main at 26e4c85 as .stage/kern_base:
#   1. the GPU tests of the kernels this branch touched (fp8 quantization, both Gluon attention kernels, the
#      Triton kernel's fp8 path, decode attention; the bf16 varlen cases of the Gluon kernels at their default
#      configs only: the other bf16 configs' code is unchanged, the lead's whole GPU suite runs them);
#   2. the public FP8 call against bf16 at 2K/8K/16K tokens, causal and not, with the error against float32;
#   3. the A/B of README's tables, new then old: bench_w4a16 (decode and prefill cells of the A/B table) and
#      bench_attention (the ws and fp8 ws columns at 16 heads, head dim 128, with cuDNN);
#   4. the W4A16 timing gap between the tuner and the benchmark (bench/experimental/w4a16_timing_gap.py).
# Each step gets at most its cap and what is left of BUDGET seconds; logs and JSON go to $OUT.
#     OUT=/tmp/out BUDGET=205 bash .stage/kern/bench/device_s16_kern.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-205}
ROOT=$(pwd)
t0=$(date +%s)
source "$(dirname "${BASH_SOURCE[0]}")/device_budget.sh"  # step CAP CMD...
install() {  # the editable install maps quantkit.kernels to that tree's kernels/
    (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || echo "install failed: $1"
    python3 -c "import quantkit.kernels.attention as a; print('quantkit.kernels from', a.__file__)"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
AB_W4A16="--shapes 28672x8192 --ms 1,16,1024"
S=/tmp/res  # the benchmarks also draw plots: only the JSON is copied to $OUT (8 files come back at most)
mkdir -p $S
keep() { cp "$S/$1" "$OUT/$1" 2>/dev/null || echo "no $1"; }

install "$ROOT/.stage/kern"
cd "$ROOT/.stage/kern" || exit 1
step 55 python3 -m pytest -q -n 16 -p no:cacheprovider tests/kernels/test_attention_fp8_quant.py \
    tests/kernels/test_attention_gluon.py tests/kernels/test_decode_attention.py \
    tests/kernels/test_decode_attention_rope.py tests/kernels/test_attention.py::test_gpu_fp8 \
    tests/kernels/test_attention.py::test_fp8_path_interpreter_or_gpu \
    tests/kernels/test_attention.py::test_kv_aligned_hint_gives_the_same_result \
    -k "not test_gluon_varlen_gqa or None" 2>&1 \
    | tee "$OUT/pytest_gpu_kern.txt" | tail -25
step 40 python3 bench/bench_attention.py --skip-sweep --sections fp8call --seqlens 2048,8192,16384 \
    --out $S --name attention_fp8call_s16.json 2>&1 | tail -9
keep attention_fp8call_s16.json
step 25 python3 bench/bench_w4a16.py $AB_W4A16 --out $S/ab_w4a16_new.json 2>&1 | tail -3
keep ab_w4a16_new.json
step 25 python3 bench/bench_attention.py --variants "ws default,fp8 ws default" --sections prefill --peers cudnn \
    --seqlens 2048,16384 --heads 16/16/128 --out $S --name ab_attention_new.json 2>&1 | tail -6
keep ab_attention_new.json
step 10 python3 bench/experimental/w4a16_timing_gap.py --out $S 2>&1 | tail -2
keep w4a16_timing_gap.json

install "$ROOT/.stage/kern_base"
cd "$ROOT/.stage/kern_base" || exit 1
step 20 python3 bench/bench_w4a16.py $AB_W4A16 --out $S/ab_w4a16_base.json 2>&1 | tail -3
keep ab_w4a16_base.json
step 30 python3 bench/bench_attention.py --variants "ws default,fp8 ws default" --sections prefill --peers cudnn \
    --seqlens 2048,16384 --heads 16/16/128 --out $S --name ab_attention_base.json 2>&1 | tail -6
keep ab_attention_base.json
echo "== done after $(( $(date +%s) - t0 )) s"
