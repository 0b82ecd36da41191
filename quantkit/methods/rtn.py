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


def rtn_quantize(w: torch.Tensor, scheme: QuantScheme) -> RTNResult:
    """Round ``w [out, in]`` to the nearest point of its per-group grid."""
    scales, zeros, g_idx = compute_qparams(w, scheme.bits, scheme.group_size, scheme.sym)
    codes = quantize(w, scales, zeros, g_idx, scheme.bits)
    w32 = w.float()
    err = (dequantize(codes, scales, zeros, g_idx) - w32).norm() / w32.norm().clamp_min(1e-12)
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
        return LayerResult(weights=weights, stats=stats)
