"""One linear of the runtime, whichever way its weights are stored: 16-bit, packed INT4 for the W4A16 kernel, or
FP8; the way is fixed when the weights are loaded (``runtime.weights``, ``runtime.fp8_weights``), so a call only
runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Linear:
    """``y = x @ W^T + b``; ``parts``: separate linears whose outputs are concatenated (unfusable). ``gemv``:
    a 16-bit linear may take quantkit's decode GEMV (kernels.dispatch.dense_linear decides); the reference
    backend turns it off (plain PyTorch)."""

    out_features: int
    dense: torch.Tensor | None = None
    packed: object | None = None
    bias: torch.Tensor | None = None
    parts: list[Linear] = field(default_factory=list)
    gemv: bool = True
    fp8: object | None = None  # a quantkit.fp8_linear.FP8LinearWeights (its path chosen at load)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        if self.fp8 is not None:
            from quantkit.fp8_linear import fp8_linear

            return fp8_linear(x, self.fp8)
        if self.packed is not None:
            from quantkit.kernels.dispatch import w4a16_linear

            return w4a16_linear(x, self.packed, self.bias)
        if not self.gemv:
            return torch.nn.functional.linear(x, self.dense, self.bias)
        from quantkit.kernels.dispatch import dense_linear

        return dense_linear(x, self.dense, self.bias)

    @property
    def takes_fp8_codes(self) -> bool:
        """Whether the runtime may call :meth:`from_codes` instead: an FP8 linear that takes e4m3 activations a
        fused producer quantized (``FP8LinearWeights.codes_in``)."""
        return not self.parts and self.fp8 is not None and self.fp8.codes_in

    def from_codes(self, qx: torch.Tensor, sx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``y`` from activations already quantized per token (``qx`` e4m3 ``[M, K]``, ``sx`` float32 ``[M, 1]``):
        what ``self(x)`` gives when ``(qx, sx)`` is ``quantize_per_token(x, input_scale)``."""
        from quantkit.fp8_linear import fp8_linear_codes

        return fp8_linear_codes(qx, sx, self.fp8, out_dtype)

    def nbytes(self) -> int:
        if self.parts:
            return sum(p.nbytes() for p in self.parts)
        if self.fp8 is not None:
            return self.fp8.nbytes()
        tensors = [self.dense, self.bias]
        if self.packed is not None:
            tensors += [self.packed.qweight, self.packed.scales, self.packed.zeros]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
