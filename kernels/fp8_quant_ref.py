"""The plain-PyTorch reference of ``fp8_quant.quantize_per_token``: per-token e4m3 quantization of activations.

A torch-only module beside the kernel's, so that the runtime's reference path (the CPU) never imports triton.
"""

from __future__ import annotations

import torch

from quantkit.primitives import dequantize_fp8, fp8_scale, quantize_fp8


def quantize_per_token_ref(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [M, K], s float32 [M, 1])`` of ``x [M, K]``: per-token scales, or the static
    ``input_scale`` (one value) for every row."""
    if input_scale is None:
        s = fp8_scale(x.abs().amax(dim=-1, keepdim=True))
    else:
        s = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return quantize_fp8(x, s), s.contiguous()


def quantize_per_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [M, K], s float32 [M, ceil(K / group)])`` of ``x [M, K]``: one scale per token and
    run of ``group`` columns (the last run may be shorter), as block-scaled FP8 GEMMs quantize activations."""
    m, k = x.shape
    n_groups = -(-k // group)
    pad = n_groups * group - k
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    s = fp8_scale(padded.view(m, n_groups, group).abs().amax(dim=-1))  # [M, G]
    q = quantize_fp8(xf, s.repeat_interleave(group, dim=1)[:, :k])
    return q, s


def activations_through_e4m3(x: torch.Tensor, group: int = 0, input_scale: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """Float32 values of ``x [M, K]`` after the e4m3 rounding a FP8 linear applies to its input: per token (or the
    static ``input_scale``), or with ``group`` per token and run of ``group`` columns (block weights)."""
    if group:
        q, s = quantize_per_group_ref(x, group)
        return dequantize_fp8(q, s.repeat_interleave(group, dim=1)[:, : x.shape[1]])
    return dequantize_fp8(*quantize_per_token_ref(x, input_scale))


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 KV cache's entry of ``x [..., D]`` (keys or values, one vector a token and head): ``(codes
    float8_e4m3fn [..., D], scale float32 [...])``, each vector scaled by its own absmax as a token's activations
    are (``quantize_per_token_ref``)."""
    s = fp8_scale(x.abs().amax(dim=-1))
    return quantize_fp8(x, s[..., None]), s


def dequantize_kv_ref(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads of FP8 cache entries: ``codes [..., D] x scale [...]`` rounded to the model's dtype."""
    return dequantize_fp8(codes, scale[..., None]).to(dtype)
