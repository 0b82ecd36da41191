"""Dequantize-then-cuBLAS for W4A16 prefill: the repacked INT4/INT8 weights written out as a 16-bit ``[N, K]``
matrix by one Triton kernel, then one cuBLAS GEMM.

At large M a W4A16 GEMM is compute-bound, and cuBLAS on 16-bit weights runs the tensor cores closer to their peak
than a kernel that dequantizes inside its main loop; writing and re-reading the 16-bit weight (6 bytes a weight
beside the 0.5 it replaces) is then a small share of the call. Where that share is small enough is measured per
layer shape and M bucket (``bench/bench_w4a16.py`` times it beside the planned kernel and cuBLAS); the selection
table names ``dequant`` only where it measured faster. The plain-PyTorch reference is
``w4a16_weights.w4a16_matmul_ref``; the 16-bit weight lives only for the call (the caching allocator reuses it).

The layout read is ``prepare_w4a16_weights``'s: ``qweight`` int32 ``[N, K * bits / 32]`` (code ``p`` of word ``w``
at bits ``bits * p`` is column ``32 / bits * w + p``), ``scales`` float16 ``[G, N]``, ``zeros`` uint8 ``[G, N]`` or
None (``2 ** (bits - 1)``), groups contiguous of ``group_size`` columns; act-order weights come with ``perm``
(the activations' columns are gathered before the GEMM, as the other kernels do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from quantkit.kernels.w4a16_configs import DequantConfig
from quantkit.kernels.w4a16_weights import W4A16Weights


@triton.jit
def _dequant_kernel(q_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, stride_q, stride_g, GROUP: tl.constexpr,
                    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PER: tl.constexpr = 32 // BITS  # codes a word
    WORDS: tl.constexpr = BLOCK_K // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    word0 = tl.program_id(1) * WORDS
    words = word0 + tl.arange(0, WORDS)  # [W]
    w_ok = (rows[:, None] < N) & (words[None, :] < tl.cdiv(K, PER))
    packed = tl.load(q_ptr + rows[:, None] * stride_q + words[None, :], mask=w_ok, other=0)  # [BN, W] int32
    shifts = tl.arange(0, PER) * BITS  # [PER]
    codes = (packed[:, :, None] >> shifts[None, None, :]) & MASK  # [BN, W, PER]
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
    cols = word0 * PER + tl.arange(0, BLOCK_K)  # [BK]
    ok = (rows[:, None] < N) & (cols[None, :] < K)
    g = cols // GROUP
    scale = tl.load(scales_ptr + g[None, :] * stride_g + rows[:, None], mask=ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + g[None, :] * stride_g + rows[:, None], mask=ok, other=0).to(tl.float32)
    else:
        zero = 2 ** (BITS - 1)
    value = (codes.to(tl.float32) - zero) * scale
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], value.to(out_ptr.dtype.element_ty), mask=ok)


def w4a16_dequantize(w: W4A16Weights, dtype: torch.dtype, config: DequantConfig = DequantConfig()) -> torch.Tensor:
    """The 16-bit ``[N, K]`` weight of ``w`` (in its kernel column order: ``perm``'s, where act-order)."""
    if w.group_size is None:
        raise ValueError("dequantize needs contiguous groups of one length; use w4a16_matmul_ref")
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    grid = (triton.cdiv(n, config.BLOCK_N), triton.cdiv(k, config.BLOCK_K))
    zeros = w.zeros if w.zeros is not None else w.scales  # unread without zero points
    _dequant_kernel[grid](w.qweight, w.scales, zeros, out, n, k, w.qweight.stride(0), w.scales.stride(0),
                          GROUP=min(w.group_size, k), BITS=w.bits, HAS_ZEROS=w.zeros is not None,
                          BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, num_warps=config.num_warps)
    return out


def w4a16_dequant_matmul(x: torch.Tensor, w: W4A16Weights, config: DequantConfig = DequantConfig()) -> torch.Tensor:
    """``x [M, K]`` -> ``x @ W^T`` ``[M, N]`` in ``x``'s dtype: the weight dequantized, then cuBLAS."""
    weight = w4a16_dequantize(w, x.dtype, config)
    return F.linear(x if w.perm is None else x[:, w.perm], weight)
