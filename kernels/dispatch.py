"""The single dispatch point between quantkit's layers and the W4A16 kernels, and the 16-bit linears' GEMV.

:func:`w4a16_linear`: the kernel the weights' plan holds where ``w4a16_select.w4a16_supports`` passes, else the
plain-PyTorch reference (also the custom op ``quantkit::w4a16_linear``, :mod:`quantkit.kernels.ops`).
:func:`dense_linear`: the GEMV of :mod:`quantkit.kernels.gemv` at batch-1 decode on CUDA, else cuBLAS. Kernel
modules are imported lazily: importing this file never imports or compiles Triton code.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from quantkit.kernels.device_info import gpu_arch
from quantkit.kernels.w4a16_select import w4a16_supports


def _kernel_supports(x: torch.Tensor, prepared) -> tuple[bool, str]:
    """Whether a W4A16 kernel can run ``x [..., K]`` against ``prepared`` (W4A16Weights)."""
    if x.shape[-1] != prepared.in_features:
        return False, f"x has {x.shape[-1]} features, the weight {prepared.in_features}"
    return w4a16_supports(prepared.facts(), gpu_arch(x.device), x.dtype)


def w4a16_linear(x: torch.Tensor, prepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., N]`` for a ``W4A16Weights`` from ``prepare_w4a16_weights``."""
    from quantkit.kernels import w4a16_weights

    x2 = x.reshape(-1, x.shape[-1])
    ok, _ = _kernel_supports(x2, prepared)
    if ok and prepared.plan is not None and prepared.plan.choice(x2.shape[0]).kernel != "reference":
        from quantkit.kernels import w4a16

        y = w4a16.w4a16_matmul(x2, prepared)
    else:
        y = w4a16_weights.w4a16_matmul_ref(x2, prepared)
    y = y.reshape(*x.shape[:-1], prepared.out_features)
    return y if bias is None else y + bias.to(y.dtype)


def _gemv_wanted(device_type: str, m: int, dtype: torch.dtype) -> bool:
    """Whether a 16-bit linear of ``m`` rows goes to the GEMV: CUDA, bf16 or fp16, ``QUANTKIT_BF16_GEMV`` not 0 (read
    on every call, for A/B runs), and m = 1: the kernel takes up to ``gemv.MAX_M`` rows but beats cuBLAS at M = 1
    only (bench/NOTES_decode.md)."""
    if device_type != "cuda" or m != 1 or dtype not in (torch.bfloat16, torch.float16):
        return False
    return os.environ.get("QUANTKIT_BF16_GEMV", "1") != "0"


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias)``: the one selection point between the GEMV and cuBLAS."""
    x2 = x.reshape(-1, x.shape[-1])
    if _gemv_wanted(x.device.type, x2.shape[0], x.dtype):
        from quantkit.kernels.gemv import gemv, gemv_supports

        if gemv_supports(x2, weight, bias)[0]:
            return gemv(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
