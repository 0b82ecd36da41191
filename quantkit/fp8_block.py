"""Block-scaled FP8 GEMM on Hopper through torch: activations per token and 128 columns, weights per 128x128 block.

This is the arithmetic of DeepSeek-V3-style checkpoints (compressed-tensors ``FP8_BLOCK``, what vLLM serves with
its block GEMM). torch exposes cuBLAS's block-scaled FP8 GEMM as ``torch.nn.functional.scaled_mm`` with
``ScalingType.BlockWise1x128`` for A and ``BlockWise128x128`` for B, on compute capability 9.0. Its scale layouts
are strict (A's scales "outer-dim-major": ``[M, K/128]`` with strides ``(1, M)``; B's are not spelled out beside
the function) and older torch builds lack the function. torch 2.11 on an H100 refused all four plain layouts of B's
``[N/128, K/128]`` scales (each with "scale_a must have strides (1, 1)", naming the operand differently from
here). Other public callers of the same function (torchao's blockwise tests among them) pad the K blocks of B's
scales to a multiple of 4 and pass the transpose, ``[L4, N/128]`` with strides ``(1, L4)``, and keep A's rows a
multiple of 4 (an alignment of the M-major scales, by our reading): that pair is tried first, then every weight
layout with the rows padded, then every one with the rows as they are. On one H100 (torch 2.11, 2026-12-06) one
of them agreed (``pytest -m gpu tests/runtime/test_fp8_runtime.py -k block`` ran the block GEMM and passed).
:func:`probe_block_layout` finds the layout once per device by running the candidates on small random problems
(several M, scales varying block to block) against the float32 emulation of the same rounding; where none agrees,
block checkpoints keep the emulation and the reason is logged. Nothing is guessed at serving time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.kernels.fp8_quant_ref import activations_through_e4m3, quantize_per_group_ref

log = logging.getLogger(__name__)
BLOCK = 128

# How a weight's ``[N/128, K/128]`` block scales may have to be laid out for B = W^T ``[K, N]`` (column-major).
_WEIGHT_LAYOUTS = {
    "[N/128, K/128 padded to 4] transposed": lambda s: torch.nn.functional.pad(s, (0, -s.shape[1] % 4)).t(),
    "[K/128, N/128] row-major": lambda s: s.t().contiguous(),
    "[K/128, N/128] column-major": lambda s: s.contiguous().t(),
    "[N/128, K/128] row-major": lambda s: s.contiguous(),
    "[N/128, K/128] column-major": lambda s: s.t().contiguous().t(),
}


ROW_MULTIPLES = (4, 1)  # activation rows padded to a multiple of 4 first (see above), then as they are


@dataclass(frozen=True)
class BlockLayout:
    """How torch's block-scaled GEMM takes its operands on one device, as the probe found: activation rows padded
    to a multiple of ``row_multiple`` (1: as they are), the weight's block scales laid out by ``weight_scales``."""

    name: str
    row_multiple: int
    weight_scales: Callable[[torch.Tensor], torch.Tensor]


def padded_rows(qx: torch.Tensor, sx: torch.Tensor, multiple: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation codes and their ``[M, K/128]`` scales with M padded to a multiple of ``multiple`` (zero codes,
    unit scales: rows whose products are zero and are sliced off), the scales M-major (strides ``(1, M')``)."""
    pad = -qx.shape[0] % multiple
    if pad:
        qx = torch.cat([qx, qx.new_zeros(pad, qx.shape[1])])
        sx = torch.cat([sx, sx.new_ones(pad, sx.shape[1])])
    return qx, sx.t().contiguous().t()


def _scaled_mm(qx: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor,
               row_multiple: int) -> torch.Tensor:
    F = torch.nn.functional
    m = qx.shape[0]
    qx, sx = padded_rows(qx, sx, row_multiple)
    return F.scaled_mm(qx, weight.t(), scale_a=sx, scale_recipe_a=F.ScalingType.BlockWise1x128,
                       scale_b=block_scale, scale_recipe_b=F.ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)[:m]


def fp8_linear_block(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ W^T + b`` for a prepared ``FP8LinearWeights`` on the ``scaled_mm_block`` path (bfloat16 GEMM out)."""
    shape = x.shape
    qx, sx = quantize_per_group_ref(x.reshape(-1, shape[-1]), BLOCK)
    y = _scaled_mm(qx, sx, w.weight, w.block_scale, w.block_row_multiple)
    if w.bias is not None:
        y = y + w.bias.to(y.dtype)
    return y.to(x.dtype).reshape(*shape[:-1], w.out_features)


def _block_problem(device: torch.device, m: int, n: int, k: int, g: torch.Generator):
    """Random activations and a block-quantized weight whose scales differ from block to block (so that a wrong
    layout gives a wrong answer), and the float32 emulation of their product."""
    from quantkit.fp8_weight import FP8Config, fp8_quantize_weight

    x = torch.randn(m, k, device=device, generator=g) * torch.exp2(
        torch.randint(-3, 4, (m, k // BLOCK), device=device, generator=g).float()).repeat_interleave(BLOCK, 1)
    w = torch.randn(n, k, device=device, generator=g) * torch.exp2(
        torch.randint(-3, 4, (n // BLOCK, k // BLOCK), device=device, generator=g).float()
    ).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    rec, _ = fp8_quantize_weight(w, FP8Config(weights="block", block=(BLOCK, BLOCK)))  # scales [N/128, K/128]
    x = x.to(torch.bfloat16)
    qx, sx = quantize_per_group_ref(x, BLOCK)
    ref = activations_through_e4m3(x, BLOCK) @ rec.dequantize(device).t()
    return qx, sx, rec.weight, rec.weight_scale.float(), ref


@functools.cache
def probe_block_layout(device_index: int):
    """``(layout, reason)`` for CUDA device ``device_index``: the :class:`BlockLayout` under which torch's
    block-scaled GEMM agrees with the emulation, or ``(None, why not)``. Memoized: one probe per device and process."""
    F = torch.nn.functional
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return None, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return None, "torch's block-scaled FP8 GEMM runs on compute capability 9.0 only"
    device = torch.device("cuda", device_index)
    g = torch.Generator(device=device).manual_seed(0)
    problems = [_block_problem(device, m, 256, 384, g) for m in (1, 3, 64)]
    tried = []
    candidates = [BlockLayout(f"weight scales {name}, rows " + (f"padded to {rows}" if rows > 1 else "as they are"),
                              rows, fn) for rows in ROW_MULTIPLES for name, fn in _WEIGHT_LAYOUTS.items()]
    for layout in candidates:
        try:
            worst = 0.0
            for qx, sx, wq, ws, ref in problems:
                y = _scaled_mm(qx, sx, wq, layout.weight_scales(ws), layout.row_multiple).float()
                worst = max(worst, float((y - ref).norm() / ref.norm()))
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            tried.append(f"{layout.name}: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}")
            continue
        if worst < 1e-2:  # bfloat16 output: ~4e-3 of rounding
            return layout, f"torch block-scaled FP8 GEMM ({layout.name})"
        tried.append(f"{layout.name}: off by {worst:.1e} against the emulation")
    reason = "torch's block-scaled FP8 GEMM did not match the emulation: " + "; ".join(tried)
    log.info("FP8 block weights on %s take the float32 emulation: %s", device, reason)
    return None, reason
