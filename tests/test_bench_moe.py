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
    # what runs before the first layer is printed as it ends (a cut device call still shows where its time went)
    assert "model built in" in done.stdout and "experts unfused in" in done.stdout
    record = json.loads(out.read_text())
    assert record["shape"]["num_hidden_layers"] == 2 and record["gptq"]["tokens"] == 4 * 64
    assert record["gptq"]["n_quantized"] > 0 and record["awq"]["seconds"] > 0
    # where each method's layer time goes (the walker's phases and the method's own)
    assert "method.scale_search" in record["awq"]["layer_phases_median"]
    assert record["gptq"]["layer_seconds_median"] > 0 and "method" in record["gptq"]["layer_phases_median"]
    for method in ("gptq", "awq"):  # the whole model's cost: the experts' unfuse and the walk
        r = record[method]
        assert r["unfuse_seconds"] >= 0 and r["total_seconds"] == r["unfuse_seconds"] + r["seconds"]
        assert r["build_seconds"] > 0 and r["peak_host_gib"] > 0
        assert f"{method}: 2 layers in" in done.stdout
    whats = {(r["model"], r["what"]) for r in record["serve"]}
    assert {("int4", "decode b1"), ("bf16", "decode b1"), ("int4", "prefill 2048")} <= whats
    assert record["int4_over_bf16_decode_b1"] > 0 and "kernel" not in record


def test_decode_timings_rotate_over_routings_that_cover_the_experts():
    """The kernel section's routings: at batch 1, 16 disjoint sets of 8 among 128 experts (every expert once, so a
    graph replay reads ~16 x one routing's weights, past L2), weights renormalized; larger batches random top-k;
    a list of outputs compares as one vector."""
    import importlib.util

    import torch

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("bench_moe", REPO / "bench" / "bench_moe.py")
    bench_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_moe)
    rot = bench_moe.routings(1, 128, 8, "cpu")
    ids = torch.cat([i.flatten() for _, i in rot])
    assert len(rot) == 16 and sorted(ids.tolist()) == list(range(128))
    assert all(torch.allclose(w.sum(-1), torch.ones(1)) for w, _ in rot)
    rot8 = bench_moe.routings(8, 128, 8, "cpu", count=4)
    assert [tuple(i.shape) for _, i in rot8] == [(8, 8)] * 4 and len({tuple(i.flatten().tolist()) for _, i in rot8}) == 4
    a, b = torch.ones(2, 3), torch.zeros(4)
    assert bench_moe._as_vector([a, b]).shape == (10,) and bench_moe._as_vector(a).shape == (6,)
