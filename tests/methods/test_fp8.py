"""The FP8 core: scale shapes per strategy, what the records dequantize to, and refused configs."""

from __future__ import annotations

import math

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.methods.fp8 import FP8Config, fp8_quantize_weight
from quantkit.primitives import quantize_fp8


@pytest.mark.parametrize("weights,shape", [("channel", (96, 1)), ("tensor", (1,)), ("block", (3, 2))])
def test_scale_shapes(weights, shape):
    torch.manual_seed(0)
    w = torch.randn(96, 80)
    cfg = FP8Config(weights=weights, block=(32, 64)) if weights == "block" else FP8Config(weights=weights)
    rec, err = fp8_quantize_weight(w, cfg)
    assert rec.weight.dtype == torch.float8_e4m3fn and rec.weight.shape == (96, 80)
    assert rec.weight_scale.dtype == torch.float32 and tuple(rec.weight_scale.shape) == shape
    assert 0 < err < 0.05


def test_channel_scales_put_each_rows_absmax_on_448():
    torch.manual_seed(0)
    w = torch.randn(16, 32) * torch.arange(1, 17).unsqueeze(1)
    rec, _ = fp8_quantize_weight(w, FP8Config())
    assert torch.allclose(rec.weight.float().abs().amax(dim=1), torch.full((16,), 448.0))
    assert torch.allclose(rec.weight_scale.squeeze(1), w.abs().amax(dim=1) / 448)


def test_block_scales_cover_partial_edge_blocks():
    torch.manual_seed(0)
    w = torch.randn(50, 70)
    w[48:, 64:] *= 100  # the corner block (partial both ways) has its own scale
    rec, _ = fp8_quantize_weight(w, FP8Config(weights="block", block=(16, 32)))
    assert rec.weight_scale.shape == (math.ceil(50 / 16), math.ceil(70 / 32))
    assert torch.isclose(rec.weight_scale[3, 2], w[48:, 64:].abs().max() / 448)
    expected = quantize_fp8(w[:16, :32], rec.weight_scale[0, 0])
    assert torch.equal(rec.weight[:16, :32].float(), expected.float())


def test_dequantize_is_codes_times_scales():
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    rec, _ = fp8_quantize_weight(w, FP8Config())
    assert torch.equal(rec.dequantize(), rec.weight.float() * rec.weight_scale)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(weights="row"), "--weights"),
    (dict(activations="sometimes"), "--activations"),
    (dict(block=(100, 128)), "--block"),
    (dict(weights="block", activations="static"), "dynamic activations only"),
])
def test_bad_configs_are_refused(kwargs, needle):
    with pytest.raises(QuantkitError, match=needle):
        FP8Config(**kwargs)
