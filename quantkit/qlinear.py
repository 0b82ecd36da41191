"""``QuantLinear``: a linear layer that holds GPTQ-packed weights; its kernels are reached through one front door.

The layer keeps the checkpoint tensors as buffers, exactly as they are stored (layout in
:mod:`quantkit.pack`): ``qweight`` int32 ``[in*bits/32, out]``, ``qzeros`` int32 ``[G, out*bits/32]``,
``scales`` float16 ``[G, out]``, ``g_idx`` int32 ``[in]`` and an optional ``bias [out]``. Its state
dict is therefore the checkpoint's, key for key.

``forward`` goes through :func:`quantized_linear`, which asks :func:`select_backend`: on CUDA with 4- or
8-bit codes the W4A16 kernels through ``quantkit.kernels.dispatch`` (imported lazily so CPU use never imports
Triton), and inside ``torch.compile`` through the custom op ``quantkit::w4a16_linear`` (:mod:`quantkit.kernels.ops`)
that wraps the same call; everywhere else the plain-PyTorch reference, which dequantizes once (cached in the activation
dtype) and calls ``F.linear``. Inside ``torch.compile`` on the CPU the custom op runs too, with the reference
behind it. Which kernel and config serve each batch size is decided, and bound to its launcher, when the layer's weights
are prepared for the kernels (:meth:`QuantLinear.prepared_w4a16`, at load and on every move to a CUDA device,
through :func:`quantkit.kernels.dispatch.prepare_w4a16`), see :mod:`quantkit.kernels.w4a16_select`.
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
# Code widths the W4A16 kernels read (kernels.w4a16_select.w4a16_supports checks the rest).
KERNEL_BITS = (4, 8)


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
        layer._prepare_for_kernels()
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
        """The weights as the W4A16 entry point reads them (``W4A16Weights``): on CUDA the kernels' one-time repack
        and their plan; elsewhere a copy-free view for the reference behind the custom op (``torch.compile``)."""
        if self._w4a16_prepared is None:
            from quantkit.kernels.dispatch import prepare_w4a16

            self._w4a16_prepared = prepare_w4a16(
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

    def _prepare_for_kernels(self) -> None:
        # Load time: repack for the kernels and decide their plan now (on the CPU the copy-free reference view, for
        # torch.compile), so that neither runs inside a forward nor inside a torch.compile trace of one.
        if self.qweight.device.type != "meta" and self.bits in KERNEL_BITS:
            self.prepared_w4a16()

    def _apply(self, fn, recurse: bool = True):
        # ``model.to(dtype)`` casts every floating buffer; the checkpoint format keeps scales in
        # float16 (so a reload, a re-save and the kernel all see the same bytes), so put them back.
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float16 and self.scales.device.type != "meta":
            self.scales = self.scales.to(torch.float16)
        self.invalidate_cache()
        self._prepare_for_kernels()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self.invalidate_cache()
        super()._load_from_state_dict(*args, **kwargs)
        self._prepare_for_kernels()


def select_backend(layer: QuantLinear, x: torch.Tensor) -> str:
    """Which implementation serves ``layer(x)``: the W4A16 custom op on CUDA for 4- and 8-bit codes (its
    front door runs the plain-PyTorch reference where no kernel launcher was bound at load, the capability check
    ``quantkit.kernels.w4a16_select.w4a16_supports`` having said no), and inside ``torch.compile``; the cached
    dequantized ``F.linear`` otherwise."""
    if layer.bits in KERNEL_BITS and (x.is_cuda or torch.compiler.is_compiling()):
        return BACKEND_W4A16
    return BACKEND_TORCH


def quantized_linear(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ W.T + b`` -> ``[..., out]`` through the backend :func:`select_backend` picks."""
    if select_backend(layer, x) == BACKEND_W4A16:
        if torch.compiler.is_compiling():
            # one opaque node for the compiler (inductor cannot re-emit the Triton / Gluon launchers)
            from quantkit.kernels.ops import w4a16_linear_call

            return w4a16_linear_call(x, layer.prepared_w4a16(), layer.bias)
        from quantkit.kernels.dispatch import w4a16_linear  # eager: the same call without the op's dispatch cost

        return w4a16_linear(x, layer.prepared_w4a16(), layer.bias)
    weight = layer.dequantized_weight(x.dtype, x.device)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, weight, bias)
