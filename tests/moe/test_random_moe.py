"""``quantkit bench --shape qwen3-30b-a3b``'s random MoE runtimes (tools/random_moe.py), on the CPU: each format
loads as the runtime serves that format's checkpoints, keeps activations at a sane size, and the shape run builds
no transformers model."""

from __future__ import annotations

import pytest
import torch

from quantkit.tools import bench, bench_run
from quantkit.tools.random_moe import random_moe_runtime, tensor_shapes

TINY = dict(model_type="qwen3_moe", hidden_size=64, moe_intermediate_size=48, intermediate_size=128, num_experts=8,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256, norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=512)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16"])
def test_each_format_loads_as_its_checkpoints_do(fmt):
    """The kernels backend's loader (no forward on the CPU): experts and attention in the format, routers 16-bit."""
    runtime = random_moe_runtime(TINY, fmt, "cpu", backend="kernels")
    layer = runtime.weights.layers[1]
    experts = layer.moe.experts
    assert (experts.quantized, experts.fp8) == (fmt == "int4", fmt == "fp8")
    assert experts.w13.dtype == {"int4": torch.int32, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[fmt]
    assert (layer.qkv.packed is not None, layer.qkv.fp8 is not None) == (fmt == "int4", fmt == "fp8")
    assert layer.moe.router.dtype == torch.bfloat16 and layer.moe.use_kernel


def test_bytes_a_token_reads_shrink_with_the_format():
    sizes = {fmt: random_moe_runtime(TINY, fmt, "cpu", backend="kernels").weights.nbytes()
             for fmt in ("int4", "fp8", "bf16")}
    assert sizes["int4"] < sizes["fp8"] < sizes["bf16"]


@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16"])
def test_activations_keep_their_size_through_the_layers(fmt):
    """Weights ~ 1/sqrt(fan_in): the logits of random tokens are O(1) in every format (no overflow in bf16, no
    collapse to zero, which would make decode timings meaningless)."""
    runtime = random_moe_runtime(TINY, fmt, "cpu", backend="reference", seed=3)
    logits = runtime.forward_logits(torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.float().std().item() < 10


def test_the_30b_shape_splits_into_per_expert_linears():
    """The real shape's names on the meta device: 48 layers x 128 experts x 3 linears, per expert as the INT4 / FP8
    checkpoints store them; fused 3-D tensors for bf16, as transformers stores them."""
    config = bench.SHAPES["qwen3-30b-a3b"]
    split = tensor_shapes(config, split_experts=True)
    experts = [n for n in split if ".mlp.experts." in n]
    assert len(experts) == 48 * 128 * 3
    assert split["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    fused = tensor_shapes(config, split_experts=False)
    assert fused["model.layers.0.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)


def test_moe_shape_run_builds_no_transformers_model(monkeypatch):
    events, published = [], []
    monkeypatch.setattr(bench, "random_hf_model", lambda *a, **k: pytest.fail("a transformers model was built"))
    monkeypatch.setattr("quantkit.tools.random_moe.random_moe_runtime",
                        lambda config, fmt, device, **kw: events.append((config["model_type"], fmt, device)) or fmt)
    monkeypatch.setattr(bench, "bench_runtime", lambda rt, b, s, p, split, **decode: {"rt": rt, "split": split})
    monkeypatch.setattr(bench_run, "_free", lambda: None)
    bench_run._shape_phases("qwen3-30b-a3b", (1, 8), 4, 16, True, lambda k, v: published.append((k, v)))
    assert events == [("qwen3_moe", f, "cuda") for f in ("int4", "fp8", "bf16")]
    assert [k for k, _ in published] == ["baselines", "int4", "fp8", "bf16"]
    assert published[1][1] == {"rt": "int4", "split": True}
    events.clear()  # --formats int4,bf16: the FP8 runtime is never built
    bench_run._shape_phases("qwen3-30b-a3b", (1, 8), 4, 16, True, lambda k, v: None, ("int4", "bf16"))
    assert events == [("qwen3_moe", f, "cuda") for f in ("int4", "bf16")]


def test_bench_names_the_experts_kernel_by_batch():
    """quantkit bench's record names the routed experts' kernel at each batch size, as MoELayer decides it: the
    kernels backend's decode GEMV (4-bit: its maths and config) at few pairs, the tiles past GEMV_MAX_PAIRS; the
    reference backend's reference."""
    from quantkit.kernels import moe_gemv
    from quantkit.kernels.moe_w4a16 import GEMV_MAX_PAIRS

    config = dict(TINY, hidden_size=128, moe_intermediate_size=128)  # whole 128-column groups: the GEMV applies
    runtime = random_moe_runtime(config, "int4", "cpu", backend="kernels")
    past = GEMV_MAX_PAIRS // TINY["num_experts_per_tok"] + 1
    got = bench.linear_kernels(runtime, (1, past))["experts"]
    assert got["1"].startswith(f"gemv {moe_gemv.gemv_math()} ") and got[str(past)].startswith("tiles "), got
    ref = random_moe_runtime(config, "int4", "cpu", backend="reference")
    assert bench.linear_kernels(ref, (1,))["experts"] == {"1": "reference"}
