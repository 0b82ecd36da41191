"""GPTQ's column solve with one Triton launch per block of columns.

The reference, ``quantkit.methods.gptq._columns``, launches ~12 small torch kernels per column. Here one
program holds a tile of output rows x the block's columns of ``W^T [in, out]`` in registers and walks the
columns: quantize (group parameters at a group's first column, from the updated weights, min/max or the ``mse``
shrink search), write codes and scaled error ``(w - dq) / U_ii``, push the error onto the block's later columns
(rank-1 FMA). Rows are independent, so programs split them; the update after the block stays one torch GEMM.

Arithmetic follows the reference op for op so that codes are bitwise equal: IEEE division (``div_rn``),
round-half-even, scalar divisions as torch does them (CUDA multiplies by the fp32 reciprocal of a
Python-scalar divisor, the CPU divides), the in-block update as one fused multiply-add (as torch's ``addr_``
on the CPU; the interpreter's ``tl.fma`` rounds twice, so float64 emulates it there), and no other
contraction (``enable_fp_fusion=False``). The ``mse`` search sums in another order than torch: a near-tie
can pick another shrink step (see the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from quantkit.kernels.device_info import interpreting

_MAX_BLOCK = 256  # columns per launch held in registers (x the row tile)
_HALF_MAX = tl.constexpr(65504.0)
_HALF_TINY = tl.constexpr(6.103515625e-05)  # torch.finfo(torch.float16).tiny
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + M) - M is x rounded half-to-even for |x| < 2**22


@triton.jit
def _rint(x):
    # |x| >= 2**22 may be off by one unit, far outside [0, maxq]: the clamp after every use gives the same code
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _div_scalar(x, divisor, inv_divisor, RECIP: tl.constexpr):
    if RECIP:
        return x * inv_divisor
    else:
        return tl.math.div_rn(x, divisor)


@triton.jit
def _qparams(xmin, xmax, inv_maxq, inv_maxq_m1, MAXQ: tl.constexpr, SYM: tl.constexpr, RECIP: tl.constexpr):
    """``primitives.qparams_from_range`` for vectors: (scale on the fp16 grid, zero as float)."""
    xmin = tl.minimum(xmin, 0.0)
    xmax = tl.maximum(xmax, 0.0)
    if SYM:
        amax = tl.maximum(-xmin, xmax)
        scale = _div_scalar(2.0 * amax, MAXQ * 1.0, inv_maxq, RECIP)
        zero = tl.zeros_like(scale) + ((MAXQ + 1) // 2)
    else:
        scale = _div_scalar(xmax - xmin, MAXQ * 1.0, inv_maxq, RECIP)
        safe = tl.where(scale > 0, scale, 1.0)
        zero = _rint(tl.math.div_rn(-xmin, safe))
        nonneg = zero < 1
        scale = tl.where(nonneg, _div_scalar(xmax, MAXQ - 1.0, inv_maxq_m1, RECIP), scale)
        zero = tl.minimum(tl.maximum(zero, 1.0), MAXQ * 1.0)
    scale = tl.where(scale > 0, scale, 1.0)
    scale = tl.minimum(tl.maximum(scale, _HALF_TINY), _HALF_MAX).to(tl.float16).to(tl.float32)
    return scale, zero


@triton.jit
def _shrink_error(w, mask, scale, zero, norm, cw, MAXQ: tl.constexpr, EMULATE: tl.constexpr,
                  WEIGHTED: tl.constexpr):
    """``sum cw |(q - z) s - w|^norm`` over the masked rows of the tile ``w [BLOCK, TILE]``: ``[TILE]``
    (``cw [BLOCK]``: the column weights, used when WEIGHTED)."""
    q = tl.minimum(tl.maximum(_rint(tl.math.div_rn(w, scale[None, :])) + zero[None, :], 0.0), MAXQ * 1.0)
    d = tl.abs((q - zero[None, :]) * scale[None, :] - w)
    if EMULATE:
        p = tl.exp2(norm * tl.log2(d.to(tl.float64))).to(tl.float32)
    else:
        p = libdevice.pow(d, norm)
    if WEIGHTED:
        p = p * cw[:, None]
    return tl.sum(tl.where(mask, p, 0.0), axis=0)


@triton.jit
def _group_params(w, rows, start, stop, shrink_ptr, inv_maxq, inv_maxq_m1, norm, cw,
                  MAXQ: tl.constexpr, SYM: tl.constexpr, RECIP: tl.constexpr, MSE: tl.constexpr,
                  N_SHRINK: tl.constexpr, EMULATE: tl.constexpr, WEIGHTED: tl.constexpr):
    """``gptq.group_qparams`` of the tile rows ``[start, stop)`` (block-local columns of W)."""
    mask = ((rows >= start) & (rows < stop))[:, None]
    wmin = tl.min(tl.where(mask, w, float("inf")), axis=0)
    wmax = tl.max(tl.where(mask, w, float("-inf")), axis=0)
    scale, zero = _qparams(wmin, wmax, inv_maxq, inv_maxq_m1, MAXQ, SYM, RECIP)
    if MSE:
        best = _shrink_error(w, mask, scale, zero, norm, cw, MAXQ, EMULATE, WEIGHTED)
        for k in range(N_SHRINK):
            p = tl.load(shrink_ptr + k)
            s, z = _qparams(wmin * p, wmax * p, inv_maxq, inv_maxq_m1, MAXQ, SYM, RECIP)
            err = _shrink_error(w, mask, s, z, norm, cw, MAXQ, EMULATE, WEIGHTED)
            better = err < best
            best = tl.where(better, err, best)
            scale = tl.where(better, s, scale)
            zero = tl.where(better, z, zero)
    return scale, zero


@triton.jit
def _gptq_block_kernel(
    wt_ptr, u_ptr, codes_ptr, err_ptr, cscale_ptr, czero_ptr, gscale_ptr, gzero_ptr, shrink_ptr, cw_ptr,
    i1, n_cols, n_out, ld_u, gs, inv_maxq, inv_maxq_m1, norm,
    BLOCK: tl.constexpr, TILE: tl.constexpr, MAXQ: tl.constexpr, SYM: tl.constexpr, STATIC: tl.constexpr,
    MSE: tl.constexpr, N_SHRINK: tl.constexpr, RECIP: tl.constexpr, EMULATE: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    """Columns ``[i1, i1 + n_cols)`` of ``W^T [in, out]`` for the rows ``[pid * TILE, +TILE)``: codes (int32,
    ``[in, out]``), scaled errors (``err [BLOCK, out]``) and, without STATIC, each group's scale / zero at its
    first column (``[G, out]``). STATIC: per-column ``cscale / czero [in, out]``. EMULATE (interpreter): exact
    fma and pow through float64. WEIGHTED: the mse search weights column ``j``'s error by ``cw [in]``."""
    cols = tl.program_id(0) * TILE + tl.arange(0, TILE)  # output rows of W
    cmask = cols < n_out
    rows = tl.arange(0, BLOCK)  # block-local columns of W
    rmask = rows < n_cols
    offs = (i1 + rows).to(tl.int64)[:, None] * n_out + cols[None, :]
    w = tl.load(wt_ptr + offs, mask=rmask[:, None] & cmask[None, :], other=0.0)  # [BLOCK, TILE]
    scale = tl.zeros([TILE], dtype=tl.float32) + 1.0
    zero = tl.zeros([TILE], dtype=tl.float32)
    cw = tl.zeros([BLOCK], dtype=tl.float32)
    if WEIGHTED:
        cw = tl.load(cw_ptr + i1 + rows, mask=rmask, other=0.0)  # [BLOCK]
    for i in range(n_cols):
        col = i1 + i
        line = col.to(tl.int64) * n_out + cols
        if STATIC:
            scale = tl.load(cscale_ptr + line, mask=cmask, other=1.0)
            zero = tl.load(czero_ptr + line, mask=cmask, other=0.0)
        else:
            if col % gs == 0:
                scale, zero = _group_params(w, rows, i, tl.minimum(i + gs, n_cols), shrink_ptr, inv_maxq,
                                            inv_maxq_m1, norm, cw, MAXQ, SYM, RECIP, MSE, N_SHRINK, EMULATE,
                                            WEIGHTED)
                g = (col // gs).to(tl.int64) * n_out + cols
                tl.store(gscale_ptr + g, scale, mask=cmask)
                tl.store(gzero_ptr + g, zero.to(tl.int32), mask=cmask)
        x = tl.sum(tl.where((rows == i)[:, None], w, 0.0), axis=0)  # [TILE] column i (adding zeros is exact)
        q = tl.minimum(tl.maximum(_rint(tl.math.div_rn(x, scale)) + zero, 0.0), MAXQ * 1.0)
        tl.store(codes_ptr + line, q.to(tl.int32), mask=cmask)
        dq = (q - zero) * scale
        u_ii = tl.load(u_ptr + col.to(tl.int64) * ld_u + col)
        e = tl.math.div_rn(x - dq, u_ii)
        tl.store(err_ptr + i * n_out + cols, e, mask=cmask)
        # rows <= i get a zero factor: fma(0, e, w) == w
        neg_u = -tl.load(u_ptr + col.to(tl.int64) * ld_u + i1 + rows, mask=(rows > i) & rmask, other=0.0)
        if EMULATE:
            w = (neg_u.to(tl.float64)[:, None] * e.to(tl.float64)[None, :] + w.to(tl.float64)).to(tl.float32)
        else:
            w = tl.fma(neg_u[:, None], e[None, :], w)


def block_solve_supported(block: int, device: torch.device) -> tuple[bool, str]:
    """Whether :func:`gptq_columns_triton` handles this solve, and if not, why (the torch loop does)."""
    if device.type != "cuda" and not interpreting():
        return False, "not a CUDA tensor and TRITON_INTERPRET is not set"
    if block > _MAX_BLOCK:
        return False, f"block of {block} columns exceeds the kernel's register tile ({_MAX_BLOCK})"
    return True, ""


def _row_tile(n_out: int, block: int) -> int:
    """Rows per program: enough programs to fill the GPU, few enough registers per thread."""
    if interpreting():  # each program costs Python time there: as few as possible
        return min(triton.next_power_of_2(n_out), 64)
    tile = 32 if block <= 128 else 16
    while tile > 8 and triton.cdiv(n_out, tile) < 264:  # about two programs per H200 SM
        tile //= 2
    return tile


def gptq_columns_triton(
    W: torch.Tensor, U: torch.Tensor, bits: int, sym: bool, gs: int, block: int,
    col_params: tuple[torch.Tensor, torch.Tensor] | None, mse: bool = False, mse_max_shrink: float = 0.2,
    mse_grid: int = 100, mse_norm: float = 2.4, errors: torch.Tensor | None = None,
    mse_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``gptq._columns`` with one launch per block: codes int32 ``[out, in]`` and, when ``col_params`` is
    None, the groups' scales float32 / zeros int32 ``[G, out]`` (else None, None).

    ``W [out, in]`` float32 (already permuted), ``U [in, in]`` its inverse-Hessian factor, ``block`` the
    columns per launch (a multiple of ``gs`` when groups are computed here). ``errors`` (optional, contiguous
    float32 ``[in, out]``) receives every column's scaled error. ``mse_weight``: the mse search's column
    weights float32 ``[in]`` in position order (None: unweighted)."""
    n_out, n_in = W.shape
    dev = W.device
    Wt = W.t().contiguous()  # [in, out], updated in place by the trailing GEMMs
    U = U.contiguous()
    codes_t = torch.empty(n_in, n_out, dtype=torch.int32, device=dev)
    if errors is None:
        err_rows = torch.empty(block, n_out, dtype=torch.float32, device=dev)
    else:
        assert errors.shape == (n_in, n_out) and errors.is_contiguous(), errors.shape
    static = col_params is not None
    n_groups = 0 if static else -(-n_in // gs)
    gscale = torch.empty(max(n_groups, 1), n_out, dtype=torch.float32, device=dev)
    gzero = torch.empty(max(n_groups, 1), n_out, dtype=torch.int32, device=dev)
    cscale, czero = (col_params[0].contiguous(), col_params[1].contiguous()) if static else (gscale, gscale)
    steps = int(mse_max_shrink * mse_grid) if mse else 0
    # the shrink factors as torch sees them: ``1 - k / grid`` in double, rounded to float32 by the multiply
    shrink = torch.tensor([1.0 - k / mse_grid for k in range(1, steps + 1)] or [1.0], dtype=torch.float32,
                          device=dev)
    weighted = mse and mse_weight is not None and not static
    cw = mse_weight.float().contiguous() if weighted else shrink  # a placeholder pointer when unweighted
    maxq = 2**bits - 1
    recip = dev.type == "cuda"  # CUDA's true division by a Python scalar multiplies by its fp32 reciprocal
    one = torch.ones((), dtype=torch.float32)
    inv_maxq, inv_maxq_m1 = float(one / maxq), float(one / (maxq - 1))
    bw = triton.next_power_of_2(block)
    tile = _row_tile(n_out, bw)
    grid = (triton.cdiv(n_out, tile),)
    # a warp per 1024 tile elements: small tiles reduce a column within one warp (no barrier), the latency
    # of every sequential step
    warps = max(1, min(4, bw * tile // 1024))
    extra = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": warps}
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        err = err_rows if errors is None else errors[i1:i2]
        _gptq_block_kernel[grid](
            Wt, U, codes_t, err, cscale, czero, gscale, gzero, shrink, cw,
            i1, i2 - i1, n_out, U.stride(0), gs, inv_maxq, inv_maxq_m1, float(mse_norm),
            BLOCK=bw, TILE=tile, MAXQ=maxq, SYM=sym, STATIC=static, MSE=mse, N_SHRINK=steps, RECIP=recip,
            EMULATE=interpreting(), WEIGHTED=weighted, **extra,
        )
        if i2 < n_in:
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), err[: i2 - i1], alpha=-1.0)
    codes = codes_t.t().contiguous()
    if static:
        return codes, None, None
    return codes, gscale, gzero
