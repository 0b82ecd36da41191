"""bench/bench_moe.py end to end on the CPU (``--tiny``: 2 layers of a small Qwen3-MoE-shaped model, 4 x 64
calibration tokens): GPTQ, AWQ and the serving rows run and the JSON holds them, so that the H200 run of the
full shape does not find a broken script (its kernel section needs CUDA and is skipped here, saying so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tiny_run_writes_every_cpu_section(tmp_path):
    out = tmp_path / "moe.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "bench_moe.py"), "--tiny", "--device", "cpu",
                           "--batches", "1", "2", "--out", str(out)], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel section skipped" in done.stdout
    record = json.loads(out.read_text())
    assert record["shape"]["num_hidden_layers"] == 2 and record["gptq"]["tokens"] == 4 * 64
    assert record["gptq"]["n_quantized"] > 0 and record["awq"]["seconds"] > 0
    # where each method's layer time goes (the walker's phases and the method's own)
    assert "method.scale_search" in record["awq"]["layer_phases_median"]
    assert record["gptq"]["layer_seconds_median"] > 0 and "method" in record["gptq"]["layer_phases_median"]
    whats = {(r["model"], r["what"]) for r in record["serve"]}
    assert {("int4", "decode b1"), ("bf16", "decode b1"), ("int4", "prefill 2048")} <= whats
    assert record["int4_over_bf16_decode_b1"] > 0 and "kernel" not in record
