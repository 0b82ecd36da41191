"""``QuantLinear``: a linear layer that holds GPTQ-packed weights, and the one kernel dispatch point.

The layer keeps the checkpoint tensors as buffers, exactly as they are stored (layout in
:mod:`quantkit.pack`): ``qweight`` int32 ``[in*bits/32, out]``, ``qzeros`` int32 ``[G, out*bits/32]``,
``scales`` float16 ``[G, out]``, ``g_idx`` int32 ``[in]`` and an optional ``bias [out]``. Its state
dict is therefore the checkpoint's, key for key.

``forward`` goes through :func:`quantized_linear`, which asks :func:`select_backend` once per call:
on CUDA with 4-bit codes the Triton W4A16 kernel (through ``quantkit.kernels.dispatch``, imported
lazily so CPU use never imports Triton); everywhere else the plain-PyTorch reference, which
dequantizes once (cached in the activation dtype) and calls ``F.linear``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.pack import packed_rows
from quantkit.primitives import num_groups
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)

BACKEND_W4A16 = "w4a16"
BACKEND_TORCH = "torch"


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]`` stored GPTQ-packed (see :mod:`quantkit.pack`).

    Buffers: ``qweight`` int32 ``[in*bits/32, out]``, ``qzeros`` int32 ``[G, out*bits/32]``,
    ``scales`` float16 ``[G, out]``, ``g_idx`` int32 ``[in]``, ``bias [out]`` (model dtype) or None.
    ``G = ceil(in / group_size)`` (1 for ``group_size = -1``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        sym: bool,
        bias: bool = False,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        self.sym = sym
        n_groups = num_groups(in_features, group_size)
        int32 = {"dtype": torch.int32, "device": device}
        self.register_buffer("qweight", torch.empty(packed_rows(in_features, bits), out_features, **int32))
        self.register_buffer("qzeros", torch.empty(n_groups, packed_rows(out_features, bits), **int32))
        self.register_buffer(
            "scales", torch.empty(n_groups, out_features, dtype=torch.float16, device=device)
        )
        self.register_buffer("g_idx", torch.empty(in_features, **int32))
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=bias_dtype, device=device))
        else:
            self.bias = None
        # Derived tensors, built on first use and dropped whenever the buffers change.
        self._dequantized: torch.Tensor | None = None
        self._w4a16_prepared: Any = None

    @classmethod
    def from_weight(cls, qw: QuantizedWeight, bias_dtype: torch.dtype | None = None) -> QuantLinear:
        """A layer holding ``qw``'s tensors (shared, not copied); bias cast to ``bias_dtype`` if given."""
        bias = qw.bias
        layer = cls(
            qw.in_features,
            qw.out_features,
            qw.bits,
            qw.group_size,
            qw.sym,
            bias=bias is not None,
            device="meta",
            bias_dtype=bias_dtype or (bias.dtype if bias is not None else torch.float16),
        )
        layer.qweight = qw.qweight
        layer.qzeros = qw.qzeros
        layer.scales = qw.scales.to(torch.float16)
        layer.g_idx = qw.g_idx.to(torch.int32)
        if bias is not None:
            layer.bias = bias.detach().to(bias_dtype or bias.dtype)
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, sym={self.sym}, bias={self.bias is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        return quantized_linear(self, x)

    # -- derived tensors ---------------------------------------------------------------------------

    def dequantized_weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``W [out, in]`` in ``dtype`` on ``device``, computed once and cached until the buffers change."""
        cached = self._dequantized
        if cached is None or cached.dtype != dtype or cached.device != device:
            weight = self.to_quantized_weight().dequantize()
            cached = weight.to(device=device, dtype=dtype)
            self._dequantized = cached
        return cached

    def prepared_w4a16(self) -> Any:
        """The kernel's one-time repack of the buffers (``quantkit.kernels.w4a16.W4A16Weights``)."""
        if self._w4a16_prepared is None:
            from quantkit.kernels.w4a16 import prepare_w4a16_weights

            self._w4a16_prepared = prepare_w4a16_weights(
                self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.group_size, self.sym
            )
        return self._w4a16_prepared

    def to_quantized_weight(self) -> QuantizedWeight:
        """The layer's tensors as a :class:`QuantizedWeight` record (shared, not copied)."""
        return QuantizedWeight(
            qweight=self.qweight,
            qzeros=self.qzeros,
            scales=self.scales,
            g_idx=self.g_idx,
            bits=self.bits,
            group_size=self.group_size,
            sym=self.sym,
            in_features=self.in_features,
            out_features=self.out_features,
            bias=self.bias,
        )

    def invalidate_cache(self) -> None:
        self._dequantized = None
        self._w4a16_prepared = None

    def _apply(self, fn, recurse: bool = True):
        # ``model.to(dtype)`` casts every floating buffer; the checkpoint format keeps scales in
        # float16 (so a reload, a re-save and the kernel all see the same bytes), so put them back.
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float16 and self.scales.device.type != "meta":
            self.scales = self.scales.to(torch.float16)
        self.invalidate_cache()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self.invalidate_cache()
        super()._load_from_state_dict(*args, **kwargs)


def select_backend(layer: QuantLinear, x: torch.Tensor) -> str:
    """Which implementation serves ``layer(x)``: the single place this decision is made.

    The Triton W4A16 path is taken on CUDA for 4-bit codes; ``quantkit.kernels.dispatch`` then checks
    the finer requirements (GPU generation, activation dtype, group layout) and falls back to its own
    reference when one is not met.
    """
    if x.is_cuda and layer.bits == 4:
        return BACKEND_W4A16
    return BACKEND_TORCH


def quantized_linear(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ W.T + b`` -> ``[..., out]`` through the backend :func:`select_backend` picks."""
    if select_backend(layer, x) == BACKEND_W4A16:
        from quantkit.kernels.dispatch import w4a16_linear

        return w4a16_linear(x, layer.prepared_w4a16(), layer.bias)
    weight = layer.dequantized_weight(x.dtype, x.device)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, weight, bias)
