"""FP8 (E4M3) weights with float32 scales: per output channel (default), per tensor, or per 128x128 block.

No calibration for the weights: each scale is the absmax of its channel / tensor / block over 448
(``quantkit.primitives.fp8_scale``). Activations are quantized at run time, per token (dynamic, the
default), or with one static scale per linear measured on calibration windows (``activations="static"``).

The core (:func:`fp8_quantize_weight`, :class:`FP8Weight`) is in :mod:`quantkit.fp8_weight`;
:class:`FP8Method` is the walker's view of it. The checkpoint layout (compressed-tensors,
``float-quantized``) is in :mod:`quantkit.checkpoint.fp8`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from quantkit.errors import QuantkitError
from quantkit.fp8_weight import (  # noqa: F401  (the core, re-exported: the method's records)
    ACTIVATION_MODES,
    WEIGHT_STRATEGIES,
    FP8Config,
    FP8Weight,
    fp8_config,
    fp8_quantize_weight,
    fp8_weight_scale,
)
from quantkit.primitives import fp8_scale

if TYPE_CHECKING:
    from quantkit.calibrate.walker import LayerContext, LayerResult

@dataclass(frozen=True)
class FP8Method:
    """The walker's view of FP8: each linear rounded on its own; with static activations, each linear's
    input absmax over the calibration windows (as the quantized earlier layers produce them) sets its
    ``input_scale``."""

    config: FP8Config = FP8Config()
    name: str = "fp8"

    @property
    def needs_calibration(self) -> bool:
        return self.config.needs_calibration

    def input_scales(self, ctx: LayerContext) -> dict[str, torch.Tensor]:
        """Static activation scales ``[1]`` of the layer's linears, from their inputs' absmax."""
        from quantkit.calibrate.walker import capture_linear_inputs

        amax: dict[str, torch.Tensor] = {}

        def on_input(name: str, x: torch.Tensor) -> None:
            m = x.detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], m) if name in amax else m

        capture_linear_inputs(ctx.layer, ctx.inputs, list(ctx.linears), on_input)
        if ctx.comm.world_size > 1:
            raise QuantkitError("static FP8 activation scales are calibrated on one rank; drop --gpus")
        return {name: fp8_scale(a).reshape(1).cpu() for name, a in amax.items()}

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        from quantkit.calibrate.walker import LayerResult

        scales = self.input_scales(ctx) if self.config.needs_calibration else {}
        weights, stats = {}, {}
        for name, linear in ctx.linears.items():
            record, err = fp8_quantize_weight(linear.weight.data, self.config, bias=linear.bias,
                                              input_scale=scales.get(name))
            weights[name] = record
            stats[name] = {"weight_error": err}
            if name in scales:
                stats[name]["input_scale"] = float(scales[name])
        return LayerResult(weights=weights, stats=stats)
