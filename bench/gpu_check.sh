#!/usr/bin/env bash
# Checks a change on one H200 in two back-to-back device calls: the benchmarks a change must not slow down (with
# the previous main beside the new code in the same call), then the whole GPU suite. Two calls because the test
# model (SmolLM2's GGUF, 92 MB xz-compressed) does not fit one call's 64 MiB of carried files: each call carries
# one half, and /tmp keeps the first half while the machine stays warm (30 s idle), so call 2 must follow at once.
#
# Staging, here, before the calls (all under the git-ignored .stage/):
#   .stage/whl/    cp312 wheels the device lacks (gguf, fastapi, starlette, pydantic, uvicorn, llguidance...); not openai
#                  or hypothesis: no GPU test needs them (the device has hypothesis), and without them the tests
#                  call's carry (whl + smolA + data + the checkout) stays under the 64 MiB limit, which counts disk
#                  blocks (du), not bytes
#   .stage/smolA/part, .stage/smolB/part   the two halves of `xz -1 < SmolLM2-135M-Instruct.Q4_1.gguf`
#   .stage/data/   WikiText-2 test.raw.txt and valid.tokens.txt (from ../shared/data/wikitext2)
#   .stage/old/oldmain.tgz   `git archive OLD quantkit kernels cli calib_data pyproject.toml README.md | gzip`
#   .stage/cutlass/   the nvidia-cutlass wheel (CUTLASS's headers for kernels/w4a16_cutlass.cu; 6 MB):
#                  `pip download -q --no-deps --only-binary=:all: nvidia-cutlass -d .stage/cutlass`
#   .stage/cand/prefill_candidates.json   a bench_w4a16_prefill.py JSON's candidate_entries (the H100's:
#                  `cp bench/results/w4a16_prefill_candidates_h100_3287bc7.json .stage/cand/prefill_candidates.json`)
# Then:
#   call 1, carry [.stage/whl, .stage/smolA, .stage/old]:  bash bench/gpu_check.sh benches BUDGET_S
#   call 2, carry [.stage/smolB, .stage/data]:              bash bench/gpu_check.sh suite BUDGET_S
# or, when only one call fits the device time left (the tests that need the GGUF then skip, saying why):
#   carry [.stage/whl, .stage/data, .stage/old]:          bash bench/gpu_check.sh one BUDGET_S
# or the suite alone, each call useful by itself (where calls are often refused or cut short):
#   carry [.stage/whl, .stage/smolA, .stage/data]:  bash bench/gpu_check.sh tests BUDGET_S
#     (FP8 runtime tests first with full tracebacks, then the rest of the suite, -v so a cut run still says
#     which passed; the GGUF tests skip; part A stays in /tmp)
#   then at once, carry [.stage/smolB] (the tests call left the wheels in /tmp/whl and the data in ../shared; smolB
#   with the data is over the 64 MiB limit):  bash bench/gpu_check.sh gguf BUDGET_S [coldstart]
#     (the tests that need SmolLM2's GGUF; with "coldstart", then bench_serve_coldstart.py on SmolLM2 quantized
#     with GPTQ's defaults: issue 40's measurements, ~6 minutes, BUDGET_S 560)
# Today's defaults against the previous main's on one shape, one machine (the decode and prefill numbers of
# `quantkit bench`): carry [.stage/whl, .stage/old]:  bash bench/gpu_check.sh ab BUDGET_S SHAPE  (~420 for the
# Qwen3-30B-A3B shape)
# Issue 40's cold start as an A/B without the GGUF (a random SmolLM2-shaped model, RTN; .stage/smoltok holds
# SmolLM2's config.json and tokenizer files, saved from the GGUF with transformers' save_pretrained):
#   carry [.stage/whl, .stage/smoltok, .stage/old]:  bash bench/gpu_check.sh coldstart-ab BUDGET_S (~300)
#   (third argument "quick": the new code alone, cold and warm load phases only)
# Issue 39's MoE serving and kernel sections after the MoE GPU tests, no carry needed:
#   bash bench/gpu_check.sh moe BUDGET_S (~420) [bench-only]
# No carry needed either: issue 41's W4A16 decode variants and prefill candidates (`w4a16 470`); issue 39's MoE
# GEMV against the tiled kernel, block and whole step (`moe-decode 400`), the GEMV's maths (`moe-math 260`),
# the step under switches
# (`moe-step BUDGET NAME:VAR=VALUE,...`), its prefill tiles and the step with them (`moe-prefill 430`),
# and its GPTQ / AWQ times (`moe-quantize 590 gptq|awq [LAYERS [cpu]]`); issue 42's tensor-core FP8 GEMM, its configs and
# the 8B step with it (`fp8-mma 480`), and that step under other switches (`fp8-step BUDGET NAME:FORMATS:VARS ...`);
# issue 41's CUDA decode kernel on the card at hand: the 8B step's layers, then the int4 step with the card's CUDA
# candidates beside the shipped table (`w4a16-ab 540`); the same layers timed after the kernel before each in the
# step, and the batch-1 step with the candidates that won there (`w4a16-chain 560`); issue 39's 30B-A3B
# attention cells and the step under their candidates (`pending 150`); issue 42's FP8 GEMV on
# codes tuned on the card and the 8B FP8 step with its picks against without, and o quantized apart (inside its
# GEMV is the default) (`fp8-codes 560 [ROUNDS]`); the suite without the GGUF tests, then that
# once through (`tests-fp8 560`, carry as tests); the FP8 KV cache's GPU tests and the int4 step at 4,096 tokens of
# context with a 16-bit and an FP8 cache (`kv-fp8 480 [SHAPE [1]]`, 1: one round); issue 41's prefill cells at
# 2048 and 4096 rows on a card without entries, then README's 8B cells and a 4096-token prefill with its candidates
# against the shipped table (`prefill-cells-ab 590`, carry .stage/cutlass); the 8B prefill of one prompt length
# with a prefill JSON's candidates against the shipped table, several rounds (`prefill-rows-ab 400 JSON TOKENS`).
# Everything lands in $OUT (JSON of each bench, the suite's log).
# pytest runs with OMP_NUM_THREADS=1: 8-12 xdist workers on 16 cores, each with torch's one thread a core, took
# turns on the cores (the MoE GPU tests, mostly CPU set-up, ran 44-109 s a case on an H100, 2026-12-05).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 COLUMNS=200
BUDGET=${2:-400}
t0=$(date +%s)
source bench/lib/step_budget.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"

