"""FP8 linears of the runtime, built from checkpoint tensors (compressed-tensors names: ``weight`` e4m3,
``weight_scale``, ``input_scale``), and fused (q/k/v, gate/up) where that keeps the arithmetic exact.

The scale strategy is read from the scale's shape: ``[N, 1]`` / ``[N]`` per channel, one value per tensor, a
2-D grid per block (block sizes 128, 64, 32, 256 or 16 tried in that order to match the grid). Fusing concatenates
weights along N with their per-row scales (per-tensor scales expanded to rows: the same codes, the same products);
static activation scales that differ between the parts, and block weights, keep the parts apart.
"""

from __future__ import annotations

import math

import torch

from quantkit.config import QuantkitError
from quantkit.fp8_linear import concat_fp8_linears, prepare_fp8_linear
from quantkit.runtime.linear import Linear

_BLOCK_SIZES = (128, 64, 32, 256, 16)


def scale_strategy(weight: torch.Tensor, weight_scale: torch.Tensor, name: str) -> tuple[str, tuple[int, int] | None]:
    """``(strategy, block)`` of a stored scale of ``weight [N, K]``."""
    n, k = weight.shape
    if weight_scale.numel() == 1:
        return "tensor", None
    if tuple(weight_scale.shape) in ((n, 1), (n,)):
        return "channel", None
    if weight_scale.dim() == 2:
        rows, cols = weight_scale.shape
        for b0 in _BLOCK_SIZES:
            for b1 in _BLOCK_SIZES:
                if math.ceil(n / b0) == rows and math.ceil(k / b1) == cols:
                    return "block", (b0, b1)
    raise QuantkitError(f"{name}.weight_scale has shape {list(weight_scale.shape)}, which fits no FP8 scale layout of "
                        f"a [{n}, {k}] weight")


def _parts(get: dict, name: str):
    weight = get[f"{name}.weight"]
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantkitError(f"{name}.weight is {weight.dtype} beside a weight_scale; FP8 weights are float8_e4m3fn")
    scale = get[f"{name}.weight_scale"].float()
    strategy, block = scale_strategy(weight, scale, name)
    return weight, scale, strategy, block, get.get(f"{name}.input_scale")


def _first_expert_without_static_inputs(get: dict, prefix: str, names: tuple[str, str, str]) -> str:
    """The first expert's first linear; static input scales are refused (quantkit writes none for experts)."""
    first = f"{prefix}0.{names[0]}"
    if f"{first}.input_scale" in get:
        raise QuantkitError(f"{first}: static FP8 activation scales on MoE experts are not served by the runtime")
    return first


def _expert_record(get: dict, name: str):
    """One expert linear as an ``FP8Weight`` record: its e4m3 codes and scales as stored."""
    from quantkit.fp8_weight import FP8Weight

    w, scale, strategy, block, _ = _parts(get, name)
    return FP8Weight(w, scale, strategy, w.shape[1], w.shape[0], block)


def fp8_expert_weights(get: dict, prefix: str, n: int, names: tuple[str, str, str]):
    """``(weight, act_quant)`` for FP8 experts ``{prefix}{e}.{name}``: ``weight(name)`` the float32 dequantized
    ``[N, K]`` weight, ``act_quant`` the activations' rounding the checkpoint declares (per token; per token and
    column group for block weights). Static input scales are refused: quantkit writes none for experts."""
    from quantkit.kernels.fp8_quant_ref import activations_through_e4m3

    block = _expert_record(get, _first_expert_without_static_inputs(get, prefix, names)).block
    group = block[1] if block is not None else 0
    return (lambda name: _expert_record(get, name).dequantize()), lambda x: activations_through_e4m3(x, group)


def fp8_expert_records(get: dict, prefix: str, n: int, names: tuple[str, str, str]) -> list[tuple]:
    """Each expert's ``(gate, up, down)`` as ``FP8Weight`` records (e4m3 codes and their scales, as stored), for
    the fused MoE kernel (``kernels.moe_w4a16.stack_fp8``)."""
    _first_expert_without_static_inputs(get, prefix, names)
    return [tuple(_expert_record(get, f"{prefix}{e}.{lin}") for lin in names) for e in range(n)]


def fp8_linear_from(get: dict, name: str, bias, dtype, device, mode: str):
    """The runtime ``Linear`` of one FP8 linear; ``mode`` "auto", "reference" or "dequantize"."""
    from quantkit.fp8_weight import FP8Weight

    weight, scale, strategy, block, input_scale = _parts(get, name)
    n, k = weight.shape
    if mode == "dequantize":
        dense = FP8Weight(weight, scale, strategy, k, n, block).dequantize(device).to(dtype)
        return Linear(n, dense=dense, bias=bias)
    prepared = prepare_fp8_linear(weight, scale, strategy, block=block, input_scale=input_scale, bias=bias,
                                  device=device, backend="reference" if mode == "reference" else "auto")
    return Linear(n, fp8=prepared, bias=bias)


def fused_fp8_linear(get: dict, names: list[str], dtype, device, mode: str):
    """One runtime ``Linear`` computing ``names``' outputs side by side (every part FP8)."""

    missing = [n for n in names if f"{n}.weight_scale" not in get]
    if missing:
        raise QuantkitError(f"{', '.join(missing)} are 16-bit beside FP8 {names[0]}; mixed fusions are not served")
    biases = [get.get(f"{n}.bias") for n in names]
    parts = [_parts(get, n) for n in names]
    singles = [fp8_linear_from(get, n, None if b is None else b.to(device=device, dtype=dtype), dtype, device, mode)
               for n, b in zip(names, biases)]
    if mode == "dequantize":
        bias = None if biases[0] is None else torch.cat([p.bias for p in singles])
        dense = torch.cat([p.dense for p in singles])
        return Linear(dense.shape[0], dense=dense, bias=bias)
    inputs = [p[4] for p in parts]
    static_differ = any(x is not None for x in inputs) and (
        any(x is None for x in inputs) or any(not torch.equal(x.float().reshape(1), inputs[0].float().reshape(1))
                                              for x in inputs))
    mixed_bias = any(b is not None for b in biases) and any(b is None for b in biases)
    if static_differ or mixed_bias or any(p[2] == "block" for p in parts):
        return Linear(sum(p.out_features for p in singles), parts=singles)
    # the parts' decode choices (the GEMV at M <= 4, the tensor-core GEMM, codes in) carry over: a fused record
    # built from the weights alone once left q/k/v and gate/up on torch._scaled_mm at batch 1
    fused = concat_fp8_linears([p.fp8 for p in singles])
    return Linear(fused.out_features, fp8=fused, bias=fused.bias)
