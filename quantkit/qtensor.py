"""The record every method produces for one linear layer: packed codes and their parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.config import QuantScheme
from quantkit.pack import pack_gptq, unpack_gptq
from quantkit.primitives import dequantize, num_groups


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized linear in the GPTQ layout (see ``quantkit.pack`` for the bit order).

    ``qweight`` int32 ``[in*bits/32, out]``, ``qzeros`` int32 ``[G, out*bits/32]``, ``scales`` float16
    ``[G, out]``, ``g_idx`` int32 ``[in]``; ``bias`` float ``[out]`` or None.
    """

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    in_features: int
    out_features: int
    bias: torch.Tensor | None = None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor,
        scheme: QuantScheme,
        bias: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> QuantizedWeight:
        """Pack codes ``[out, in]`` with ``scales``/``zeros`` ``[G, out]``; the result lives on ``device``."""
        out_features, in_features = codes.shape
        if not torch.isfinite(scales).all():
            raise FloatingPointError("non-finite quantization scales")
        qweight, qzeros = pack_gptq(codes, zeros, scheme.bits)
        return cls(
            qweight=qweight.to(device),
            qzeros=qzeros.to(device),
            scales=scales.to(torch.float16).to(device),
            g_idx=g_idx.to(torch.int32).to(device),
            bits=scheme.bits,
            group_size=scheme.group_size,
            sym=scheme.sym,
            in_features=in_features,
            out_features=out_features,
            bias=None if bias is None else bias.detach().to(device),
        )

    @property
    def n_groups(self) -> int:
        return self.scales.shape[0]

    @property
    def act_order(self) -> bool:
        """True when ``g_idx`` is not the plain contiguous grouping (act-order)."""
        expected = num_groups(self.in_features, self.group_size)
        if self.group_size == -1:
            return False
        plain = torch.arange(self.in_features, device=self.g_idx.device) // self.group_size
        return self.n_groups != expected or not torch.equal(self.g_idx.long(), plain)

    def unpack(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int32 ``[out, in]``, zeros int32 ``[G, out]``), unpacked on ``device`` (default: where they are)."""
        return unpack_gptq(self.qweight.to(device), self.qzeros.to(device), self.bits, self.in_features,
                           self.out_features)

    def dequantize(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Float32 ``[out, in]`` weights, exactly what any GPTQ reader reconstructs; computed on ``device``
        (an accelerator unpacks a layer's codes in milliseconds, the host in seconds)."""
        codes, zeros = self.unpack(device)
        return dequantize(codes, self.scales.to(device).float(), zeros, self.g_idx.to(device))

    def nbytes(self) -> int:
        tensors = [self.qweight, self.qzeros, self.scales, self.g_idx]
        return sum(t.numel() * t.element_size() for t in tensors)
