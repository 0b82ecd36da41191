"""`quantkit fp8` on MoE models: every expert in FP8 under the names vLLM maps, read back by quantkit's reader and
its runtime with the same logits, and nothing left 16-bit in silence."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from quantkit.checkpoint.read import load_quantized
from quantkit.config import LoadConfig, QuantkitError
from quantkit.fp8_api import quantize_fp8
from quantkit.methods.fp8 import FP8Config
from quantkit.runtime.loader import load_runtime_model
from tests.conftest import rel_err, tiny_tokenizer
from tests.moe.moe_tiny import expected_checkpoint_names, tiny_moe

LOAD = LoadConfig(dtype="float32", device="cpu")


def _folder(tmp_path, model_type):
    tokenizer = tiny_tokenizer()
    model = tiny_moe(model_type, vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "fp")
    tokenizer.save_pretrained(tmp_path / "fp")
    return model


def _ids():
    return torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("model_type,weights", [("mixtral", "channel"), ("qwen2_moe", "channel"),
                                                ("qwen3_moe", "block")])
def test_every_expert_is_fp8_and_reads_back_with_the_same_logits(tmp_path, model_type, weights):
    model = _folder(tmp_path, model_type)
    config = FP8Config(weights=weights, block=(32, 32))
    report = quantize_fp8(str(tmp_path / "fp"), str(tmp_path / "fp8"), config=config, load=LOAD)
    assert report.unquantized == [] and report.compression_ratio > 1.5
    experts = {n.removesuffix(".qweight") for n in expected_checkpoint_names(model.config) if n.endswith(".qweight")}
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name in experts:
            assert f.get_tensor(f"{name}.weight").dtype == torch.float8_e4m3fn, name
            assert f"{name}.weight_scale" in keys, name
    shared = 4 + (3 if model_type == "qwen2_moe" else 0)  # attention (+ the shared expert) per layer
    assert report.n_quantized == len(experts) + 2 * shared
    assert not any(".gate.weight_scale" in k for k in keys)  # routers stay 16-bit
    reader, _ = load_quantized(tmp_path / "fp8", dtype=torch.float32)
    runtime, _ = load_runtime_model(str(tmp_path / "fp8"), device="cpu", dtype="float32", backend="reference")
    with torch.no_grad():
        ref = reader(_ids()).logits
        assert rel_err(ref, model(_ids()).logits) < 0.1  # FP8 is close to the 16-bit model
    assert rel_err(runtime.forward_logits(_ids()), ref) < 1e-5


def test_static_activations_on_experts_are_refused(tmp_path, tiny_text_file):
    _folder(tmp_path, "qwen3_moe")
    from quantkit.config import CalibConfig

    with pytest.raises(QuantkitError, match="static FP8 activation scales"):
        quantize_fp8(str(tmp_path / "fp"), str(tmp_path / "fp8"), config=FP8Config(activations="static"), load=LOAD,
                     calib=CalibConfig(source=str(tiny_text_file), nsamples=2, seqlen=16))
    assert not (tmp_path / "fp8").exists()
