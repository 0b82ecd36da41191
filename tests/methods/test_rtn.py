from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.methods.rtn import rtn_quantize
from quantkit.primitives import dequantize


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_error_bound(bits, group_size, sym):
    torch.manual_seed(bits * 7 + group_size)
    w = torch.randn(48, 576) * torch.rand(48, 1)  # 576 = 4.5 groups of 128: a partial last group
    res = rtn_quantize(w, QuantScheme(bits, group_size, sym))
    dq = dequantize(res.codes, res.scales, res.zeros, res.g_idx)
    step = res.scales.t()[:, res.g_idx.long()]
    # Inside the grid every weight is within half a step; sym clips only the top half-step at +absmax.
    # Scales are rounded to float16 (the checkpoint's dtype), which moves grid point k by up to
    # k * 2**-11 steps: at most 2**bits * 2**-11 steps at the far end of the grid.
    slack = (1.0 if sym else 0.5) + 2**bits * 2**-11
    assert ((dq - w).abs() <= step * slack + 1e-6).all()
    assert res.zeros.min() >= 1 and res.zeros.max() <= 2**bits - 1
    assert res.weight_error < {2: 0.7, 3: 0.3, 4: 0.15, 8: 0.01}[bits]


def test_more_bits_less_error():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    errs = [rtn_quantize(w, QuantScheme(b, 64, False)).weight_error for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)
