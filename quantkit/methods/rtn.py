"""Round-to-nearest: per-group min/max (asymmetric) or absmax (symmetric) scales, no calibration.

The baseline every other method must beat, and the rounding core the others reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from quantkit.config import QuantScheme
from quantkit.primitives import compute_qparams, dequantize, quantize
from quantkit.qtensor import QuantizedWeight

if TYPE_CHECKING:  # the RTN core (used by AWQ's core) stays free of the walker; only RTNMethod meets it
    from quantkit.calibrate.walker import LayerContext, LayerResult


@dataclass(frozen=True)
class RTNResult:
    """Codes ``[out, in]``, ``scales``/``zeros`` ``[G, out]``, ``g_idx [in]`` and the relative weight error."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    weight_error: float


def rtn_quantize(w: torch.Tensor, scheme: QuantScheme, chunk_elements: int = 1 << 20) -> RTNResult:
    """Round ``w [out, in]`` to the nearest point of its per-group grid.

    Rows are quantized a block of about ``chunk_elements`` values at a time (each row's groups are its own),
    so the float32 temporaries are a block's, not the weight's: what bounds a streamed run's memory."""
    scales, zeros, g_idx = compute_qparams(w, scheme.bits, scheme.group_size, scheme.sym)
    codes = torch.empty(w.shape, dtype=torch.int32, device=w.device)
    err2 = norm2 = 0.0
    step = max(1, chunk_elements // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows = slice(start, start + step)
        w32 = w[rows].float()
        codes[rows] = quantize(w32, scales[:, rows], zeros[:, rows], g_idx, scheme.bits)
        diff = dequantize(codes[rows], scales[:, rows], zeros[:, rows], g_idx).sub_(w32)
        err2 += float(diff.double().pow(2).sum())
        norm2 += float(w32.double().pow(2).sum())
    err = (err2 ** 0.5) / max(norm2 ** 0.5, 1e-12)
    return RTNResult(codes, scales, zeros, g_idx, float(err))


@dataclass(frozen=True)
class RTNMethod:
    """The walker's view of RTN: every linear of a layer rounded independently."""

    scheme: QuantScheme
    name: str = "rtn"
    needs_calibration: bool = False

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        from quantkit.calibrate.walker import LayerResult

        weights, stats = {}, {}
        for name, linear in ctx.linears.items():
            res = rtn_quantize(linear.weight.data, self.scheme)
            weights[name] = QuantizedWeight.from_codes(
                res.codes, res.scales, res.zeros, res.g_idx, self.scheme, bias=linear.bias
            )
            stats[name] = {"weight_error": res.weight_error}
            install_rows(linear, res)
        # the layer holds exactly what the packed weights dequantize to (scales are on the fp16 grid already)
        return LayerResult(weights=weights, stats=stats, installed=frozenset(weights))


@torch.no_grad()
def install_rows(linear: torch.nn.Linear, res: RTNResult, chunk_elements: int = 1 << 20) -> None:
    """Put the dequantized ``res`` into ``linear.weight``, a block of rows at a time (no whole float32 copy)."""
    w = linear.weight.data
    step = max(1, chunk_elements // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows = slice(start, start + step)
        w[rows].copy_(dequantize(res.codes[rows], res.scales[:, rows], res.zeros[:, rows], res.g_idx))
