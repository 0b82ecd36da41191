"""MoE end to end on tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (transformers configs, no download)."""

from __future__ import annotations

import logging

import pytest
import torch

from quantkit.api import build_method
from quantkit.calibrate.walker import walk
from quantkit.checkpoint.inspect import inspect_checkpoint
from quantkit.checkpoint.read import index_tensors, load_quantized
from quantkit.checkpoint.save import save_quantized
from quantkit.config import QuantScheme
from quantkit.methods.moe import MoECalibConfig
from quantkit.methods.moe_prepare import prepare_for_quantization
from quantkit.moe.experts import SeparateExperts
from quantkit.qlinear import QuantLinear
from tests.moe.moe_tiny import exclude_expert, expected_checkpoint_names, tiny_moe

SCHEME = QuantScheme(bits=4, group_size=32, sym=True)


def calib_ids(seed=1, n=4):
    return torch.randint(3, 128, (n, 32), generator=torch.Generator().manual_seed(seed))


def quantized(model_type, mode="all", method="gptq", min_tokens=8, model=None):
    model = model if model is not None else tiny_moe(model_type)
    m = prepare_for_quantization(model, build_method(method, SCHEME), MoECalibConfig(mode=mode, min_tokens=min_tokens))
    result = walk(model, m, device="cpu", token_ids=calib_ids(), batch_size=2)
    with torch.no_grad():  # as the checkpoint stores them: every unpacked tensor in bfloat16
        for name, p in model.named_parameters():
            if name.rpartition(".")[0] not in result.weights:
                p.copy_(p.to(torch.bfloat16).float())
    return model, result


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_unfused_experts_compute_what_transformers_computes(model_type):
    from quantkit.moe.layout import prepare_moe_model

    model = tiny_moe(model_type)
    ids = calib_ids(seed=3, n=2)
    with torch.no_grad():
        ref = model(ids).logits
        assert prepare_moe_model(model) == 2
        assert torch.allclose(model(ids).logits, ref, atol=1e-6, rtol=0)
    assert not any(p.dim() == 3 for p in model.parameters())


def test_unfusing_draws_no_random_weights(monkeypatch):
    # the per-expert linears take the fused weights as they are: drawing default values first cost minutes on the
    # 48 layers of a Qwen3-30B-A3B-shaped model in host memory (bench/moe_unfuse_time.py)
    from quantkit.moe.layout import prepare_moe_model

    model = tiny_moe("qwen3_moe")

    def no_init(tensor, *args, **kwargs):  # on the meta device it costs nothing
        assert tensor.is_meta, "an expert linear was initialised before its weights were copied in"
        return tensor

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", no_init)
    assert prepare_moe_model(model) == 2


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_gptq_checkpoint_reload_same_logits_and_vllm_names(model_type, tmp_path):
    model, result = quantized(model_type)
    out = save_quantized(model, result.weights, tmp_path / "q", method="gptq", scheme=SCHEME)
    # every expert of every layer packed, under the names vLLM's FusedMoE mapping expects
    names = set(index_tensors(out))
    expected = expected_checkpoint_names(model.config)
    assert expected <= names, sorted(expected - names)[:5]
    assert not [n for n in names if ".experts." in n and not n.startswith(tuple(e.rsplit(".", 1)[0] for e in expected))]
    assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in names)
    loaded, _ = load_quantized(out, dtype=torch.float32)
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == len(result.weights)
    assert any(isinstance(m, SeparateExperts) for m in loaded.modules())
    ids = calib_ids(seed=2, n=2)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    info = inspect_checkpoint(out)
    assert info.moe["packed_experts"] == 2 * 8 and not info.moe["incomplete_blocks"]
    kept = {n.split(".")[-1] for n in info.unquantized_modules}
    assert kept <= {"lm_head", "embed_tokens", "gate", "shared_expert_gate"}


