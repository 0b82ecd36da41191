"""The front door of the linears: quantkit's layers (``QuantLinear``, the runtime's ``Linear``) call only this.

W4A16: :func:`prepare_w4a16` at load repacks a layer's GPTQ tensors, plans its kernel per M bucket
(:mod:`quantkit.kernels.w4a16_select`) and binds each planned kernel to its launcher
(:func:`quantkit.kernels.w4a16.bind_launcher`); :func:`w4a16_linear` then runs the launcher of the call's bucket,
or the plain-PyTorch reference where none was bound (off CUDA, unsupported layers, non-16-bit activations). The
choice is made once: no support check or plan search per call. The custom op ``quantkit::w4a16_linear``
(:mod:`quantkit.kernels.ops`) rebuilds the same record from its tensors and comes here too.

:func:`dense_linear`: the GEMV of :mod:`quantkit.kernels.gemv` at batch-1 decode on CUDA, else cuBLAS.
Kernel modules are imported lazily: importing this file never imports or compiles Triton code.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F

from quantkit.kernels.device_info import gpu_arch
from quantkit.kernels.w4a16_select import M_BUCKETS, LayerFacts, W4A16Plan, plan_w4a16, w4a16_supports
from quantkit.kernels.w4a16_weights import (
    W4A16Weights,
    prepare_w4a16_weights,
    reference_w4a16_weights,
    w4a16_matmul_ref,
)

_KERNEL_DTYPES = frozenset((torch.float16, torch.bfloat16))
_LAST_BUCKET = len(M_BUCKETS) - 1
assert M_BUCKETS == tuple(1 << i for i in range(len(M_BUCKETS)))  # bucket index = bit length of m - 1


def prepare_w4a16(qweight, qzeros, scales, g_idx, bits, group_size, sym) -> W4A16Weights:
    """Load time: on CUDA the kernels' repack with its plan and bound launchers; elsewhere the copy-free view the
    reference reads (also behind the custom op under ``torch.compile``). Arguments as ``prepare_w4a16_weights``."""
    if not qweight.is_cuda:
        return reference_w4a16_weights(qweight, qzeros, scales, g_idx, bits, group_size, sym)
    return bind(prepare_w4a16_weights(qweight, qzeros, scales, g_idx, bits, group_size, sym))


def bind(weights: W4A16Weights) -> W4A16Weights:
    """``weights`` with the launchers of its plan (unchanged without a plan: the reference serves it), and the
    CUTLASS kernel's operands where the plan has a CUTLASS entry and the machine can build it (made once here, not
    per call; where it cannot, the entry's fallback serves and the memory is not spent)."""
    if weights.plan is None:
        return weights
    launchers = bound_launchers(weights.facts(), weights.plan.arch, weights.plan.card)
    cutlass = None
    if launchers is not None and any(choice.kernel == "cutlass" for _, choice in weights.plan.choices):
        from quantkit.kernels import w4a16_cutlass

        if w4a16_cutlass.buildable():
            cutlass = w4a16_cutlass.prepare(weights)
    return dataclasses.replace(weights, launchers=launchers, cutlass=cutlass)


@functools.lru_cache(maxsize=4096)
def planned(facts: LayerFacts, arch: str | None, card: str | None = None) -> tuple[W4A16Plan | None, tuple | None]:
    """``(plan, launchers)`` of a layer on ``arch`` (and card), memoized per shape like the plan (the custom op's
    lookup)."""
    return plan_w4a16(facts, arch, card), bound_launchers(facts, arch, card)


@functools.lru_cache(maxsize=4096)
def bound_launchers(facts: LayerFacts, arch: str | None, card: str | None = None) -> tuple | None:
    """One launcher per M bucket of ``M_BUCKETS`` (None: the reference), or None where no kernel serves the layer
    (the support check, made here once per layer shape and GPU)."""
    plan = plan_w4a16(facts, arch, card)
    if plan is None or not w4a16_supports(facts, arch)[0]:
        return None
    if all(choice.kernel == "reference" for _, choice in plan.choices):
        return None
    from quantkit.kernels.w4a16 import bind_launcher

    return tuple(bind_launcher(choice, facts, bucket) for bucket, choice in plan.choices)


def w4a16_linear(x: torch.Tensor, prepared: W4A16Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., N]`` for a ``W4A16Weights`` from :func:`prepare_w4a16`."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] != prepared.in_features:
        raise ValueError(f"x has {x2.shape[1]} features, the weight {prepared.in_features}")
    launchers = prepared.launchers
    run = None
    if launchers is not None and x2.dtype in _KERNEL_DTYPES:
        run = launchers[min(max(x2.shape[0] - 1, 0).bit_length(), _LAST_BUCKET)]
    y = run(x2, prepared) if run is not None else w4a16_matmul_ref(x2, prepared)
    y = y.reshape(*x.shape[:-1], prepared.out_features)
    return y if bias is None else y + bias.to(y.dtype)


def kernel_supports(x: torch.Tensor, prepared: W4A16Weights) -> tuple[bool, str]:
    """Whether a W4A16 kernel can run ``x [..., K]`` against ``prepared`` (for explanations and tests; the call
    path reads the launchers bound at load instead)."""
    if x.shape[-1] != prepared.in_features:
        return False, f"x has {x.shape[-1]} features, the weight {prepared.in_features}"
    return w4a16_supports(prepared.facts(), gpu_arch(x.device), x.dtype)


def _gemv_wanted(device_type: str, m: int, dtype: torch.dtype) -> bool:
    """Whether a 16-bit linear of ``m`` rows goes to the GEMV: CUDA, bf16 or fp16, ``QUANTKIT_BF16_GEMV`` not 0 (read
    on every call, for A/B runs), and m = 1: the kernel takes up to ``gemv.MAX_M`` rows but beats cuBLAS at M = 1
    only (bench/archive/NOTES_decode.md)."""
    if device_type != "cuda" or m != 1 or dtype not in (torch.bfloat16, torch.float16):
        return False
    return os.environ.get("QUANTKIT_BF16_GEMV", "1") != "0"


def dense_kernel(m: int, weight: torch.Tensor) -> str:
    """Which kernel :func:`dense_linear` runs for ``m`` rows of the weight's dtype on its device: "gemv" or "cublas"
    (off CUDA: "torch"). For reports; shapes the GEMV refuses fall back to cuBLAS at the call."""
    if weight.device.type != "cuda":
        return "torch"
    return "gemv" if _gemv_wanted("cuda", m, weight.dtype) else "cublas"


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias)``: the one selection point between the GEMV and cuBLAS."""
    x2 = x.reshape(-1, x.shape[-1])
    if _gemv_wanted(x.device.type, x2.shape[0], x.dtype):
        from quantkit.kernels.gemv import gemv, gemv_supports

        if gemv_supports(x2, weight, bias)[0]:
            return gemv(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
