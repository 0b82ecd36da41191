"""The walker: captured layer inputs reproduce the model's own forward; methods see what they need."""

from __future__ import annotations

import pytest
import torch

from quantkit.arch import find_decoder_layers
from quantkit.calibrate.walker import (
    LayerInputs,
    LayerResult,
    ModelLayers,
    capture_layer_inputs,
    capture_linear_inputs,
    run_layer,
    walk,
)
from quantkit.config import QuantScheme
from quantkit.methods.rtn import RTNMethod


def _models():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import tiny_llama_config

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return [
        ("llama", lambda: LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3))),
        ("qwen2", lambda: Qwen2ForCausalLM(Qwen2Config(**common))),
        # Sliding-window layers get other masks than global ones: kwargs must be captured per layer.
        ("gemma3", lambda: Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=8))),
    ]


@pytest.mark.parametrize("name,build", _models(), ids=[m[0] for m in _models()])
def test_layer_by_layer_reproduces_forward(name, build):
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, model.config.vocab_size, (5, 24))
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states[-2]  # input of the last layer
        prefix, layers = find_decoder_layers(model)
        hidden, kwargs = capture_layer_inputs(model, ModelLayers(prefix, layers), ids, torch.device("cpu"), 2)
        assert [h.shape[0] for h in hidden] == [2, 2, 1]
        for i in range(len(layers) - 1):
            hidden = run_layer(layers[i], LayerInputs(hidden, kwargs[i]))
    torch.testing.assert_close(torch.cat(hidden), expected, rtol=1e-5, atol=1e-5)
    # The recorders are gone: the model runs normally afterwards.
    assert "forward" not in layers[0].__dict__


def test_capture_linear_inputs_stops_early_and_sees_inputs():
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(0, 256, (3, 16))
    prefix, layers = find_decoder_layers(model)
    hidden, kwargs = capture_layer_inputs(model, ModelLayers(prefix, layers), ids, torch.device("cpu"), 3)
    layer = layers[0]
    seen = []
    ran = []
    handles = [layer.get_submodule(n).register_forward_hook(lambda *a, n=n: ran.append(n))
               for n in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")]
    capture_linear_inputs(layer, LayerInputs(hidden, kwargs[0]), ["self_attn.q_proj", "self_attn.k_proj"],
                          lambda name, x: seen.append((name, x.shape)))
    assert seen == [("self_attn.q_proj", (3, 16, 64)), ("self_attn.k_proj", (3, 16, 64))]
    # the forward ended once k's input was seen: k itself and everything after it never ran
    assert ran == ["self_attn.q_proj"]
    # the MLP's gate/up inputs without computing up_proj (nor the down projection after it)
    ran.clear()
    handles.append(layer.mlp.up_proj.register_forward_hook(lambda *a: ran.append("mlp.up_proj")))
    capture_linear_inputs(layer, LayerInputs(hidden, kwargs[0]), ["mlp.gate_proj", "mlp.up_proj"],
                          lambda name, x: seen.append((name, x.shape)))
    assert ran == ["self_attn.q_proj", "self_attn.k_proj"] and seen[-1][0] == "mlp.up_proj"
    for handle in handles:
        handle.remove()
    normed = layer.input_layernorm(hidden[0])
    got = []
    capture_linear_inputs(layer, LayerInputs(hidden, kwargs[0]), ["self_attn.v_proj"], lambda n, x: got.append(x))
    torch.testing.assert_close(got[0], normed)


class _RecordingMethod:
    """A method that checks what the walker hands it and returns RTN weights."""

    name = "recording"
    needs_calibration = True

    def __init__(self):
        self.calls = []
        self.rtn = RTNMethod(QuantScheme(4, 32, sym=False))

    def quantize_layer(self, ctx) -> LayerResult:
        assert next(ctx.layer.parameters()).device == ctx.device
        self.calls.append((ctx.index, ctx.prefix, [list(g) for g in ctx.groups], ctx.inputs.n_tokens))
        return self.rtn.quantize_layer(ctx)


def test_walk_passes_quantized_outputs_forward_and_skips():
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(0, 256, (4, 16))
    method = _RecordingMethod()
    result = walk(model, method, device="cpu", token_ids=ids, batch_size=2, skip=lambda n: n == "mlp.down_proj")
    assert [c[0] for c in method.calls] == [0, 1]
    assert method.calls[0][2] == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                  ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"]]
    assert method.calls[1][3] == 4 * 16
    assert len(result.weights) == 2 * 6 and not any("down_proj" in k for k in result.weights)
    # The model now holds exactly the dequantized weights of the checkpoint records.
    for name, qw in result.weights.items():
        linear = dict(model.named_modules())[name]
        torch.testing.assert_close(linear.weight.data, qw.dequantize())


def test_walk_requires_calibration_for_calibrated_methods():
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    with pytest.raises(ValueError, match="calibration"):
        walk(LlamaForCausalLM(tiny_llama_config()), _RecordingMethod(), device="cpu")


@pytest.mark.parametrize("tied", [False, True])
def test_quantize_lm_head_unties_and_packs_it(tied, tmp_path):
    from transformers import LlamaForCausalLM

    from quantkit.methods.gptq import GPTQConfig
    from quantkit.methods.gptq_method import GPTQMethod
    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tied)).eval()
    ids = torch.randint(0, 256, (4, 16))
    embed_before = model.get_input_embeddings().weight.detach().clone()
    method = GPTQMethod(QuantScheme(4, 32, sym=False), GPTQConfig())
    result = walk(model, method, device="cpu", token_ids=ids, batch_size=2, quantize_lm_head=True)
    assert "lm_head" in result.weights and result.layer_stats[-1]["prefix"] == "lm_head"
    torch.testing.assert_close(model.lm_head.weight.data, result.weights["lm_head"].dequantize())
    # The input embeddings keep their 16-bit values even when they were tied to lm_head.
    torch.testing.assert_close(model.get_input_embeddings().weight, embed_before)
    assert model.config.tie_word_embeddings is False or not tied
    # Written and read back, the checkpoint computes what the walked model computes.
    from quantkit.checkpoint.save import load_quantized, save_quantized

    save_quantized(model, result.weights, tmp_path / "q", method="gptq", scheme=method.scheme)
    reloaded, _ = load_quantized(tmp_path / "q", dtype=torch.float32)
    assert type(reloaded.lm_head).__name__ == "QuantLinear"
    with torch.no_grad():
        expected = model(ids).logits
        got = reloaded(ids).logits
    # Embeddings and norms are saved in bf16 (the model was fp32): a small, bounded difference.
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
