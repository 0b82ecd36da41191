"""FP8 (E4M3) weights with float32 scales: per output channel (default), per tensor, or per 128x128 block.

No calibration for the weights: each scale is the absmax of its channel / tensor / block over 448
(``quantkit.primitives.fp8_scale``). The core (:func:`fp8_quantize_weight`) is tensors and a frozen config in, an
:class:`FP8Weight` record out; the record is what the checkpoint writer, the reader and the runtime's FP8 linear
hold (as :class:`quantkit.qtensor.QuantizedWeight` is for INT4). :class:`quantkit.methods.fp8.FP8Method` is the
walker's view of it; the checkpoint layout (compressed-tensors, ``float-quantized``) is in
:mod:`quantkit.checkpoint.fp8`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.primitives import dequantize_fp8, fp8_scale, quantize_fp8

WEIGHT_STRATEGIES = ("channel", "tensor", "block")
ACTIVATION_MODES = ("dynamic", "static")


@dataclass(frozen=True)
class FP8Config:
    """``weights``: scale granularity; ``block``: (rows, columns) of a block; ``activations``: run-time
    scales per token (dynamic) or one calibrated scale per linear (static)."""

    weights: str = "channel"
    activations: str = "dynamic"
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_STRATEGIES:
            raise QuantkitError(f"--weights must be one of {', '.join(WEIGHT_STRATEGIES)}, got {self.weights!r}")
        if self.activations not in ACTIVATION_MODES:
            raise QuantkitError(f"--activations must be dynamic or static, got {self.activations!r}")
        if len(self.block) != 2 or any(b < 16 or b % 16 for b in self.block):
            raise QuantkitError(f"--block must be two positive multiples of 16 (128 128 is what engines serve), "
                                f"got {list(self.block)}")
        if self.weights == "block" and self.activations == "static":
            raise QuantkitError("--weights block takes dynamic activations only (vLLM's block FP8 GEMM quantizes "
                                "activations per token group at run time); drop --calib or use --weights channel")

    @property
    def needs_calibration(self) -> bool:
        return self.activations == "static"


def fp8_config(options: dict) -> FP8Config:
    """An :class:`FP8Config` from option names (``weights``, ``activations``, ``block``), as recipes and the API
    pass them; an unknown name is refused."""
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(FP8Config)})
    if unknown:
        raise QuantkitError(f"fp8 takes weights, activations and block, not {', '.join(unknown)}")
    options = dict(options)
    if "block" in options:
        options["block"] = tuple(options["block"])
    return FP8Config(**options)


@dataclass(frozen=True)
class FP8Weight:
    """One FP8 linear: ``weight`` float8_e4m3fn ``[out, in]``; ``weight_scale`` float32 ``[out, 1]``
    (channel), ``[1]`` (tensor) or ``[ceil(out/b0), ceil(in/b1)]`` (block); ``input_scale`` float32 ``[1]``
    for static activations, else None; ``bias`` ``[out]`` or None."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    strategy: str
    in_features: int
    out_features: int
    block: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def expanded_scale(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The scale of every weight element, broadcastable to ``[out, in]`` (float32)."""
        s = self.weight_scale.to(device).float()
        if self.strategy == "block":
            b0, b1 = self.block
            s = s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
            return s[: self.out_features, : self.in_features]
        return s.reshape(-1, 1) if self.strategy == "channel" else s.reshape(1, 1)

    def dequantize(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Float32 ``[out, in]`` weights, exactly what a reader of the checkpoint reconstructs."""
        return dequantize_fp8(self.weight.to(device), self.expanded_scale(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by checkpoint leaf name (``weight``, ``weight_scale``, ``input_scale``, ``bias``)."""
        out = {"weight": self.weight, "weight_scale": self.weight_scale}
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def to(self, device: torch.device | str) -> FP8Weight:
        """The record with every tensor on ``device``."""
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for k, t in self.tensors().items() if k != "bias")


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Absmax of each ``block`` of ``w [out, in]`` (edge blocks partial): ``[ceil(out/b0), ceil(in/b1)]``."""
    b0, b1 = block
    out_f, in_f = w.shape
    n0, n1 = math.ceil(out_f / b0), math.ceil(in_f / b1)
    padded = torch.nn.functional.pad(w.abs(), (0, n1 * b1 - in_f, 0, n0 * b0 - out_f))
    return padded.reshape(n0, b0, n1, b1).amax(dim=(1, 3))  # [n0, b0, n1, b1] -> [n0, n1]


def fp8_weight_scale(w: torch.Tensor, config: FP8Config) -> torch.Tensor:
    """Float32 scales of ``w [out, in]`` in the checkpoint's shape for ``config.weights``."""
    w = w.float()
    if config.weights == "channel":
        return fp8_scale(w.abs().amax(dim=1, keepdim=True))  # [out, 1]
    if config.weights == "tensor":
        return fp8_scale(w.abs().amax()).reshape(1)  # [1]
    return fp8_scale(_block_amax(w, config.block))


def fp8_quantize_weight(w: torch.Tensor, config: FP8Config, bias: torch.Tensor | None = None,
                        input_scale: torch.Tensor | None = None) -> tuple[FP8Weight, float]:
    """Round ``w [out, in]`` to e4m3 under its scales: ``(record, relative weight error)``."""
    out_f, in_f = w.shape
    scale = fp8_weight_scale(w, config)
    block = config.block if config.weights == "block" else None
    shell = FP8Weight(torch.empty(0), scale, config.weights, in_f, out_f, block)
    q = quantize_fp8(w, shell.expanded_scale(w.device))
    record = dataclasses.replace(shell, weight=q, input_scale=input_scale,
                                 bias=None if bias is None else bias.detach())
    w32 = w.float()
    err = (record.dequantize(w.device) - w32).norm() / w32.norm().clamp_min(1e-12)
    return record, float(err)
