"""Round-to-nearest error bounds and quantization-parameter invariants of quantkit.primitives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.primitives import (
    compute_qparams,
    default_g_idx,
    dequantize,
    fake_quantize,
    num_groups,
    quantize,
)

BITS = (2, 3, 4, 8)


def random_weight(out_features: int, in_features: int, seed: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    if kind == "positive":  # groups without negative values: the asymmetric zero point would be 0
        w = w.abs()
    elif kind == "negative":
        w = -w.abs()
    elif kind == "outliers":
        w[:, :: max(1, in_features // 5)] *= 40
    elif kind == "zero_rows":
        w[::2] = 0
    return w


def per_element(params: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """``[G, out]`` parameters expanded to the weight's ``[out, in]``."""
    return params.t()[:, g_idx.long()].float()


@st.composite
def weight_case(draw):
    bits = draw(st.sampled_from(BITS))
    group_size = draw(st.sampled_from((32, 64, 128, -1)))
    in_features = draw(st.sampled_from((32, 96, 160, 192, 576)))  # 96/160/576 leave partial groups
    out_features = draw(st.integers(1, 24))
    sym = draw(st.booleans())
    kind = draw(st.sampled_from(("normal", "positive", "negative", "outliers", "zero_rows")))
    seed = draw(st.integers(0, 2**31 - 1))
    return bits, group_size, in_features, out_features, sym, kind, seed


@settings(max_examples=80, deadline=None)
@given(weight_case())
def test_rtn_error_is_at_most_half_a_step_inside_the_range(case):
    bits, group_size, in_features, out_features, sym, kind, seed = case
    w = random_weight(out_features, in_features, seed, kind)
    scales, zeros, g_idx = compute_qparams(w, bits, group_size, sym)
    codes = quantize(w, scales, zeros, g_idx, bits)
    dq = dequantize(codes, scales, zeros, g_idx)
    s, z = per_element(scales, g_idx), per_element(zeros, g_idx)
    low, high = (0 - z) * s, (2**bits - 1 - z) * s
    inside = (w >= low) & (w <= high)
    err = (w - dq).abs()
    slack = 1e-6 * s + 1e-7  # float32 rounding of w / s
    assert bool((err[inside] <= s[inside] / 2 + slack[inside]).all())
    # Outside the grid the value clips to the end code: half a step from the group's extreme, plus what the
    # float16 rounding of the scale (relative 2**-11, after the zero point was rounded against the float32
    # scale) moves an end code k steps from zero, k * 2**-11 steps, and half a step's worth of it again for
    # measuring in the rounded step: k = maxq - z at the top, z at the bottom. A symmetric grid clips only at
    # the top (one code fewer above zero than below): k + 1/2 = maxq / 2. An asymmetric one clips at either
    # end, and its k reaches maxq - 1 (8-bit, a group with one large outlier: 0.566 steps, where maxq / 2
    # would allow 0.562).
    maxq = 2**bits - 1
    steps = torch.where(w > high, maxq - z, z) + 0.5
    assert bool((err <= s * (0.5 + steps * 2**-11) + slack).all())


@settings(max_examples=60, deadline=None)
@given(weight_case())
def test_zero_points_and_codes_stay_in_range(case):
    bits, group_size, in_features, out_features, sym, kind, seed = case
    w = random_weight(out_features, in_features, seed, kind)
    scales, zeros, g_idx = compute_qparams(w, bits, group_size, sym)
    maxq = 2**bits - 1
    assert scales.shape == zeros.shape == (num_groups(in_features, group_size), out_features)
    assert bool((scales > 0).all()) and bool(torch.isfinite(scales).all())
    # GPTQ v1 stores zero - 1: every zero point must be in [1, maxq].
    assert int(zeros.min()) >= 1 and int(zeros.max()) <= maxq
    if sym:
        assert bool((zeros == 2 ** (bits - 1)).all())
    codes = quantize(w, scales, zeros, g_idx, bits)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= maxq
    # Scales are on the float16 grid, so a reader using the stored fp16 scales rebuilds the same weights.
    assert torch.equal(scales, scales.half().float())


def test_partial_last_group_uses_only_its_columns():
    # 96 columns at g64: group 1 holds columns 64..95 only, and its scale comes from them alone.
    w = torch.randn(4, 96)
    w[:, 64:] *= 0.01
    scales, zeros, g_idx = compute_qparams(w, 4, 64, sym=False)
    assert torch.equal(g_idx, default_g_idx(96, 64))
    alone_scales, alone_zeros, _ = compute_qparams(w[:, 64:], 4, 64, sym=False)
    assert torch.equal(scales[1], alone_scales[0]) and torch.equal(zeros[1], alone_zeros[0])
    head_scales, _, _ = compute_qparams(w[:, :64], 4, 64, sym=False)
    assert torch.equal(scales[0], head_scales[0])


def test_per_channel_is_one_group():
    w = torch.randn(5, 96)
    scales, _, g_idx = compute_qparams(w, 4, -1, sym=True)
    assert scales.shape == (1, 5) and bool((g_idx == 0).all())
    expected = 2 * w.abs().amax(dim=1) / 15
    assert torch.allclose(scales[0], expected, rtol=1e-3)


@pytest.mark.parametrize("sym", [True, False])
def test_grid_values_survive_a_round_trip(sym):
    # Weights already on a 4-bit grid are reproduced exactly.
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # span the whole grid in every group
    scale = 0.125
    zero = 8
    w = (codes - zero).float() * scale
    scales, zeros, g_idx = compute_qparams(w, 4, 32, sym=sym)
    if not sym:
        assert torch.allclose(fake_quantize(w, scales, zeros, g_idx, 4), w, atol=1e-6)
    else:  # symmetric spans 2*absmax over 15 steps: not this grid, but within half a step
        assert bool(((fake_quantize(w, scales, zeros, g_idx, 4) - w).abs() <= scales.max() / 2 + 1e-6).all())


def test_all_zero_group_is_exact():
    w = torch.zeros(3, 64)
    for sym in (True, False):
        scales, zeros, g_idx = compute_qparams(w, 4, 32, sym=sym)
        assert torch.equal(fake_quantize(w, scales, zeros, g_idx, 4), w)


@pytest.mark.parametrize("out_features,in_features,group_size,sym", [
    (64, 256, 128, True), (33, 200, 64, False), (16, 576, 64, False), (8, 100, -1, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contiguous_group_paths_equal_the_g_idx_paths_bitwise(out_features, in_features, group_size, sym, dtype):
    """The reshape-based paths (no scatter, no gathers) compute exactly what the g_idx ones do,
    a partial last group included."""
    from quantkit.primitives import contiguous_qparams, fake_quantize_contiguous, quantize_contiguous

    torch.manual_seed(0)
    w = (torch.randn(out_features, in_features) * torch.rand(1, in_features) * 3).to(dtype)
    scales, zeros, g_idx = compute_qparams(w, 4, group_size, sym)
    s2, z2 = contiguous_qparams(w, 4, group_size, sym)
    assert torch.equal(scales, s2) and torch.equal(zeros, z2)
    codes = quantize(w, scales, zeros, g_idx, 4)
    assert torch.equal(quantize_contiguous(w, scales, zeros, 4, group_size), codes)
    assert torch.equal(fake_quantize_contiguous(w, 4, group_size, sym), dequantize(codes, scales, zeros, g_idx))
