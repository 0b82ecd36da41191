# Sourced by the two-call device scripts (bench/device_final_s*.sh), after bench/device_budget.sh. The SmolLM2
# GGUF is over one call's 64 MiB of carried paths, so it travels in two halves, one per call; /tmp keeps the
# first half while the machine stays warm (30 s idle), so the second call must follow the first at once.
#   stage_first_half   call A, carrying .stage/smolA and .stage/pplwhl: the wheels the device lacks (gguf,
#                      typer, pydantic) into /tmp/site, GGUF half A into /tmp
#   gpu_suite CAP      call B, carrying .stage/smolB and .stage/data: the GGUF whole into the test cache,
#                      WikiText-2 into ../shared, then the whole GPU suite (log in $OUT/gpu_pytest.txt)
stage_first_half() {
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/pplwhl/*.whl 2>&1 | tail -2
    cp .stage/smolA/part /tmp/partA && echo "GGUF half A in /tmp ($(stat -c %s /tmp/partA) bytes)"
}

gpu_suite() {
    local g=$HOME/.cache/quantkit/smollm2
    mkdir -p "$g" && cat /tmp/partA .stage/smolB/part > "$g/SmolLM2-135M-Instruct.Q4_1.gguf" && ls -l "$g"
    mkdir -p ../shared/data/wikitext2 && cp .stage/data/*.txt ../shared/data/wikitext2/ && ls ../shared/data/wikitext2
    export PYTHONPATH=/tmp/site
    step "$1" python3 -m pytest -m gpu tests -n 12 -q -rfE -p no:cacheprovider 2>&1 | tee "$OUT/gpu_pytest.txt" | tail -40
}
