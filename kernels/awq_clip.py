"""AWQ's clip search (``awq.search_clip``) in one Triton pass over the weights.

The torch search materializes the rounding error ``d`` of every shrink ratio (``[R, o, G, gs]`` float32) and
scores ``d^T A_g d`` with the inputs' Gram matrix ``A_g``: bound by memory traffic. Here one program holds a tile
of rows x one group of ``W`` and its ``A_g`` and walks the ratios on chip (score ``sum((d A_g) * d)``, one
``tl.dot``), keeping the best per row; the weights are read once.

The grid and rounding follow the torch search op for op (``gptq_solve._qparams``, see gptq_solve's docstring),
so ``d`` is the same bit for bit. The score sums in another order (on CUDA with three TF32 products, which
carry float32's precision): a ratio tying another to float32 rounding can be picked instead
(tests/kernels/test_awq_clip.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.device_info import interpreting
from quantkit.kernels.gptq_solve import _qparams, _rint

_MIN_GROUP, _MAX_GROUP = 16, 128  # tl.dot wants >= 16; A_g [gs, gs] float32 must fit on chip


@triton.jit
def _clip_search_kernel(
    w_ptr, gram_ptr, ratio_ptr, cmin_ptr, cmax_ptr, err0_ptr, errb_ptr, n_rows, n_cols, stride_w, n_ratios,
    inv_maxq, inv_maxq_m1,
    GS: tl.constexpr, GS_P2: tl.constexpr, ROWS: tl.constexpr, MAXQ: tl.constexpr, SYM: tl.constexpr,
    RECIP: tl.constexpr, PRECISION: tl.constexpr,
):
    g = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, GS_P2)
    cols = g * GS + k
    cmask = (k < GS) & (cols < n_cols)
    rmask = rows < n_rows
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    a = tl.load(gram_ptr + g.to(tl.int64) * GS_P2 * GS_P2 + k[:, None] * GS_P2 + k[None, :])  # zero-padded
    # padded columns are 0: they neither move the range (which always holds 0) nor add error (d = 0 there)
    wmin = tl.minimum(tl.min(w, axis=1), 0.0)
    wmax = tl.maximum(tl.max(w, axis=1), 0.0)
    if SYM:  # a symmetric grid clips both sides at the same magnitude
        wmax = tl.maximum(-wmin, wmax)
        wmin = -wmax
    best_e = tl.full([ROWS], float("inf"), tl.float32)
    best_r = tl.full([ROWS], 1.0, tl.float32)
    err0 = tl.zeros([ROWS], tl.float32)
    for i in range(n_ratios):
        r = tl.load(ratio_ptr + i)
        scale, zero = _qparams(wmin * r, wmax * r, inv_maxq, inv_maxq_m1, MAXQ, SYM, RECIP)
        q = tl.minimum(tl.maximum(_rint(tl.math.div_rn(w, scale[:, None])) + zero[:, None], 0.0), MAXQ * 1.0)
        d = (q - zero[:, None]) * scale[:, None] - w
        e = tl.sum(tl.dot(d, a, input_precision=PRECISION) * d, axis=1)
        e = tl.where(e != e, float("inf"), e)  # NaN scores as +inf (the torch search's nan_to_num)
        err0 = tl.where(i == 0, e, err0)
        better = e < best_e  # strict: among equal errors the first (largest) ratio stays
        best_e = tl.where(better, e, best_e)
        best_r = tl.where(better, r, best_r)
    out = g.to(tl.int64) * n_rows + rows  # [G, out] row-major
    tl.store(cmin_ptr + out, wmin * best_r, mask=rmask)
    tl.store(cmax_ptr + out, wmax * best_r, mask=rmask)
    tl.store(err0_ptr + out, err0, mask=rmask)
    tl.store(errb_ptr + out, best_e, mask=rmask)


def clip_supported(w: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`clip_search_triton` takes ``w``: on CUDA (or the interpreter), a float dtype, groups of
    16..128 columns."""
    if w.device.type != "cuda" and not interpreting():
        return False
    gs = w.shape[1] if group_size == -1 else group_size
    return (w.ndim == 2 and _MIN_GROUP <= gs <= _MAX_GROUP
            and w.dtype in (torch.float32, torch.float16, torch.bfloat16))


def clip_search_triton(w: torch.Tensor, gram: torch.Tensor, ratios: torch.Tensor, bits: int, group_size: int,
                       sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``w [out, in]``, the groups' Gram matrices ``gram [G, gs, gs]`` (float32) and shrink ``ratios
    [R]`` (descending from 1): ``(clip_min, clip_max, err_ratio_1, err_best)``, each ``[G, out]`` float32."""
    n_rows, n_cols = w.shape
    gs = n_cols if group_size == -1 else group_size
    G = gram.shape[0]
    gs_p2 = max(16, triton.next_power_of_2(gs))
    w = w if w.stride(1) == 1 else w.contiguous()
    if gs_p2 != gs:
        gram = torch.nn.functional.pad(gram, (0, gs_p2 - gs, 0, gs_p2 - gs))
    gram = gram.to(torch.float32).contiguous()
    ratios = ratios.to(device=w.device, dtype=torch.float32).contiguous()
    outs = [torch.empty((G, n_rows), dtype=torch.float32, device=w.device) for _ in range(4)]
    maxq = 2**bits - 1
    one = torch.ones((), dtype=torch.float32)
    inv_maxq, inv_maxq_m1 = float(one / maxq), float(one / (maxq - 1))
    interp = interpreting()
    rows = 16 if interp else 64  # one warpgroup: wgmma tiles of 64 rows
    extra = {} if interp else {"enable_fp_fusion": False, "num_warps": 4}
    grid = (triton.cdiv(n_rows, rows), G)
    _clip_search_kernel[grid](
        w, gram, ratios, *outs, n_rows, n_cols, w.stride(0), ratios.numel(), inv_maxq, inv_maxq_m1,
        GS=gs, GS_P2=gs_p2, ROWS=rows, MAXQ=maxq, SYM=sym, RECIP=w.device.type == "cuda",
        PRECISION="ieee" if interp else "tf32x3", **extra,
    )
    return tuple(outs)