install_wheels() {  # the carried cp312 wheels (.stage/whl) into /tmp/site, put on the path of what runs next
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl 2>&1 | tail -2
    export PYTHONPATH=/tmp/site
}

cutlass_headers() {  # CUTLASS's headers from the carried nvidia-cutlass wheel (.stage/cutlass), for the builds
    mkdir -p /tmp/cutlass && python3 -m zipfile -e .stage/cutlass/*.whl /tmp/cutlass
    export QUANTKIT_CUTLASS_DIR=/tmp/cutlass/cutlass_library/source
}

card() {
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "transformers", transformers.__version__)'
    date -u
}

run_suite() {
    step "$1" env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests -n 12 -q -rfE -p no:cacheprovider 2>&1 | tee "$OUT/gpu_pytest.txt" \
        | tail -40
}

run_benches() {  # the previous main installed apart (not editable), run from /tmp: the checkout is off sys.path
    mkdir -p /tmp/old && tar -xzf .stage/old/oldmain.tgz -C /tmp/old
    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite /tmp/old >/dev/null 2>&1 \
        || echo "old main install failed"
    step "$1" python3 -m quantkit.cli.app bench --shape llama3-8b --no-baselines --out "$OUT/bench_8b_new.json"
    (cd /tmp && PYTHONPATH=/tmp/oldsite:/tmp/site step "$2" python3 -m quantkit.cli.app bench --shape llama3-8b \
        --no-baselines --out "$OUT/bench_8b_old.json")
    rm -f "$OUT"/*.png
}

bench_variant() {  # one `quantkit bench` under environment switches: OUT_NAME CAP VAR=VALUE,... BENCH_ARGS...
    # (a comma splits the list only before the next VAR=, so a value may hold commas: ..._CONFIG=2,1)
    local name=$1 cap=$2 vars
    vars=$(sed -E 's/,([A-Z_][A-Z0-9_]*=)/ \1/g' <<< "$3")
    shift 3
    step "$cap" env $vars python3 -m quantkit.cli.app bench --no-baselines "$@" --out "$OUT/$name.json" 2>&1 \
        | tail -14
}

moe_steps() {  # the MoE shape once a NAME:VAR=VALUE,... argument, under those variables (MOE_FORMATS, e.g.
    # int4 or int4,bf16: those rows only, ~35 s a variant for int4 alone)
    local v
    for v in "$@"; do
        bench_variant "bench_30b_${v%%:*}" 120 "${v#*:}" --shape qwen3-30b-a3b --steps 32 --batches 1,8 \
            ${MOE_FORMATS:+--formats "$MOE_FORMATS"}
    done
    rm -f "$OUT"/*.png
}

fp8_steps() {  # the 8B shape once a NAME:FORMATS:VAR=VALUE,... argument, under those variables
    local v name formats vars
    for v in "$@"; do
        IFS=: read -r name formats vars <<< "$v"
        bench_variant "bench_8b_fp8_$name" 100 "$vars" --shape llama3-8b --formats "$formats" --steps 64
    done
    rm -f "$OUT"/*.png
}

gpu_tests() {  # the whole GPU suite but the GGUF tests (the tests mode; the budget's caps: FP8 runtime, the rest)
    install_wheels
    cp -r .stage/whl /tmp/whl && { [ ! -d .stage/smolA ] || cp .stage/smolA/part /tmp/partA; }
    # the CUTLASS kernel's GPU tests build it (else they skip, saying why)
    [ ! -d .stage/cutlass ] || cutlass_headers
    export PIP_NO_INDEX=1  # no network here: the GGUF fixture's pip download fails at once and its tests skip
    mkdir -p ../shared/data/wikitext2 && cp .stage/data/*.txt ../shared/data/wikitext2/
    card | tee "$OUT/card.txt"
    step "$1" env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests/runtime/test_fp8_runtime.py -v -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_pytest_fp8_runtime.txt" | tail -60
    step "$2" env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests -n 12 -v -rfE -p no:cacheprovider --durations=30 \
        --ignore=tests/runtime/test_fp8_runtime.py > "$OUT/gpu_pytest.txt" 2>&1
    grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_pytest.txt" | tail -30
}

fp8_codes() {  # issue 42: the FP8 GEMV on codes (the runtime's kernel at one row) tuned on this card at M = 1,
    # prefetch among the candidates, then the 8B FP8 step as shipped, with the picks (bench/lib/with_fp8_codes_table.py)
    # and with the picks and o's input quantized by a kernel of its own (QUANTKIT_FP8_GEMV_QUANT=apart; inside its
    # GEMV is the default), ROUNDS times (first argument), alternating
    step 170 python3 bench/tune_fp8_gemv.py --path codes --ms 1 --deadline 150 --out "$OUT/fp8_codes_tune.json" \
        2>&1 | tail -16
    local args="--no-baselines --shape llama3-8b --formats fp8 --batches 1,8 --steps 64" i
    for i in $(seq "$1"); do
        step 80 python3 -m quantkit.cli.app bench $args --out "$OUT/bench_8b_fp8_table$i.json" 2>&1 | tail -6
        step 80 python3 bench/lib/with_fp8_codes_table.py "$OUT/fp8_codes_tune.json" bench $args \
            --out "$OUT/bench_8b_fp8_tuned$i.json" 2>&1 | tail -6
        step 80 env QUANTKIT_FP8_GEMV_QUANT=apart python3 bench/lib/with_fp8_codes_table.py \
            "$OUT/fp8_codes_tune.json" bench $args --out "$OUT/bench_8b_fp8_tunedapart$i.json" 2>&1 | tail -6
    done
    rm -f "$OUT"/*.png
}

candidate_table_ab() {  # DECODE_JSON TAG FN: bench_w4a16_decode's candidate entries in DECODE_JSON added for this
    # card to the checkout's W4A16 table (edited on the device only); `FN shipped` with the shipped table, then
    # `FN candidates` with them; the shipped table restored after. Nothing runs where no candidate was found.
    cp kernels/w4a16_h200.json /tmp/w4a16_table_shipped.json
    added=$(python3 bench/lib/add_table_entries.py "$1" kernels/w4a16_h200.json)
    echo "candidate entries added for this card: $added"
    [ "${added:-0}" -gt 0 ] || return 0
    cp kernels/w4a16_h200.json "$OUT/w4a16_table_candidates_$2.json"
    cp /tmp/w4a16_table_shipped.json kernels/w4a16_h200.json
    "$3" shipped
    cp "$OUT/w4a16_table_candidates_$2.json" kernels/w4a16_h200.json
    "$3" candidates
    cp /tmp/w4a16_table_shipped.json kernels/w4a16_h200.json
    rm -f "$OUT"/*.png
}

int4_8b_step() {  # NAME: the 8B int4 step; with the candidates also under the CUDA kernel's plain launch (PDL off)
    bench_variant "bench_8b_int4_$1" 100 "" --shape llama3-8b --formats int4 --steps 32 --batches 1,8
    [ "$1" = candidates ] && bench_variant bench_8b_int4_candidates_plain 100 QUANTKIT_W4A16_CUDA_PDL=0 \
        --shape llama3-8b --formats int4 --steps 32 --batches 1,8
    return 0
}

int4_8b_readme() {  # NAME FORMATS: README's 8B cells (batch 1, 8, 32 and the prefill); ROUND suffix
    bench_variant "bench_8b_$1${ROUND:-}" 170 "" --shape llama3-8b --steps 32 --batches 1,8,32 --formats "$2"
}

int4_8b_round() {  # NAME: the 8B int4 step at batch 1 alone (the chain candidates are M = 1 entries); ROUND suffix
    bench_variant "bench_8b_int4_$1${ROUND:-}" 100 "" --shape llama3-8b --formats int4 --steps 32 --batches 1
}

readme_and_4096() {  # NAME: README's 8B cells (int4; bf16 beside when NAME is candidates), then a 4096-token
    # prefill; ROUND suffix
    local formats=int4
    [ "$1" != candidates ] || formats=int4,bf16
    int4_8b_readme "$1" "$formats"
    bench_variant "bench_8b_p4096_$1${ROUND:-}" 90 "" --shape llama3-8b --steps 8 --batches 1 --prefill-tokens 4096 \
        --formats "$formats"
}

int4_8b_prefill_rows() {  # NAME: the 8B int4 prefill of PREFILL_TOKENS tokens (and a short batch-1 step); ROUND suffix
    bench_variant "bench_8b_p${PREFILL_TOKENS}_$1${ROUND:-}" 90 "" --shape llama3-8b --formats int4 --steps 8 \
        --batches 1 --prefill-tokens "$PREFILL_TOKENS"
}

int4_30b_step() {  # NAME: the Qwen3-30B-A3B int4 step
    MOE_FORMATS=int4 moe_steps "$1:"
}

case "$1" in
one)
    install_wheels
    mkdir -p ../shared/data/wikitext2 && cp .stage/data/*.txt ../shared/data/wikitext2/
    card | tee "$OUT/card.txt"
    run_suite 330
    run_benches 150 110
    ;;
benches)
    install_wheels
    cp .stage/smolA/part /tmp/partA && echo "GGUF part A in /tmp ($(stat -c %s /tmp/partA) bytes)"
    card | tee "$OUT/card.txt"
    run_benches 170 110
    here=$PWD
    step 60 python3 bench/bench_w4a16.py --shapes 28672x8192,4096x4096 --ms 1,16,256,1024 \
        --out "$OUT/w4a16_new.json"
    (cd /tmp && PYTHONPATH=/tmp/oldsite:/tmp/site step 60 python3 "$here/bench/bench_w4a16.py" \
        --shapes 28672x8192,4096x4096 --ms 1,16,256,1024 --out "$OUT/w4a16_old.json")
    rm -f "$OUT"/*.png
    ;;
ab)  # today's defaults beside the previous main's on one shape, the same machine (carry .stage/old, and
    # .stage/whl for typer's pin): `ab BUDGET SHAPE [FORMATS]`, e.g. `ab 420 qwen3-30b-a3b`; decode at batch 1 and
    # 8, 32 steps
    install_wheels
    card | tee "$OUT/card.txt"
    mkdir -p /tmp/old && tar -xzf .stage/old/oldmain.tgz -C /tmp/old
    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite /tmp/old >/dev/null 2>&1 \
        || echo "old main install failed"
    half=$(( (BUDGET - 20) / 2 )) formats=${4:-int4,fp8,bf16}  # a fourth argument: fewer formats, e.g. int4
    step "$half" python3 -m quantkit.cli.app bench --shape "$3" --no-baselines --steps 32 --batches 1,8 \
        --formats "$formats" --out "$OUT/bench_${3}_new.json" 2>&1 | tail -14
    (cd /tmp && PYTHONPATH=/tmp/oldsite:/tmp/site step "$half" python3 -m quantkit.cli.app bench --shape "$3" \
        --no-baselines --steps 32 --batches 1,8 --formats "$formats" --out "$OUT/bench_${3}_old.json" 2>&1 | tail -14)
    rm -f "$OUT"/*.png
    ;;
suite)
    export PYTHONPATH=/tmp/site
    g=$HOME/.cache/quantkit/smollm2
    mkdir -p "$g" && cat /tmp/partA .stage/smolB/part | xz -d > "$g/SmolLM2-135M-Instruct.Q4_1.gguf" && ls -l "$g"
    mkdir -p ../shared/data/wikitext2 && cp .stage/data/*.txt ../shared/data/wikitext2/
    card
    run_suite 460
    ;;
tests)
    gpu_tests 120 600
    ;;
tests-fp8)  # the tests mode, then fp8-codes once through (BUDGET_S ~560, carry as tests; gguf may follow at once)
    gpu_tests 90 240
    fp8_codes 1
    ;;
gguf)
    whl=.stage/whl; [ -d "$whl" ] || whl=/tmp/whl  # carried now (coldstart needs them), or left by the tests call
    [ -d "$whl" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"/*.whl \
        2>&1 | grep -v "^WARNING" | tail -2
    export PYTHONPATH=/tmp/site
    g=$HOME/.cache/quantkit/smollm2
    mkdir -p "$g" && cat /tmp/partA .stage/smolB/part | xz -d > "$g/SmolLM2-135M-Instruct.Q4_1.gguf" && ls -l "$g"
    [ -d .stage/data ] && mkdir -p ../shared/data/wikitext2 && cp .stage/data/*.txt ../shared/data/wikitext2/
    card | tee "$OUT/card.txt"
    step 400 env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests/e2e/test_gpu_runtime.py tests/e2e/test_gpu_serving.py -n 4 -v -rfE \
        -p no:cacheprovider > "$OUT/gpu_pytest_gguf.txt" 2>&1
    grep -E "passed|failed|FAILED|ERROR|SKIPPED" "$OUT/gpu_pytest_gguf.txt" | tail -30
    if [ "${3:-}" = coldstart ]; then  # issue 40's H200 must-show on SmolLM2 quantized here (GPTQ defaults)
        step 90 python3 -m quantkit.cli.app gptq "$g/SmolLM2-135M-Instruct.Q4_1.gguf" -o /tmp/smol-gptq \
            --calib ../shared/data/wikitext2/valid.tokens.txt > "$OUT/smollm2_gptq.log" 2>&1
        # the bench gives the server an empty Triton cache (the suite just before filled the default one)
        step 300 python3 bench/bench_serve_coldstart.py /tmp/smol-gptq --out "$OUT/serve_coldstart_smollm2.json" \
            --server-log "$OUT/serve_coldstart_server.log" 2>&1 | tail -40
    fi
    ;;
coldstart-ab)  # issue 40's cold start, new code against the previous main (.stage/old) in one call, on a random
    # SmolLM2-shaped model (carried config and tokenizer, .stage/smoltok) quantized with RTN here: no GGUF to carry
    # in two halves; start-up compiles and serving speed do not depend on the weights' values.
    install_wheels
    if [ "${3:-}" != quick ]; then
        mkdir -p /tmp/old && tar -xzf .stage/old/oldmain.tgz -C /tmp/old
        python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite /tmp/old >/dev/null 2>&1 \
            || echo "old main install failed"
    fi
    card | tee "$OUT/card.txt"
    step 60 python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(".stage/smoltok")
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
model.save_pretrained("/tmp/smolrand")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".stage/smoltok/{f}", "/tmp/smolrand/")
print("wrote /tmp/smolrand")
PY
    step 60 python3 -m quantkit.cli.app rtn /tmp/smolrand -o /tmp/smol-rtn > "$OUT/smol_rtn.log" 2>&1; tail -3 "$OUT/smol_rtn.log"
    here=$PWD
    if [ "${3:-}" = quick ]; then  # the new code's cold start alone, load phases only (~60 s after the model)
        step 120 python3 bench/bench_serve_coldstart.py /tmp/smol-rtn --load-only --out "$OUT/serve_coldstart_new.json" \
            --server-log "$OUT/serve_coldstart_new_server.log" 2>&1 | tail -12
        exit 0
    fi
    # the bench gives each server an empty Triton cache of its own: with a shared one the second run loads what
    # the first compiled (the first A/B of 2026-12-05 ran so, and its second run looked warm from the start)
    step 140 python3 bench/bench_serve_coldstart.py /tmp/smol-rtn --out "$OUT/serve_coldstart_new.json" \
        --server-log "$OUT/serve_coldstart_new_server.log" 2>&1 | tail -15
    (cd /tmp && PYTHONPATH=/tmp/oldsite:/tmp/site step 140 python3 "$here/bench/bench_serve_coldstart.py" /tmp/smol-rtn \
        --out "$OUT/serve_coldstart_old.json" --server-log "$OUT/serve_coldstart_old_server.log" 2>&1 | tail -15)
    ;;
moe)  # issue 39 on one GPU: the MoE GPU tests first (CUDA-graph capture of the int4 experts), then bench_moe.py's
    # serving and kernel sections on the Qwen3-30B-A3B shape (~5 minutes on an H200); GPTQ/AWQ: --skip serve kernel
    card | tee "$OUT/card.txt"
    [ "${3:-}" = bench-only ] || step 120 env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests/moe tests/kernels/test_moe_w4a16.py -q -rfE \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_pytest_moe.txt" | tail -15  # "bench-only": the suite just ran them
    step 420 python3 bench/bench_moe.py --skip gptq awq --out "$OUT/bench_moe_serve_kernel.json" 2>&1 | tail -30
    ;;
w4a16)  # issue 41: every decode variant (the CUDA C++ GEMM built with nvcc, Gluon configs) checked against the
    # reference, then timed beside today's pick, cuBLAS and torch int4 (~5 minutes, BUDGET_S 480); then the
    # prefill sizes with dequantize-then-cuBLAS beside the planned kernel and cuBLAS (~3 minutes)
    card | tee "$OUT/card.txt"
    # at batch 1 and 8: the Llama-3-8B step's linears (gate_up, down, q/k/v, o as the runtime fuses them), the
    # Qwen3-30B-A3B shape's dense q/k/v and o (issue 39's step), then README's two large layers
    step 290 python3 bench/bench_w4a16_decode.py --deadline 250 --out "$OUT/w4a16_decode.json" --ms 1,8 \
        --shapes 28672x4096,4096x14336,6144x4096,5120x2048,4096x4096,2048x4096,28672x8192,8192x28672 2>&1 | tail -70
    step 170 python3 bench/bench_w4a16.py --shapes 28672x8192,8192x28672,4096x4096 --ms 256,1024,4096 \
        --deadline 130 --out "$OUT/w4a16_prefill.json" 2>&1 | tail -20
    rm -f "$OUT"/*.png
    ;;
moe-decode)  # issue 39 at decode (BUDGET_S ~400): the GEMV against the tiled kernel, one layer's block replayed
    # from a graph (the kernel section at M = 1, 8, 32, with its sweeps, the fused router and the block's kernels),
    # then the whole step at batch 1 and 8 with the defaults and with PDL on the MoE kernels (opt-in) (~6 minutes)
    card | tee "$OUT/card.txt"
    step 200 python3 bench/bench_moe.py --skip gptq awq serve --kernel-m 1 8 32 --out "$OUT/bench_moe_kernel.json" 2>&1 | tail -25
    moe_steps default: pdl:QUANTKIT_MOE_PDL=1
    ;;
moe-step)  # issue 39: `quantkit bench --shape qwen3-30b-a3b` at batch 1 and 8 once a VARIANT (third argument on):
    # NAME:VAR=VALUE,VAR=VALUE... (environment switches; "default:" for none), ~60-90 s each, one after another.
    # A value with commas goes in the call's own environment instead (it reaches every variant):
    #   QUANTKIT_MOE_GEMV_CONFIG=64,4,512 bash bench/gpu_check.sh moe-step 120 cfg64:
    # e.g. `moe-step 200 default: convert:QUANTKIT_MOE_FP8_DOT=convert rows:QUANTKIT_MOE_GEMV_MATH=rows`
    card | tee "$OUT/card.txt"
    shift 2
    moe_steps "$@"
    ;;
moe-math)  # issue 39 (BUDGET_S ~260): the 4-bit expert GEMV's maths (moe_gemv.MATHS) on the GPU: its GPU tests
    # (each math against the reference, pipelined and plain), then the whole step with the default ("offset",
    # inline-PTX dequantization) and with "rows" (the default before), ~4 minutes on an H100
    card | tee "$OUT/card.txt"
    step 90 env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests/kernels/test_moe_gemv.py -n 4 -q -p no:cacheprovider \
        2>&1 | tail -5
    moe_steps default: rows:QUANTKIT_MOE_GEMV_MATH=rows
    ;;
fp8-mma)  # issue 42 (BUDGET_S ~480): the tensor-core FP8 GEMM (the default for 2..64 rows since 2026-12-06):
    # the GPU tests of the FP8 decode paths, the GEMM's configs at the 8B linears (M = 1, 8, 32) beside today's FP8
    # linear and bf16, then the 8B bench of FP8 and bf16 with the defaults and of FP8 with the defaults before
    # (the GEMV up to 4 rows, _scaled_mm above, the separate quantization kernel) (~8 minutes)
    card | tee "$OUT/card.txt"
    step 150 env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests/kernels/test_gemv_fp8_mma.py \
        tests/runtime/test_fp8_runtime.py -n 4 -q -p no:cacheprovider 2>&1 | tail -5
    step 90 python3 bench/tune_fp8_mma.py --deadline 75 --out "$OUT/fp8_mma.json" 2>&1 | tail -16
    fp8_steps default:fp8,bf16: before:fp8:QUANTKIT_FP8_GEMV=unfused,QUANTKIT_FP8_FUSED_QUANT=0
    ;;
fp8-step)  # issue 42: `quantkit bench --shape llama3-8b --formats FORMATS` once a VARIANT (third argument on):
    # NAME:FORMATS:VAR=VALUE,VAR=VALUE... (FORMATS comma-separated: fp8 or fp8,bf16), ~60-90 s each, e.g.
    #   bash bench/gpu_check.sh fp8-step 400 default:fp8,bf16: fused:fp8:QUANTKIT_FP8_GEMV=fused,QUANTKIT_FP8_FUSED_QUANT=0 \
    #       mma:fp8:QUANTKIT_FP8_GEMV=mma
    card | tee "$OUT/card.txt"
    shift 2
    fp8_steps "$@"
    ;;
moe-prefill)  # issue 39 at prefill (BUDGET_S ~430): the fused kernel's tiles at 256 and 2048 rows (BLOCK_M 16/32/64)
    # as graph replays, each checked against the default's output (~1 minute on an H100), then the whole bench (its
    # prefill of 2048 tokens) with moe_w4a16.TILE_CONFIGS and with the plain tiles (QUANTKIT_MOE_TILES=plain)
    card | tee "$OUT/card.txt"
    step 200 python3 bench/bench_moe.py --skip gptq awq serve --kernel-m 256 2048 --out "$OUT/bench_moe_prefill.json" \
        2>&1 | tail -12
    moe_steps default: plain:QUANTKIT_MOE_TILES=plain
    ;;
w4a16-ab)  # issue 41 on the card at hand in one call (BUDGET_S ~480): the 8B step's layers at M 1 and 8, the CUDA
    # variants beside today's pick; where CUDA beat the pick (bench_w4a16_decode's candidate_entries), the 8B int4
    # step with the shipped table, then with the candidates added for this card (the checkout's table, edited on
    # the device only and restored after), then the same with the CUDA kernel's plain launch (PDL off)
    card | tee "$OUT/card.txt"
    step 200 python3 bench/bench_w4a16_decode.py --deadline 170 --out "$OUT/w4a16_decode.json" --ms 1,8 \
        --shapes 28672x4096,4096x14336,6144x4096,4096x4096 2>&1 | tail -40
    candidate_table_ab "$OUT/w4a16_decode.json" 8b int4_8b_step
    ;;
w4a16-chain)  # issue 41 on the card at hand in one call (BUDGET_S ~560): the 8B step's layers at M = 1 timed after
    # the kernel before each in the step (bench_w4a16_chain.py), then, where a variant beat the pick there, the 8B
    # int4 step at batch 1 with the shipped table and with the candidates for this card, twice, alternating
    card | tee "$OUT/card.txt"
    step 230 python3 bench/bench_w4a16_chain.py --deadline 200 --out "$OUT/w4a16_chain.json" 2>&1 | tail -80
    ROUND=1 candidate_table_ab "$OUT/w4a16_chain.json" chain int4_8b_round
    ROUND=2 candidate_table_ab "$OUT/w4a16_chain.json" chain2 int4_8b_round
    ;;
w4a16-prefill)  # issue 41's prefill cells on the card at hand in one call (BUDGET_S ~480, carry .stage/cutlass: the
    # nvidia-cutlass wheel, `pip download --no-deps nvidia-cutlass`): today's pick, the CUTLASS mixed-input GEMM's
    # configs (built here first), dequantize-then-cuBLAS and cuBLAS on the 8B layers at 256-4096 rows (third
    # argument: the rows, e.g. 2048,256,1024, in that order; fourth argument "ab": then the 8B int4 prefill and
    # batch-1 step with the shipped table and with this run's candidate entries, one round, BUDGET_S ~580)
    card | tee "$OUT/card.txt"
    cutlass_headers
    deadline=$([ "${4:-}" = ab ] && echo 200 || echo 320)
    step 400 python3 bench/bench_w4a16_prefill.py --deadline $deadline ${3:+--ms "$3"} \
        --out "$OUT/w4a16_prefill.json" 2>&1 | tail -120
    [ "${4:-}" = ab ] && ROUND=1 candidate_table_ab "$OUT/w4a16_prefill.json" prefill_here int4_8b_round
    step 80 python3 -m pytest -m gpu tests/kernels/test_w4a16_cutlass.py -q -p no:cacheprovider 2>&1 | tail -8
    ;;
w4a16-prefill-ab)  # issue 41 (BUDGET_S ~420, carry .stage/cutlass and .stage/cand: prefill_candidates.json, the
    # candidate_entries of bench_w4a16_prefill.py): every CUTLASS config built first (in parallel), then the 8B int4
    # prefill and batch-1 step with the shipped table and with the candidates for this card, twice, alternating
    card | tee "$OUT/card.txt"
    cutlass_headers
    step 120 python3 bench/bench_w4a16_prefill.py --shapes 4096x4096 --ms 256 --deadline 1 --out /tmp/prebuild.json \
        2>&1 | head -3
    rounds=${3:-2}
    ROUND=1 candidate_table_ab .stage/cand/prefill_candidates.json prefill int4_8b_round
    [ "$rounds" -lt 2 ] || ROUND=2 candidate_table_ab .stage/cand/prefill_candidates.json prefill2 int4_8b_round
    ;;
prefill-table-ab)  # issue 41's README cells, the checkout's W4A16 table beside the one before it (BUDGET_S ~560,
    # carry .stage/cutlass and .stage/cand: table_before.json): the CUTLASS builds the table's entries name made
    # first, then `quantkit bench` on the 8B shape at batch 1, 8 and 32 and the prefill, int4 with the table before,
    # int4 with the checkout's and bf16 beside it, twice alternating (a third argument 1: once; a fourth, e.g.
    # 256,1024,4096: then the prefill cells at those row counts, as many as 150 s allow)
    card | tee "$OUT/card.txt"
    cutlass_headers
    step 150 python3 bench/bench_w4a16_prefill.py --build-table kernels/w4a16_h200.json
    cp kernels/w4a16_h200.json /tmp/w4a16_table_checkout.json
    for round in 1 $([ "${3:-2}" = 1 ] || echo 2); do
        cp .stage/cand/table_before.json kernels/w4a16_h200.json
        ROUND=$round int4_8b_readme before int4
        cp /tmp/w4a16_table_checkout.json kernels/w4a16_h200.json
        ROUND=$round int4_8b_readme checkout int4,bf16
    done
    rm -f "$OUT"/*.png
    [ -z "${4:-}" ] || step 230 python3 bench/bench_w4a16_prefill.py --deadline 150 --ms "$4" \
        --out "$OUT/w4a16_prefill_more.json" 2>&1 | tail -40  # a fourth argument: prefill cells at more row counts
    ;;
prefill-then-tests)  # one call where device time is short (BUDGET_S ~590; carry .stage/whl, .stage/data,
    # .stage/cutlass): the prefill cells at 2048 rows on the card at hand (bench_w4a16_prefill.py, CUTLASS builds
    # first), the GPU suite without the GGUF tests, then with what time is left the 8B int4 prefill and batch-1 step
    # with the shipped table and with the cells' candidate entries, one round
    card | tee "$OUT/card.txt"
    cutlass_headers
    step 220 python3 bench/bench_w4a16_prefill.py --deadline 100 --ms 2048 --out "$OUT/w4a16_prefill.json" 2>&1 \
        | tail -60
    gpu_tests 60 240
    ROUND=1 candidate_table_ab "$OUT/w4a16_prefill.json" prefill_here int4_8b_round
    ;;
prefill-cells-ab)  # issue 41 on a card whose table lacks prefill entries, one call (BUDGET_S ~590; carry
    # .stage/cutlass): the prefill cells at 2048 and 4096 rows (or MS, third argument, within DEADLINE s, fourth;
    # default 200, the builds included; CUTLASS builds first), then, where a config beat
    # today's pick (candidate_entries), README's 8B cells (batch 1, 8, 32, prefill of 2048) and a prefill of 4096
    # tokens with the shipped table, then with the candidates added for this card and bf16 beside, one round
    card | tee "$OUT/card.txt"
    cutlass_headers
    step 300 python3 bench/bench_w4a16_prefill.py --deadline "${4:-200}" --ms "${3:-2048,4096}" \
        --out "$OUT/w4a16_prefill.json" 2>&1 | tail -60
    ROUND=1 candidate_table_ab "$OUT/w4a16_prefill.json" prefill_cells readme_and_4096
    ;;
prefill-rows-ab)  # issue 41 at one prompt length (BUDGET_S ~400; carry .stage/cutlass and .stage/cand): the 8B int4
    # prefill of TOKENS (fourth argument) with the shipped table, then with the candidate entries of CANDIDATES (a
    # bench_w4a16_prefill.py JSON, third argument) added for this card, ROUNDS times (fifth, default 3), alternating;
    # the CUTLASS configs the candidates name are built first
    card | tee "$OUT/card.txt"
    cutlass_headers
    export PREFILL_TOKENS=$4
    cp kernels/w4a16_h200.json /tmp/w4a16_table_with.json
    python3 bench/lib/add_table_entries.py "$3" /tmp/w4a16_table_with.json >/dev/null
    step 150 python3 bench/bench_w4a16_prefill.py --build-table /tmp/w4a16_table_with.json
    for round in $(seq "${5:-3}"); do
        ROUND=$round candidate_table_ab "$3" "rows$round" int4_8b_prefill_rows
    done
    ;;
pending)  # issue 39 on the card at hand in one call (BUDGET_S ~150): the 30B-A3B attention projections' decode
    # cells (no H200 entry yet) and, where a CUDA variant beat the pick (candidate_entries), the 30B int4 step with the shipped table,
    # then with the candidates added for this card (the checkout's table, edited on the device only and restored)
    card | tee "$OUT/card.txt"
    step 100 python3 bench/bench_w4a16_decode.py --deadline 80 --ms 1,8 --shapes 5120x2048,2048x4096 \
        --out "$OUT/w4a16_decode_30b.json" 2>&1 | tail -24
    candidate_table_ab "$OUT/w4a16_decode_30b.json" 30b int4_30b_step
    ;;
fp8-codes)  # issue 42's FP8 GEMV on codes tuned here, then the 8B step three ways, twice (BUDGET_S ~560, no carry;
    # a third argument: that many rounds)
    card | tee "$OUT/card.txt"
    fp8_codes "${3:-2}"
    ;;
moe-quantize)  # issue 39's 10-minute targets: GPTQ (third argument gptq, the default) or AWQ (awq) with the
    # defaults on 128 x 2048 tokens, on the first LAYERS (fourth argument, default 16) of the Qwen3-30B-A3B shape:
    # LAYERS 48 is the whole model (GPTQ's layers 5.8 s each on an H100, 7.7 s from host memory); fewer, and the whole is the per-layer time x 48 (the
    # layers are alike; the log prints each layer's seconds). Fifth argument cpu: the model built in host memory,
    # the walker moving one layer at a time to the GPU, as a model loaded from disk is (default: built on the GPU).
    # Peak device and host memory in the JSON.
    card | tee "$OUT/card.txt"
    m=${3:-gptq}; other=$([ "$m" = gptq ] && echo awq || echo gptq)
    step 560 python3 bench/bench_moe.py --skip "$other" serve kernel --layers "${4:-16}" ${5:+--model-device "$5"} \
        --out "$OUT/bench_moe_$m.json" 2>&1 | tee "$OUT/bench_moe_$m.log" | tail -60  # the log survives a cut
    ;;
kv-fp8)  # the FP8 KV cache (issue 42's option): its GPU tests, then `quantkit bench` on the 8B shape (third argument:
    # another shape) in int4 with 4,096 prompt tokens before the timed decode steps, the cache 16-bit then FP8, twice
    # alternating (BUDGET_S ~480, no carry; fourth argument 1: one round, BUDGET_S ~300)
    card | tee "$OUT/card.txt"
    step 120 env OMP_NUM_THREADS=1 python3 -m pytest -m gpu tests/kernels/test_kv_fp8.py tests/runtime/test_kernels_backend.py \
        -k "fp8" -q -rfE -p no:cacheprovider 2>&1 | tail -5
    rounds=("" 2); [ "${4:-2}" = 1 ] && rounds=("")
    for round in "${rounds[@]}"; do
        for kv in auto fp8; do
            bench_variant "bench_kv${kv}${round}" 150 "" --shape "${3:-llama3-8b}" --formats int4 --steps 64 \
                --batches 1,8,32 --context 4096 --kv-cache-dtype "$kv"
        done
    done
    rm -f "$OUT"/*.png
    ;;
*) echo "usage: gpu_check.sh benches|suite|one|tests|gguf|coldstart-ab|moe|w4a16|moe-decode|moe-math|moe-step|moe-prefill|moe-quantize|fp8-mma|fp8-step|w4a16-ab|w4a16-chain|w4a16-prefill|w4a16-prefill-ab|prefill-table-ab|prefill-then-tests|prefill-cells-ab|prefill-rows-ab|pending|fp8-codes|tests-fp8|kv-fp8|ab BUDGET_S"; exit 2 ;;
esac
