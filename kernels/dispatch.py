"""The single dispatch point between quantkit's layers and the W4A16 kernels.

:func:`kernel_supports` is the one capability check (``(ok, reason)``, from
:func:`quantkit.kernels.w4a16_select.w4a16_supports`); :func:`w4a16_linear` runs the kernel the weights' plan
holds when it passes and the plain-PyTorch reference otherwise. Kernel modules are imported lazily, so importing
this file never imports or compiles Triton code. The same entry is registered as the PyTorch custom op
``quantkit::w4a16_linear`` (:mod:`quantkit.kernels.ops`) for use inside ``torch.compile``.
"""

from __future__ import annotations

import torch

from quantkit.kernels.device_info import capability
from quantkit.kernels.w4a16_select import gpu_arch, w4a16_supports


def kernel_supports(x: torch.Tensor, prepared) -> tuple[bool, str]:
    """Whether a W4A16 kernel can run ``x [..., K]`` against ``prepared`` (W4A16Weights)."""
    if x.shape[-1] != prepared.in_features:
        return False, f"x has {x.shape[-1]} features, the weight {prepared.in_features}"
    arch = gpu_arch(capability(x.device)) if x.is_cuda else None
    return w4a16_supports(prepared.facts(), arch, x.dtype)


def w4a16_linear(x: torch.Tensor, prepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., N]`` for a ``W4A16Weights`` from ``prepare_w4a16_weights``."""
    from quantkit.kernels import w4a16_weights

    x2 = x.reshape(-1, x.shape[-1])
    ok, _ = kernel_supports(x2, prepared)
    if ok and prepared.plan is not None and prepared.plan.choice(x2.shape[0]).kernel != "reference":
        from quantkit.kernels import w4a16

        y = w4a16.w4a16_matmul(x2, prepared)
    else:
        y = w4a16_weights.w4a16_matmul_ref(x2, prepared)
    y = y.reshape(*x.shape[:-1], prepared.out_features)
    return y if bias is None else y + bias.to(y.dtype)
