"""AWQ's fused candidate kernel against the torch ops it replaces (``awq.fake_quantize_scaled``).

On the CPU the kernel runs in Triton's interpreter (small shapes); ``-m gpu`` repeats the comparison on
CUDA at Llama-3-8B sizes, where the scalar divisions follow CUDA's reciprocal rule. Same values bit for
bit: the arithmetic is the same op for op.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.methods.awq import awq_scales, candidate_weight, fake_quantize_scaled


def _case(rows: int, cols: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(dtype)
    w[0, :5] = 0.0  # a row whose first group starts with zeros
    w[1, : min(cols, 128)] = w[1, : min(cols, 128)].abs()  # a group without negative values (asym zero = 1)
    x_mean = torch.rand(cols, generator=g) * 3 + 0.01
    s = awq_scales(x_mean, 0.5)
    return w.to(device), s.to(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test runs on CPU-only machines")
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rows, cols, gs", [(33, 256, 128), (20, 200, 64), (16, 96, -1)])
def test_interpreter_matches_torch(sym, rows, cols, gs):
    from quantkit.kernels.awq_fake_quant import fake_quantize_scaled_triton, fused_supported

    scheme = QuantScheme(4, gs, sym)
    for dtype in (torch.float32, torch.bfloat16):
        w, s = _case(rows, cols, dtype, "cpu")
        assert fused_supported(w, gs)
        ref = fake_quantize_scaled(w, s, scheme).to(dtype)
        got = fake_quantize_scaled_triton(w, s, 4, gs, sym)
        assert got.dtype == dtype and got.shape == w.shape
        assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()


def test_candidate_weight_on_cpu_is_the_torch_path():
    w, s = _case(8, 128, torch.bfloat16, "cpu")
    scheme = QuantScheme(4, 64, False)
    assert torch.equal(candidate_weight(w, s, scheme), fake_quantize_scaled(w, s, scheme).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("sym", [True, False])
def test_cuda_matches_torch_at_8b_shapes(sym):
    from quantkit.kernels.awq_fake_quant import fake_quantize_scaled_triton

    scheme = QuantScheme(4, 128, sym)
    for rows, cols in ((6144, 4096), (4096, 14336), (100, 200)):
        w, s = _case(rows, cols, torch.bfloat16, "cuda")
        ref = fake_quantize_scaled(w, s, scheme).to(torch.bfloat16)
        got = fake_quantize_scaled_triton(w, s, 4, 128, sym)
        assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()
        assert torch.equal(candidate_weight(w, s, scheme), ref)
