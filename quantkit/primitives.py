"""Pure quantization primitives: group indices, quantization parameters, quantize, dequantize.

Conventions (shared by every method, the checkpoint and the kernels):

* A weight ``W`` has the ``nn.Linear`` shape ``[out, in]``; quantization groups run along ``in``.
* ``g_idx`` int ``[in]`` gives the group of each input column. Without act-order it is
  ``arange(in) // group_size``; when ``group_size`` does not divide ``in`` the last group is partial
  (for example 576 columns at g128: four full groups and one of 64). ``group_size = -1`` is one group
  per output channel (``g_idx`` all zeros).
* ``scales`` float ``[G, out]`` and ``zeros`` int ``[G, out]`` (checkpoint orientation).
* Codes are unsigned integers in ``[0, 2**bits)``: ``W ~ (code - zero) * scale``.
* Symmetric: ``zero = 2**(bits-1)`` and ``scale = 2 * absmax / (2**bits - 1)`` (the reference GPTQ
  rule). Asymmetric: the range ``[min(w, 0), max(w, 0)]`` spread over ``2**bits - 1`` steps; the zero
  point is kept in ``[1, 2**bits - 1]`` so GPTQ v1 checkpoints (which store ``zero - 1``) never wrap.
"""

from __future__ import annotations

import math

import torch


def num_groups(in_features: int, group_size: int) -> int:
    """Number of groups along the input dimension (``group_size=-1``: one)."""
    if group_size == -1:
        return 1
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    return math.ceil(in_features / group_size)


def default_g_idx(in_features: int, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``g_idx`` without act-order: contiguous groups, a partial last one where needed."""
    cols = torch.arange(in_features, dtype=torch.int32, device=device)
    if group_size == -1:
        return torch.zeros_like(cols)
    return cols // group_size


def qparams_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, bits: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for values spanning ``[xmin, xmax]`` (any matching shapes).

    Returns ``(scale float32, zero int32)`` of the same shape.
    """
    maxq = 2**bits - 1
    xmin = torch.minimum(xmin.float(), torch.zeros((), device=xmin.device))
    xmax = torch.maximum(xmax.float(), torch.zeros((), device=xmax.device))
    if sym:
        amax = torch.maximum(xmin.abs(), xmax)
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int32)
    else:
        scale = (xmax - xmin) / maxq
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-xmin / safe).to(torch.int32)
        # A group with no negative values would get zero = 0, which GPTQ v1 cannot store. Give up
        # one code instead: zero = 1 and the positive range spread over maxq - 1 steps.
        nonneg = zero < 1
        scale = torch.where(nonneg, xmax / (maxq - 1), scale)
        zero = torch.clamp(zero, 1, maxq)
    # All-zero groups: any positive scale reproduces them exactly.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return to_fp16_grid(scale), zero


def to_fp16_grid(scale: torch.Tensor) -> torch.Tensor:
    """Round scales to values float16 holds (the checkpoint stores fp16), so codes computed against
    them dequantize to exactly what a reader reconstructs."""
    tiny = torch.finfo(torch.float16).tiny
    return scale.float().clamp(tiny, 65504.0).half().float()


