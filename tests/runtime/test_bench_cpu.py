"""The benchmark's pieces that run without a GPU: the in-place FP8 model, the table's rows, the prefill split, and
how the decode rate is measured."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantkitError
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



class _FakeHF(str):
    """A random model stand-in: its name, and the vocabulary size the logits check reads."""

    config = type("Config", (), {"vocab_size": 256})


def test_shape_run_measures_int4_fp8_bf16_in_order(monkeypatch):
    """The shape run without a GPU: each format on a fresh random model (int4 quantized, fp8 in place, bf16 as
    built), its logits check, then its numbers; the transformers baselines on the int4 and bf16 models."""
    events, published = [], []
    monkeypatch.setattr(bench, "quantize_randomly", lambda hf: events.append(("int4", hf)) or "info")
    monkeypatch.setattr(bench, "quantize_fp8_in_place", lambda hf: events.append(("fp8", hf)))
    positions = []
    monkeypatch.setattr(bench, "runtime_from_hf", lambda hf, quant, max_positions: positions.append(max_positions)
                        or events.append(("runtime", hf, quant)) or hf)
    monkeypatch.setattr(bench, "bench_runtime", lambda rt, b, s, p, split, **opts: {"rt": rt, "args": (b, s, p, split),
                                                                                   **opts})
    monkeypatch.setattr(bench, "hf_generate_tps", lambda hf: {"generate": hf})
    monkeypatch.setattr(bench_run, "_logits_check", lambda rt, ref, vocab: f"check {rt} {vocab}")
    monkeypatch.setattr(bench_run, "_free", lambda: None)
    bench_args = ((1, 8), 4, 16, True)
    default = {"context": bench.DECODE_CONTEXT, "kv_cache_dtype": "auto"}  # every row decodes alike
    expected = [("check_int4_rel_err_vs_quantlinear", "check model0 256"),
                ("int4", {"rt": "model0", "args": bench_args, **default}),
                ("transformers_quantlinear", {"generate": "model0"}),
                ("check_fp8_rel_err_vs_fp8linear", "check model1 256"),
                ("fp8", {"rt": "model1", "args": bench_args, **default}),
                ("check_bf16_rel_err_vs_transformers", "check model2 256"),
                ("bf16", {"rt": "model2", "args": bench_args, **default}),
                ("transformers_bf16", {"generate": "model2"})]
    for baselines in (True, False):
        events.clear()
        published.clear()
        names = iter(range(3))

        def model(target, device):
            name = _FakeHF(f"model{next(names)}")
            events.append(("model", target, device, name))
            return name

        monkeypatch.setattr(bench, "random_hf_model", model)
        bench_run._shape_phases("tiny", (1, 8), 4, 16, baselines, lambda k, v: published.append((k, v)),
                                bench_run.FORMATS)
        assert events == [("model", "tiny", "cuda", "model0"), ("int4", "model0"), ("runtime", "model0", "info"),
                          ("model", "tiny", "cuda", "model1"), ("fp8", "model1"), ("runtime", "model1", None),
                          ("model", "tiny", "cuda", "model2"), ("runtime", "model2", None)]
        assert published == (expected if baselines else [e for e in expected if not e[0].startswith("transformers")])
    # --formats fp8,bf16: the int4 model is never built, the others as before (bf16 keeps its baseline)
    events.clear()
    published.clear()
    names = iter(range(1, 3))
    bench_run._shape_phases("tiny", (1, 8), 4, 16, True, lambda k, v: published.append((k, v)), ("fp8", "bf16"))
    assert [e[0] for e in events] == ["model", "fp8", "runtime", "model", "runtime"]
    assert published == expected[3:]
    # --context and --kv-cache-dtype reach every row, and the runtime holds the context's positions
    published.clear()
    positions.clear()
    names = iter(range(2, 3))
    decode = bench_run.DecodeSettings(context=6000, kv_cache_dtype="fp8")
    bench_run._shape_phases("tiny", (1, 8), 4, 16, False, lambda k, v: published.append((k, v)), ("bf16",), decode)
    assert published[-1] == ("bf16", {"rt": "model2", "args": bench_args, "context": 6000, "kv_cache_dtype": "fp8"})
    assert positions == [6000 + 4 + 2]


def test_formats_are_checked_before_the_gpu_is_asked_for():
    """An unknown or empty --formats is a clear error on any machine (exit 2 through the CLI)."""
    for bad in (("int8",), ()):
        with pytest.raises(QuantkitError, match="--formats takes a comma-separated subset of int4, fp8, bf16"):
            bench_run.run("llama3-8b", shape=True, formats=bad)


def test_prefill_split_times_every_part_of_an_fp8_prefill(monkeypatch):
    """The bench's prefill split on the CPU (the device sync stubbed): each part is timed, FP8's separate activation
    quantization is listed, and the parts are printed under the table."""
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.engine import Engine
    from tests.runtime.conftest import tiny_config

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("llama", 256)).eval()
    bench.quantize_fp8_in_place(hf)
    engine = Engine(bench.runtime_from_hf(hf, None, backend="reference"), None, max_batch=1, max_seq_len=128)
    ms = bench.prefill_split(engine, 64)
    parts = ("prefill", "linears", "layer0_qkv", "layer0_o", "layer0_gate_up", "layer0_down",
             "fp8_activation_quant_in_linears", "attention", "other")
    assert set(ms) == set(parts) and all(ms[k] > 0 for k in parts[:-1]), ms
    assert abs(ms["prefill"] - ms["linears"] - ms["attention"] - ms["other"]) < 1e-9
    record = {"batches": [1], "fp8": {"decode_tps": {"1": 1.0}, "prefill_tps": 1.0, "weight_bytes_per_token": 1,
                                      "peak_memory_bytes": 1, "prefill_split_ms": ms}}
    assert "fp8 prefill split (ms): prefill " in bench_run.format_table(record)


def test_decode_rate_is_measured_on_full_batches_when_the_prompts_need_several_prefill_chunks():
    """32 x 128 prompt tokens exceed one prefill chunk on CUDA (2048); here 4 x 128 exceed the CPU's 256. The bench's
    decode steps must all carry the whole batch (none half-full while the rest of the prompts are prefilled)."""
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.engine import Engine
    from tests.runtime.conftest import tiny_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("llama", 256)).eval()
    engine = Engine(bench.runtime_from_hf(hf, None, backend="reference"), None, max_batch=4, max_seq_len=160)
    assert engine.prefill_chunk < 4 * 128
    bench.decode_tps(engine, batch=4, steps=6)
    assert engine.stats.decode_tokens == 4 * 6 and engine.stats.decode_steps == 6, engine.stats
    assert engine.prefill_chunk < 4 * 128  # restored


def test_step_kernels_lists_what_one_decode_step_runs():
    """The per-kernel profile of a decode step (on the CPU the profiler's CPU ops stand in for the kernels): named
    rows by time with their call counts, the launch count and total, and a line under the table."""
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.engine import Engine
    from tests.runtime.conftest import tiny_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("llama", 256)).eval()
    engine = Engine(bench.runtime_from_hf(hf, None, backend="reference"), None, max_batch=1, max_seq_len=160)
    got = bench.step_kernels(engine)
    rows = got["kernels"]
    assert 0 < len(rows) <= 12 and got["launches"] >= sum(r["calls"] for r in rows)
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
    assert any(r["name"] in ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul") for r in rows), rows
    assert all(r["calls"] >= 1 and r["us"] >= 0 for r in rows) and got["sum_us"] >= rows[0]["us"]
    record = {"batches": [1], "int4": {"decode_tps": {"1": 1.0}, "prefill_tps": 1.0, "weight_bytes_per_token": 1,
                                       "peak_memory_bytes": 1, "step_kernels": got}}
    assert f"int4 batch-1 step, eager, by kernel: {got['launches']} launches" in bench_run.format_table(record)


def test_linear_kernels_say_which_kernel_each_linear_runs(monkeypatch):
    """The record names the kernel of each linear at each batch size, as the dispatch decides it: an FP8 model
    prepared for the Hopper path (forced here: the CPU only prepares it) takes the GEMV at batch 1 on every linear,
    q/k/v and gate/up included, the tensor-core GEMM up to 64 rows and _scaled_mm above, with codes from the norm
    and activation kernels (not for o, whose input attention writes: at one row the one-launch GEMV quantizes it
    itself); the switches of the older paths show."""
    import quantkit.fp8_linear as fp8_linear_module

    monkeypatch.setattr(fp8_linear_module, "scaled_mm_supported", lambda device, n, k: (True, "forced"))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    hf = LlamaForCausalLM(cfg).eval()
    bench.quantize_fp8_in_place(hf)
    model = bench.runtime_from_hf(hf, None, backend="reference")
    got = bench.linear_kernels(model, (1, 8, 128))
    for name in ("qkv", "gate_up", "down"):
        assert got[name] == {"1": "gemv+codes", "8": "gemv_mma+codes", "128": "scaled_mm+codes"}, (name, got)
    assert got["o"] == {"1": "gemv_fp8", "8": "gemv_mma", "128": "scaled_mm"}  # o's row quantized inside its GEMV
    assert got["lm_head"] == {"1": "torch", "8": "torch", "128": "torch"}
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", "unfused")
    monkeypatch.setenv("QUANTKIT_FP8_FUSED_QUANT", "0")
    got = bench.linear_kernels(bench.runtime_from_hf(hf, None, backend="reference"), (1, 8, 128))
    assert got["qkv"] == got["o"] == {"1": "gemv", "8": "scaled_mm", "128": "scaled_mm"}
    monkeypatch.setenv("QUANTKIT_FP8_GEMV", "mma")
    got = bench.linear_kernels(bench.runtime_from_hf(hf, None, backend="reference"), (1, 8, 128))
    assert got["qkv"] == {"1": "gemv_mma", "8": "gemv_mma", "128": "scaled_mm"}
    record = {"batches": [1, 8], "fp8": {"linear_kernels": got, "decode_tps": {"1": 1.0, "8": 2.0},
                                         "prefill_tps": 3.0, "weight_bytes_per_token": 1, "peak_memory_bytes": 1}}
    assert "fp8 kernels by batch: qkv 1: gemv_mma, 8: gemv_mma" in bench_run.format_table(record)
