"""AWQ's fused clip search (kernels/awq_clip.py) against the torch search it replaces (``awq.search_clip``).

The grid and the rounding error are the same op for op; the score ``d^T A d`` sums in another order, so a
ratio whose score ties another's to float32 rounding may be picked instead. The tests ask for what that
allows: nearly all clip ranges equal, and where one differs, the kernel's choice scores within float32
rounding of the torch search's best under the torch score.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.methods.awq import AWQConfig, _grouped, search_clip
from quantkit.primitives import num_groups, qparams_from_range


def _case(rows: int, cols: int, n: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[0, :5] = 0.0
    w[1, : min(cols, 64)] = w[1, : min(cols, 64)].abs()  # a group without negative values (asym zero = 1)
    w[2, : min(cols, 16)] = 0.0  # an all-zero stretch
    w[3, 7] = 0.3  # an outlier: clipping it pays
    x = torch.randn(n, cols, generator=g) * (torch.rand(cols, generator=g) * 3 + 0.1)
    return w.to(torch.bfloat16).to(device), x.to(device)


def _torch_score(w, x, clip_min, clip_max, scheme):
    """The torch search's score of the given ranges, per (group, row): ``d^T A_g d`` (float64)."""
    out_f, in_f = w.shape
    gs = in_f if scheme.group_size == -1 else scheme.group_size
    G = num_groups(in_f, scheme.group_size)
    scale, zero = qparams_from_range(clip_min, clip_max, scheme.bits, scheme.sym)  # [G, out]
    wg = _grouped(w.float(), gs, G)  # [out, G, gs]
    s, z = scale.t().unsqueeze(-1), zero.t().unsqueeze(-1).float()
    d = ((torch.clamp(torch.round(wg / s) + z, 0, scheme.maxq) - z) * s - wg).double()
    xg = _grouped(x.double(), gs, G).permute(1, 0, 2)  # [G, n, gs]
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]
    return torch.einsum("ogi,gij,ogj->go", d, gram, d)


def _compare(w, x, scheme, got, ref):
    same = (got.clip_min == ref.clip_min) & (got.clip_max == ref.clip_max)
    assert same.float().mean() >= 0.98, same.float().mean()
    e_got = _torch_score(w, x, got.clip_min, got.clip_max, scheme)
    e_ref = _torch_score(w, x, ref.clip_min, ref.clip_max, scheme)
    assert torch.all(e_got <= e_ref * (1 + 1e-4) + 1e-12), (e_got - e_ref).max()
    assert got.error_after == pytest.approx(ref.error_after, rel=1e-4)
    assert got.error_before == pytest.approx(ref.error_before, rel=1e-4)
    assert got.error_after <= got.error_before


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test runs on CPU-only machines")
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rows, cols, gs", [(40, 256, 128), (20, 200, 64), (16, 96, 32)])
def test_interpreter_matches_torch(sym, rows, cols, gs):
    from quantkit.kernels.awq_clip import clip_search_triton, clip_supported

    scheme = QuantScheme(4, gs, sym)
    config = AWQConfig(clip_grid=20, max_shrink=0.5)
    w, x = _case(rows, cols, 64, "cpu")
    assert clip_supported(w, gs)
    ref = search_clip(w, x, scheme, config)  # the torch search (CPU)
    G = num_groups(cols, gs)
    xg = _grouped(x.float(), gs, G).permute(1, 0, 2)
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]
    ratios = torch.tensor([1.0 - 0.5 * i / 20 for i in range(20)], dtype=torch.float32)
    cmin, cmax, err0, errb = clip_search_triton(w, gram, ratios, 4, gs, sym)
    from quantkit.methods.awq import ClipSearch

    got = ClipSearch(cmin, cmax, float(err0.double().sum()), float(errb.double().sum()))
    _compare(w, x, scheme, got, ref)


def test_unsupported_groups_fall_back():
    from quantkit.kernels.awq_clip import clip_supported

    w = torch.zeros(4, 512)
    assert not clip_supported(w, 256)
    assert not clip_supported(w, 8)
    assert not clip_supported(w, -1)


@pytest.mark.gpu
@pytest.mark.parametrize("sym", [True, False])
def test_cuda_matches_torch_at_8b_shapes(sym):
    scheme = QuantScheme(4, 128, sym)
    config = AWQConfig()
    for rows, cols in ((4096, 14336), (1024, 4096), (100, 200)):
        w, x = _case(rows, cols, 512, "cuda")
        got = search_clip(w, x, scheme, config)  # the kernel
        ref = search_clip(w, x, scheme, config, fused=False)  # the torch search, also on CUDA
        _compare(w, x, scheme, got, ref)
