"""The batched static-group range search (``gptq_mse``) against the one-group-at-a-time loop it replaces.

Synthetic weights (outlier columns, all-zero and all-positive groups), Hessian-weighted and unweighted
searches, sym and asym grids, a partial last group, chunks of rows smaller than the weight: the scales and
zeros must be bitwise equal, and so must whole ``gptq_quantize`` results with the defaults' options.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.methods.gptq import GPTQConfig, _static_params_loop, gptq_quantize, mse_column_weights
from quantkit.methods.gptq_mse import static_group_qparams


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[:, 3] *= 20  # an outlier column: the search shrinks the other rows' ranges differently
    w[1, :] = 0.0  # an all-zero row (scale 1 by convention)
    w[2, :] = w[2, :].abs()  # no negative values: the asym zero-point special case
    return w


def _column_weights(cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    d = torch.rand(cols, generator=g).pow(4) * 50 + 1e-3  # a wide spread of H_jj, as in real layers
    return (d / d.mean()).float()


CASES = [  # bits, group size, sym, mse, weighted, cols
    (4, 64, True, True, True, 512), (4, 64, False, True, True, 512), (4, 128, True, True, False, 512),
    (3, 32, False, True, False, 256), (4, 48, True, True, True, 200), (8, 64, False, True, True, 256),
    (4, 64, True, False, False, 256), (2, 32, True, True, True, 128),
]


@pytest.mark.parametrize("bits,gs,sym,mse,weighted,cols", CASES)
@pytest.mark.parametrize("chunk", [None, 1 << 25, 3000])
def test_batched_search_bitwise(bits, gs, sym, mse, weighted, cols, chunk):
    w = _weights(96, cols, seed=bits * gs + cols)
    scheme = QuantScheme(bits, gs, sym)
    config = GPTQConfig(mse=mse, mse_weight="hessian" if weighted else "none", static_groups=True)
    cw = _column_weights(cols, bits) if weighted else None
    s0, z0 = _static_params_loop(w, scheme, config, gs, cw)
    s1, z1 = static_group_qparams(w, scheme, config, gs, cw, chunk_elements=chunk)
    assert s1.shape == s0.shape == (-(-cols // gs), 96)
    assert s1.dtype == s0.dtype and z1.dtype == z0.dtype
    assert torch.equal(s0, s1) and torch.equal(z0, z1)


def test_search_is_not_trivial():
    """The shrink grid must choose something other than the full range for some groups (else the
    bitwise comparison above would hold for any search that returns min/max)."""
    w = _weights(96, 512, seed=1)
    scheme = QuantScheme(4, 64, True)
    full, _ = static_group_qparams(w, scheme, GPTQConfig(mse=False), 64)
    searched, _ = static_group_qparams(w, scheme, GPTQConfig(mse=True, mse_weight="hessian"), 64,
                                       _column_weights(512, 4))
    assert (searched < full).float().mean() > 0.2


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_defaults_unchanged(sym, monkeypatch):
    """A whole solve with the defaults' options (act-order, static groups, Hessian-weighted search)
    gives the same codes, scales and zeros with the batched search as with the loop."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 256, generator=g) @ (torch.eye(256) + 0.2 * torch.randn(256, 256, generator=g))
    H = (2.0 / x.shape[0]) * x.t() @ x
    w = _weights(80, 256, seed=7)
    scheme = QuantScheme(4, 64, sym)
    config = GPTQConfig(desc_act=True, static_groups=True, mse=True, mse_weight="hessian", solver="torch")
    new = gptq_quantize(w, H, scheme, config)
    import quantkit.methods.gptq as gptq

    monkeypatch.setattr(gptq, "_static_params", gptq._static_params_loop)
    old = gptq_quantize(w, H, scheme, config)
    assert torch.equal(new.codes, old.codes) and torch.equal(new.scales, old.scales)
    assert torch.equal(new.zeros, old.zeros) and torch.equal(new.g_idx, old.g_idx)
    assert mse_column_weights(config, H, torch.eye(256), None) is not None  # the weighted search ran
