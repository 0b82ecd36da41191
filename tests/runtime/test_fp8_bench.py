"""The benchmark's FP8 pieces that run without a GPU: the in-place FP8 model and the table's FP8 rows."""

from __future__ import annotations

import torch

from quantkit.tools import bench, bench_run


def test_fp8_model_in_place_serves_through_the_runtime():
    from tests.runtime.conftest import tiny_config

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(tiny_config("llama", 256)).eval()
    bench.quantize_fp8_in_place(hf)
    assert type(hf.model.layers[1].mlp.down_proj).__name__ == "FP8Linear"
    runtime = bench.runtime_from_hf(hf, None, backend="reference")
    assert runtime.weights.layers[0].gate_up.fp8 is not None
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    got = runtime.forward_logits(ids)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_table_shows_fp8_beside_int4_and_bf16():
    def row(tps, prefill):
        return {"decode_tps": {"1": tps, "8": tps * 6}, "prefill_tps": prefill, "weight_bytes_per_token": 8e9,
                "peak_memory_bytes": 2e10, "time_split_ms": {"linears": 1.0}}

    record = {"batches": [1, 8], "int4": row(300, 9000), "fp8": row(180, 20000), "bf16": row(100, 12000),
              "copy_bandwidth_gbs": 4000}
    table = bench_run.format_table(record)
    assert "| runtime fp8 | 180 | 1080 | 20000 |" in table
    assert "fp8 / bf16: decode b=1 1.80x, decode b=8 1.80x, prefill 1.67x" in table
    assert "fp8 batch-1 step (ms): linears 1.000" in table