def test_router_and_shared_expert_gate_stay_16bit():
    model, result = quantized("qwen2_moe")
    names = set(result.weights)
    assert "model.layers.0.mlp.shared_expert.down_proj" in names
    assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in names)


@pytest.mark.parametrize("mode", ["all", "routed"])
def test_expert_without_routed_tokens_is_still_quantized(mode, caplog):
    model = tiny_moe("qwen3_moe")
    exclude_expert(model, 3)
    with caplog.at_level(logging.WARNING, logger="quantkit.methods.moe"):
        model, result = quantized("qwen3_moe", mode=mode, model=model)
    for layer in (0, 1):
        for lin in ("gate_proj", "up_proj", "down_proj"):
            name = f"mlp.experts.3.{lin}"
            assert f"model.layers.{layer}.{name}" in result.weights
            stats = result.layer_stats[layer]["linears"][name]
            assert stats["routed_tokens"] == 0
            if mode == "routed":  # no Hessian: the stated fallback, named in a warning
                assert stats["fallback_rtn"] == 1.0
            else:  # every token reached it in the all-expert pass
                assert stats["calib_tokens"] == 4 * 32 and "err_gptq" in stats
    warned = [r.getMessage() for r in caplog.records if "round-to-nearest" in r.getMessage()]
    if mode == "routed":
        assert any("model.layers.0.mlp.experts.3:" in w and "0 routed" in w for w in warned)
    else:
        assert not warned


def test_all_expert_mode_passes_on_only_routed_outputs():
    """Calibrating in "all" mode must not change what the layer computes (only routed experts summed)."""
    from quantkit.moe.layout import prepare_moe_model

    model = tiny_moe("mixtral")
    prepare_moe_model(model)
    ids = calib_ids(seed=5, n=2)
    with torch.no_grad():
        ref = model(ids).logits
        blocks = [m for m in model.modules() if isinstance(m, SeparateExperts)]
        for b in blocks:
            b.mode, b.observer = "all", lambda e, kind, x: None
        out = model(ids).logits
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert all(int(b.routed_tokens.sum()) == 2 * 32 * 2 for b in blocks)  # tokens x top-2


def test_all_expert_mode_without_an_observer_passes_on_only_routed_outputs():
    """AWQ's "all" mode (no observer: down runs on every token, the unrouted rows masked out without a host sync)
    computes what the routed layer computes."""
    from quantkit.moe.layout import prepare_moe_model

    model = tiny_moe("qwen2_moe")
    prepare_moe_model(model)
    ids = calib_ids(seed=6, n=2)
    with torch.no_grad():
        ref = model(ids).logits
        for b in (m for m in model.modules() if isinstance(m, SeparateExperts)):
            b.mode = "all"
        out = model(ids).logits
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_rtn_quantizes_every_expert():
    model, result = quantized("olmoe", method="rtn")
    assert len(result.weights) == 2 * (4 + 3 * 8)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_awq_scales_every_expert_and_reloads(model_type, tmp_path):
    model = tiny_moe(model_type)
    norm_before = model.model.layers[0].post_attention_layernorm.weight.detach().clone()
    model, result = quantized(model_type, method="awq", model=model)
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    down = "w2" if model_type == "mixtral" else "down_proj"
    stats = result.layer_stats[0]["linears"]
    # one scale searched for all experts' gate/up (folded into the norm), one per expert's up -> down
    assert not torch.equal(model.model.layers[0].post_attention_layernorm.weight, norm_before)
    assert all("scale_err_awq" in stats[f"{block}.experts.{e}.{down}"] for e in range(8))
    assert len(result.weights) == 2 * (4 + 3 * 8 + (3 if model_type == "qwen2_moe" else 0))
    out = save_quantized(model, result.weights, tmp_path / "q", method="awq", scheme=SCHEME)
    loaded, _ = load_quantized(out, dtype=torch.float32)
    ids = calib_ids(seed=2, n=2)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
