"""``--format awq``: the same quantized weights written in the AWQ GEMM layout decode to the same codes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.config import QuantkitError, QuantScheme
from quantkit.pack import unpack_awq


def _quantized_tiny():
    from transformers import LlamaForCausalLM

    from quantkit.calibrate.walker import walk
    from quantkit.methods.rtn import RTNMethod
    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    scheme = QuantScheme(4, 32, sym=False)
    return model, walk(model, RTNMethod(scheme), device="cpu").weights, scheme


def test_awq_layout_holds_the_same_codes(tmp_path):
    from quantkit.checkpoint.save import save_quantized

    model, weights, scheme = _quantized_tiny()
    out = save_quantized(model, weights, tmp_path / "awq", method="rtn", scheme=scheme, layout="awq")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "awq" and config["version"] == "gemm" and config["zero_point"]
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    for name, qw in weights.items():
        codes, zeros = unpack_awq(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"])
        expected_codes, expected_zeros = qw.unpack()
        assert torch.equal(codes, expected_codes) and torch.equal(zeros, expected_zeros)
        assert torch.equal(tensors[f"{name}.scales"], qw.scales)
        assert f"{name}.g_idx" not in tensors


def test_awq_layout_refuses_what_it_cannot_hold(tmp_path):
    from transformers import LlamaForCausalLM

    from quantkit.calibrate.walker import walk
    from quantkit.checkpoint.save import save_quantized
    from quantkit.methods.rtn import RTNMethod
    from tests.conftest import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config())
    scheme = QuantScheme(4, 32, sym=True)
    weights = walk(model, RTNMethod(scheme), device="cpu").weights
    with pytest.raises(QuantkitError, match="asym"):
        save_quantized(model, weights, tmp_path / "x", method="rtn", scheme=scheme, layout="awq")
    assert not (tmp_path / "x").exists()
