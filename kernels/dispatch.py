"""The single dispatch point between quantkit's layers and its Triton kernels.

Each op gets a ``*_supports`` check returning ``(bool, reason)`` and an entry that runs the kernel
when the check passes and the plain-PyTorch reference otherwise. Kernel modules are imported lazily
so that importing this file never imports or compiles Triton code.
"""

from __future__ import annotations

import torch

from quantkit.kernels.device_info import capability


def _triton_available() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    return True, ""


def kernel_supports(x: torch.Tensor, prepared) -> tuple[bool, str]:
    """Whether the W4A16 Triton kernel can run ``x [..., K]`` against ``prepared`` (W4A16Weights)."""
    if not x.is_cuda:
        return False, "input is not on a CUDA device"
    if capability(x.device) < (8, 0):
        return False, "needs an sm_80 or newer GPU"
    ok, reason = _triton_available()
    if not ok:
        return False, reason
    if x.dtype not in (torch.float16, torch.bfloat16):
        return False, f"activations are {x.dtype}, the kernel takes float16/bfloat16"
    if prepared.bits not in (4, 8):
        return False, f"{prepared.bits}-bit codes are not supported"
    if prepared.group_size is None:
        return False, "groups are not contiguous runs of one length"
    if x.shape[-1] != prepared.in_features:
        return False, f"x has {x.shape[-1]} features, the weight {prepared.in_features}"
    return True, ""


def w4a16_linear(x: torch.Tensor, prepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., N]`` for a ``W4A16Weights`` from ``prepare_w4a16_weights``."""
    from quantkit.kernels import w4a16

    x2 = x.reshape(-1, x.shape[-1])
    ok, _ = kernel_supports(x2, prepared)
    y = w4a16.w4a16_matmul(x2, prepared) if ok else w4a16.w4a16_matmul_ref(x2, prepared)
    y = y.reshape(*x.shape[:-1], prepared.out_features)
    return y if bias is None else y + bias.to(y.dtype)