def group_ranges(w: torch.Tensor, g_idx: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(group, output) min and max of ``w [out, in]`` under ``g_idx``: two ``[G, out]`` tensors."""
    out_features, in_features = w.shape
    w = w.float()
    index = g_idx.long().view(1, in_features).expand(out_features, in_features)
    init_min = torch.full((out_features, n_groups), float("inf"), device=w.device)
    init_max = torch.full((out_features, n_groups), float("-inf"), device=w.device)
    wmin = init_min.scatter_reduce(1, index, w, reduce="amin", include_self=True)
    wmax = init_max.scatter_reduce(1, index, w, reduce="amax", include_self=True)
    # Groups with no column (possible with a hand-made g_idx) quantize nothing: give them zeros.
    wmin = torch.where(torch.isinf(wmin), torch.zeros_like(wmin), wmin)
    wmax = torch.where(torch.isinf(wmax), torch.zeros_like(wmax), wmax)
    return wmin.t().contiguous(), wmax.t().contiguous()


def compute_qparams(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    g_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantization parameters of ``w [out, in]``.

    Returns ``(scales float32 [G, out], zeros int32 [G, out], g_idx int32 [in])``.
    """
    in_features = w.shape[1]
    if g_idx is None:
        g_idx = default_g_idx(in_features, group_size, device=w.device)
    n_groups = int(g_idx.max().item()) + 1 if in_features else 0
    n_groups = max(n_groups, num_groups(in_features, group_size))
    wmin, wmax = group_ranges(w, g_idx, n_groups)
    scales, zeros = qparams_from_range(wmin, wmax, bits, sym)
    return scales, zeros, g_idx.to(torch.int32)


def quantize(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """Codes (int32 ``[out, in]``) of ``w [out, in]`` under per-group ``scales``/``zeros`` ``[G, out]``."""
    gi = g_idx.long()
    s = scales.t()[:, gi]  # [out, in]
    z = zeros.t()[:, gi]
    q = torch.round(w.float() / s) + z
    return torch.clamp(q, 0, 2**bits - 1).to(torch.int32)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """Float32 weights ``[out, in]`` from codes ``[out, in]`` and ``[G, out]`` parameters."""
    gi = g_idx.long()
    return (codes.float() - zeros.t()[:, gi].float()) * scales.t()[:, gi].float()


def _grouped_view(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 ``w [out, in]`` as ``[out, G, gs]`` contiguous groups, a partial last group zero-padded."""
    out_features, in_features = w.shape
    gs = in_features if group_size == -1 else group_size
    n_groups = num_groups(in_features, group_size)
    w = w.float()
    pad = n_groups * gs - in_features
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_features, n_groups, gs)


def contiguous_qparams(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_qparams`` for contiguous groups (no ``g_idx``), by reductions over a reshaped view
    rather than a scatter: the same ``(scales, zeros) [G, out]``, bit for bit (zero padding of a
    partial group cannot move a range that ``qparams_from_range`` widens to include zero anyway)."""
    wg = _grouped_view(w, group_size)
    return qparams_from_range(wg.amin(dim=-1).t(), wg.amax(dim=-1).t(), bits, sym)


def quantize_contiguous(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """``quantize(w, scales, zeros, default_g_idx(...), bits)`` for contiguous groups, without index
    gathers: codes int32 ``[out, in]``, the same bit for bit."""
    out_features, in_features = w.shape
    s = scales.float().t().unsqueeze(-1)  # [out, G, 1]
    q = torch.round(_grouped_view(w, group_size) / s) + zeros.t().unsqueeze(-1)
    return torch.clamp(q, 0, 2**bits - 1).reshape(out_features, -1)[:, :in_features].to(torch.int32)


def fake_quantize_contiguous(
    w: torch.Tensor, bits: int, group_size: int, sym: bool,
    qparams: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``fake_quantize(w, *compute_qparams(w, ...))`` for contiguous groups, without index gathers:
    float32 ``[out, in]``, the same values bit for bit. ``qparams``: given ``(scales, zeros) [G, out]``."""
    out_features, in_features = w.shape
    scales, zeros = qparams if qparams is not None else contiguous_qparams(w, bits, group_size, sym)
    s = scales.float().t().unsqueeze(-1)  # [out, G, 1]
    z = zeros.t().unsqueeze(-1).float()
    q = torch.clamp(torch.round(_grouped_view(w, group_size) / s) + z, 0, 2**bits - 1)
    return ((q - z) * s).reshape(out_features, -1)[:, :in_features]


def fake_quantize(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """Quantize then dequantize (float32, same shape as ``w``)."""
    return dequantize(quantize(w, scales, zeros, g_idx, bits), scales, zeros, g_idx)


# -- FP8 (E4M3) -------------------------------------------------------------------------------------
# ``float8_e4m3fn``: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest finite 448,
# smallest subnormal 2**-9. A value is stored as ``q = e4m3(x / scale)`` and read as ``q * scale``;
# symmetric, no zero point. Rounding is to nearest, ties to even (the cast torch and the GPUs do);
# values beyond +-448 saturate to +-448 instead of becoming NaN.

FP8_E4M3_MAX = 448.0


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Float32 scale mapping ``amax`` (any shape) onto e4m3's largest value; an all-zero range gets a
    tiny positive scale, so every scale is finite and positive."""
    return (amax.float() / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` codes of ``x / scale`` (``scale`` broadcast against ``x``), saturating at +-448."""
    return (x.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 values ``q * scale`` of e4m3 codes ``q`` (``scale`` broadcast against ``q``)."""
    return q.float() * scale.float()
