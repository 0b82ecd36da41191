"""Per-token FP8 (e4m3) quantization of activations in one launch: ``q = e4m3(x / s)``, ``s = absmax(row) / 448``
(or a static scale), for the FP8 linear (``quantkit.fp8_linear``).

Why a kernel: in plain PyTorch this is four launches (abs, amax, divide-and-clamp, cast) and three passes over
``x``; at decode those launches cost more than the GEMM's own work. Here each program owns one row: a first loop
finds its absmax, a second quantizes it (the row is re-read from L2). No host synchronization: CUDA graphs
capture it. The reference is :func:`quantkit.kernels.fp8_quant_ref.quantize_per_token_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.device_info import interpreting

FP8_MAX = tl.constexpr(448.0)
_TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: the scale of an all-zero row


@triton.jit
def e4m3_scale(amax):
    """A row's dynamic scale from its float32 absmax: ``max(absmax / 448, tiny)``. Shared with the FP8 GEMV
    (kernels/gemv.py), which quantizes its activations in registers and must round exactly as this kernel does."""
    return tl.maximum(amax / FP8_MAX, _TINY)


@triton.jit
def e4m3_codes(x, scale):
    """float32 ``x`` to e4m3 codes (``tl.float8e4nv``): ``x / scale`` clamped to +-448, round to nearest."""
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _quant_row_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm,
                      STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = e4m3_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k0 + ks, e4m3_codes(x, scale), mask=k0 + ks < K)
    tl.store(s_ptr + row, scale)


def quantize_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [M, K], s float32 [M, 1])`` of ``x [M, K]`` (16- or 32-bit, contiguous along K);
    ``input_scale`` (one float32 value): a static scale for every row. Off CUDA (and not interpreting) it runs
    the reference."""
    if x.device.type != "cuda" and not interpreting():
        from quantkit.kernels.fp8_quant_ref import quantize_per_token_ref

        return quantize_per_token_ref(x, input_scale)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D and contiguous along K, got shape {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    static = input_scale is not None
    block_k = min(2048, max(16, triton.next_power_of_2(k)))
    if m:
        _quant_row_kernel[(m,)](x, q, s, input_scale if static else s, k, x.stride(0), q.stride(0),
                                STATIC=static, BLOCK_K=block_k, num_warps=4 if block_k <= 1024 else 8)
    return q, s
