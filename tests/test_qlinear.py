"""QuantLinear: the reference forward, the dispatch decision, and buffer handling."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quantkit.config import QuantScheme
from quantkit.primitives import compute_qparams, quantize
from quantkit.qlinear import BACKEND_TORCH, BACKEND_W4A16, QuantLinear, select_backend
from quantkit.qtensor import QuantizedWeight

REPO = Path(__file__).resolve().parents[1]


def packed(out_features=64, in_features=96, scheme=None, bias=True, seed=0) -> QuantizedWeight:
    scheme = scheme or QuantScheme(4, 32, False)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    scales, zeros, g_idx = compute_qparams(w, scheme.bits, scheme.group_size, scheme.sym)
    codes = quantize(w, scales, zeros, g_idx, scheme.bits)
    b = torch.randn(out_features, generator=gen) if bias else None
    return QuantizedWeight.from_codes(codes, scales, zeros, g_idx, scheme, bias=b)


@pytest.mark.parametrize(
    "scheme", [QuantScheme(4, 32, False), QuantScheme(8, -1, True), QuantScheme(3, 64, False)]
)
def test_forward_matches_dense_linear(scheme):
    qw = packed(scheme=scheme)
    layer = QuantLinear.from_weight(qw)
    x = torch.randn(2, 5, 96)
    expected = F.linear(x, qw.dequantize(), qw.bias)
    assert torch.allclose(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert layer.state_dict().keys() == {"qweight", "qzeros", "scales", "g_idx", "bias"}


def test_cpu_uses_reference_and_never_imports_triton():
    layer = QuantLinear.from_weight(packed(bias=False))
    assert select_backend(layer, torch.randn(3, 96)) == BACKEND_TORCH
    # A fresh interpreter: other tests in this session may have imported the kernels already.
    script = (
        "import sys, torch\n"
        "from quantkit.qlinear import QuantLinear\n"
        "from tests.test_qlinear import packed\n"
        "QuantLinear.from_weight(packed())(torch.randn(3, 96))\n"
        "print(sorted(m for m in ('triton', 'quantkit.kernels.w4a16') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert result.stdout.strip() == "[]"


def test_w4a16_is_chosen_for_4_and_8_bit_cuda_inputs():
    layer = QuantLinear.from_weight(packed(bias=False))
    eight = QuantLinear.from_weight(packed(scheme=QuantScheme(8, 32, True), bias=False))
    three = QuantLinear.from_weight(packed(scheme=QuantScheme(3, 32, True), bias=False))

    class CudaInput:  # stands in for a CUDA tensor: the decision reads only ``is_cuda``
        is_cuda = True

    assert select_backend(layer, CudaInput()) == BACKEND_W4A16
    assert select_backend(eight, CudaInput()) == BACKEND_W4A16  # the general tensor-core kernel reads 8-bit codes
    assert select_backend(three, CudaInput()) == BACKEND_TORCH


def test_cache_follows_buffers():
    first, second = packed(seed=1), packed(seed=2)
    layer = QuantLinear.from_weight(first)
    x = torch.randn(4, 96)
    y1 = layer(x)
    layer.load_state_dict(QuantLinear.from_weight(second).state_dict())
    assert torch.allclose(layer(x), F.linear(x, second.dequantize(), second.bias), atol=1e-5)
    assert not torch.allclose(layer(x), y1)


def test_dtype_moves_keep_float16_scales():
    layer = QuantLinear.from_weight(packed())
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and layer.bias.dtype == torch.bfloat16
    assert layer.qweight.dtype == torch.int32
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    layer.float()
    assert layer.scales.dtype == torch.float16 and layer(x.float()).dtype == torch.float32


def test_cpu_layer_keeps_no_repacked_copy_and_its_op_input_matches_act_order():
    # Off CUDA the custom op's input is a view of the checkpoint tensors (the reference needs no repack): no second
    # copy of the packed codes per layer. With an act-order g_idx the view keeps checkpoint row order, and the
    # reference behind the op still gives the dense result.
    from quantkit.kernels.dispatch import w4a16_linear

    qw = packed(in_features=128, scheme=QuantScheme(4, 32, False))
    g_idx = qw.g_idx[torch.randperm(128, generator=torch.Generator().manual_seed(1))].contiguous()
    qw = dataclasses.replace(qw, g_idx=g_idx)
    layer = QuantLinear.from_weight(qw)
    prepared = layer.prepared_w4a16()
    assert prepared.qweight.data_ptr() == layer.qweight.data_ptr() and prepared.perm is None
    x = torch.randn(3, 128)
    expected = F.linear(x, layer.to_quantized_weight().dequantize(), layer.bias)
    assert torch.allclose(w4a16_linear(x, prepared, layer.bias), expected, atol=1e-4, rtol=1e-4)
