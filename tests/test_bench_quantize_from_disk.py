"""bench/bench_quantize_from_disk.py's CPU smoke mode: writes a tiny random Qwen2 model, quantizes it from disk in a
child process, and records time and peak memory in its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_quantize_from_disk", REPO / "bench" / "bench_quantize_from_disk.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_tiny_smoke_run_writes_its_json(tmp_path, capsys):
    options = '{"desc_act": true, "static_groups": false, "mse": false}'  # as the device run passes them
    out = bench.main(["--tiny", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "r.json"),
                      "--options", options])
    rec = json.loads(out.read_text())
    assert rec["options"] == {"desc_act": True, "static_groups": False, "mse": False}
    assert rec["streamed"] is True and rec["method"] == "gptq" and rec["shape"]["model_type"] == "qwen2"
    assert rec["model_bytes"] > 0 and rec["checkpoint_bytes"] > 0 and rec["checkpoint_files"] >= 1
    assert rec["peak_host_memory_bytes"] > 2**20 and rec["peak_device_memory_bytes"] == 0
    assert rec["seconds"]["quantize"] > 0 and rec["versions"]["torch"] and rec["date"]
    assert list((tmp_path / "work").iterdir()) == []  # the model and the checkpoint are deleted without --keep
    assert "peak host memory" in capsys.readouterr().out


def test_random_model_is_sharded_and_loads(tmp_path):
    from quantkit.checkpoint.read import index_tensors

    size = bench.write_random_model(tmp_path / "m", bench.TINY, shard_bytes=200_000)
    records = index_tensors(tmp_path / "m")
    assert len({r.file for r in records.values()}) > 1
    assert sum(r.numel * 2 for r in records.values()) == size
    assert "model.layers.3.self_attn.q_proj.bias" in records  # Qwen2's attention biases
