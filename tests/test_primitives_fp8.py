"""The E4M3 rounding primitive against an independent float64 model of the format."""

from __future__ import annotations

import math

import pytest
import torch

from quantkit.primitives import FP8_E4M3_MAX, dequantize_fp8, fp8_scale, quantize_fp8


def e4m3_round_f64(v: torch.Tensor) -> torch.Tensor:
    """Round float64 ``v`` to e4m3fn by its definition: 3 mantissa bits, exponents from -6 (below: subnormal steps
    of 2**-9), ties to even, saturating at +-448."""
    v = v.double().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    mag = v.abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag)))).clamp_min(-6)
    quantum = torch.pow(2.0, exp - 3)
    return (torch.round(v / quantum) * quantum).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # round(): half to even


def test_rounding_matches_the_format_definition():
    torch.manual_seed(0)
    v = torch.cat([torch.randn(20000) * 30, torch.rand(5000) * 2**-6, torch.tensor([0.0, 448.0, -448.0, 500.0, -1e6,
                                                                                     2**-10, 2**-9, 1.0625, 1.1875])])
    got = quantize_fp8(v, torch.tensor(1.0)).double()
    assert torch.equal(got, e4m3_round_f64(v))


def test_every_code_round_trips_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = codes.float()
    finite = ~torch.isnan(values)
    scale = torch.tensor(0.37)
    again = quantize_fp8(dequantize_fp8(codes[finite], scale), scale)
    assert torch.equal(again.float(), values[finite])


def test_saturates_instead_of_nan():
    q = quantize_fp8(torch.tensor([1e9, -1e9, float(FP8_E4M3_MAX) * 1.03]), torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 448.0]


@pytest.mark.parametrize("shape", [(7, 33), (128, 64)])
def test_round_trip_error_is_within_half_a_step(shape):
    torch.manual_seed(1)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)
    s = fp8_scale(x.abs().amax(dim=1, keepdim=True))
    back = dequantize_fp8(quantize_fp8(x, s), s)
    # relative step of e4m3 in its normal range is 2**-3; half of it bounds the error of normal values
    normal = x.abs() / s >= 2**-6
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[normal]
    assert rel.max().item() <= 2**-4 + 1e-7
    assert torch.equal(x.abs().amax(dim=1), back.abs().amax(dim=1)) or math.isclose(
        (back.abs().amax(dim=1) / x.abs().amax(dim=1)).min().item(), 1.0, rel_tol=1e-6)


def test_scale_of_a_zero_range_is_positive():
    s = fp8_scale(torch.zeros(3))
    assert (s > 0).all() and torch.isfinite(s).all()
    assert quantize_fp8(torch.zeros(3), s).float().abs().sum() == 0
