"""The column gather in front of the paired-nibble kernels (Triton and Gluon): ``x[:, index]`` in one launch,
with the split-K workspace zeroed and the per-K-tile activation sums formed in the same launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import interpreting, programmatic_launch
from quantkit.kernels.w4a16_configs import PAIR_TILE_K


@triton.jit
def _gather_columns_kernel(x_ptr, index_ptr, out_ptr, zero_ptr, sums_ptr, M, K, n_zero, stride_xm,
                           BLOCK: tl.constexpr, SUM_TILE: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
                           WAIT_PREVIOUS: tl.constexpr):
    """``out[m, c] = x[m, index[c]]`` (out contiguous) and, in the same launch, ``zero_ptr[:n_zero] = 0``
    and, with SUM_TILE > 0, ``sums_ptr[m, t]`` = float32 sum of out[m, t*SUM_TILE : (t+1)*SUM_TILE].

    LAUNCH_DEPENDENTS: let a kernel launched after this one with programmatic dependent launch start
    now (it waits with ``griddepcontrol.wait`` before it reads what this one writes). WAIT_PREVIOUS: this one
    is launched that way itself and waits for the kernel before it, before touching memory."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    if WAIT_PREVIOUS:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * K
    m = offs // K
    c = offs % K
    src = tl.load(index_ptr + c, mask=mask, other=0)
    vals = tl.load(x_ptr + m.to(tl.int64) * stride_xm + src, mask=mask, other=0.0)
    tl.store(out_ptr + offs, vals, mask=mask)
    tl.store(zero_ptr + offs, tl.zeros([BLOCK], dtype=zero_ptr.dtype.element_ty), mask=offs < n_zero)
    if SUM_TILE > 0:
        # K is a multiple of SUM_TILE and SUM_TILE divides BLOCK: no tile straddles two rows or programs
        sums = tl.sum(tl.reshape(vals.to(tl.float32), [BLOCK // SUM_TILE, SUM_TILE]), axis=1)
        tiles = tl.program_id(0) * (BLOCK // SUM_TILE) + tl.arange(0, BLOCK // SUM_TILE)
        tl.store(sums_ptr + tiles, sums, mask=tiles < M * (K // SUM_TILE))


def gather_columns(x: torch.Tensor, index: torch.Tensor, zero: torch.Tensor | None = None,
                   tile_sums: torch.Tensor | None = None) -> torch.Tensor:
    """``x[:, index]`` (contiguous) and, in the same small launch, ``zero`` (a contiguous float32 or
    int32 buffer, e.g. split-K partial sums) filled with zeros, and ``tile_sums`` (float32
    ``[M, K / PAIR_TILE_K]``, contiguous) filled with the sum of each ``PAIR_TILE_K`` columns of the
    result: what a kernel that multiplies the codes before subtracting their zero point subtracts.

    The paired-nibble kernels read the activations in ``W4A16Weights.pair_index`` order and, when
    split over K, sum into a zeroed float32 buffer. ``torch.index_select`` over the columns took
    ~7.5 us at every decode shape on the H200 (bench/NOTES_w4a16.md), as long as the GEMM on
    the 4096 x 4096 layer, and the zeroing was one more launch; this is one launch for both.
    """
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), device=x.device, dtype=x.dtype)
    if zero is None:
        zero = torch.empty(0, device=x.device, dtype=torch.float32)
    if not zero.is_contiguous() or zero.dtype not in (torch.float32, torch.int32):
        raise ValueError("zero must be a contiguous float32 or int32 buffer")
    sum_tile = 0
    if tile_sums is not None:
        sum_tile = PAIR_TILE_K
        if k % sum_tile or tile_sums.shape != (m, k // sum_tile) or tile_sums.dtype != torch.float32 \
                or not tile_sums.is_contiguous():
            raise ValueError(f"tile_sums must be a contiguous float32 [M, K / {sum_tile}] buffer, K a multiple "
                             f"of {sum_tile}")
    else:
        tile_sums = zero  # unused
    block = 1024
    grid = (triton.cdiv(max(m * k, zero.numel(), 1), block),)
    # on Hopper launched with PDL too: in a decode step its launch overlaps the norm or activation kernel before it
    pdl = programmatic_launch(x.device)
    _gather_columns_kernel[grid](x, index, out, zero, tile_sums, m, k, zero.numel(), x.stride(0), BLOCK=block,
                                 SUM_TILE=sum_tile, LAUNCH_DEPENDENTS=x.is_cuda and not interpreting(),
                                 WAIT_PREVIOUS=pdl, **({"launch_pdl": True} if pdl else {}))
    return out

