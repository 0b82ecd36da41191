"""Per-token FP8 (e4m3) quantization of activations in one launch: ``q = e4m3(x / s)``, ``s = absmax(row) / 448``
(or a static scale), for the FP8 linear (``quantkit.fp8_linear``).

Why a kernel: in plain PyTorch this is four launches (abs, amax, divide-and-clamp, cast) and three passes over
``x``; at decode those launches cost more than the GEMM's own work. Here each program owns one row: rows of up to
``WHOLE_ROW_MAX`` values are loaded once and quantized from registers; longer ones take a first loop for the absmax
and a second to quantize (the row re-read from L2). No host synchronization: CUDA graphs capture it. The reference
is :func:`quantkit.kernels.fp8_quant_ref.quantize_per_token_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import interpreting, pdl_launch, programmatic_launch

FP8_MAX = tl.constexpr(448.0)
_TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: the scale of an all-zero row
WHOLE_ROW_MAX = 16384  # longest row held in registers (16 warps: 32 float32 values a thread)


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
                      STATIC: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_ROW: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # as the decoder's small kernels: the GEMM behind may launch (and prefetch weights) while this runs
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    if WHOLE_ROW:  # the row fits one block: read once, kept in registers between the absmax and the rounding
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        if not STATIC:
            scale = e4m3_scale(tl.max(tl.abs(x), axis=0))
        tl.store(q_ptr + row * stride_qm + ks, e4m3_codes(x, scale), mask=ks < K)
    else:
        if not STATIC:
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
    # Rows up to WHOLE_ROW_MAX values are read once: a looped row costs each program two dependent passes of loads
    # (with only this change the H100's FP8 prefill of 2048 tokens went from 1.00x to 1.34x bf16, docs/fp8.md);
    # longer rows loop over blocks of 2048.
    whole = k <= WHOLE_ROW_MAX
    block_k = max(16, triton.next_power_of_2(k)) if whole else 2048
    warps = 4 if block_k <= 1024 else 8 if block_k <= 4096 else 16
    pdl = programmatic_launch(x.device)
    if m:
        _quant_row_kernel[(m,)](x, q, s, input_scale if static else s, k, x.stride(0), q.stride(0),
                                STATIC=static, BLOCK_K=block_k, WHOLE_ROW=whole, PDL=pdl, num_warps=warps,
                                **pdl_launch(pdl))
    return q, s


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes ``[M, K]`` and float32 scales ``[M, G]`` of ``x``: per row (``group`` 0, the per-token kernel),
    or per row and run of ``group`` columns (block-scaled weights), as the FP8 linears quantize their inputs; the
    MoE kernels' FP8 experts round theirs with it."""
    if group:
        from quantkit.kernels.fp8_quant_ref import quantize_per_group_ref

        return quantize_per_group_ref(x, group)
    return quantize_per_token(x)
