"""AWQ's candidate weights ``Q(W s) / s`` in one Triton pass (``awq.fake_quantize_scaled``).

The scale search fake-quantizes every linear of a group once per grid point: about ten full-size float32 passes
in torch. Here one program holds a tile of rows x one group, reads the weights once and writes the candidate once,
in the weights' dtype, following torch op for op (``gptq_solve._qparams``, see gptq_solve's docstring): the
candidates are equal bit for bit (tests/kernels/test_awq_fake_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.device_info import interpreting
from quantkit.kernels.gptq_solve import _qparams, _rint

_MAX_GROUP = 256  # columns of one group held in registers (x the row tile)


@triton.jit
def _fake_quant_scaled_kernel(
    w_ptr, s_ptr, out_ptr, n_rows, n_cols, stride_w, stride_o, inv_maxq, inv_maxq_m1,
    GS: tl.constexpr, GS_P2: tl.constexpr, ROWS: tl.constexpr,
    MAXQ: tl.constexpr, SYM: tl.constexpr, RECIP: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * GS + tl.arange(0, GS_P2)
    cmask = (tl.arange(0, GS_P2) < GS) & (cols < n_cols)
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + cols, mask=cmask, other=1.0)
    ws = w.to(tl.float32) * s[None, :]
    ws = tl.where(mask, ws, 0.0)  # padding is zero, as the torch path pads a partial group
    scale, zero = _qparams(tl.min(ws, axis=1), tl.max(ws, axis=1), inv_maxq, inv_maxq_m1, MAXQ, SYM, RECIP)
    q = tl.minimum(tl.maximum(_rint(tl.math.div_rn(ws, scale[:, None])) + zero[:, None], 0.0), MAXQ * 1.0)
    dq = tl.math.div_rn((q - zero[:, None]) * scale[:, None], s[None, :])
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], dq.to(out_ptr.dtype.element_ty),
             mask=mask)


def fused_supported(w: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`fake_quantize_scaled_triton` takes ``w``: a CUDA tensor (or the interpreter), groups
    of at most ``_MAX_GROUP`` columns, a float dtype Triton stores."""
    if w.device.type != "cuda" and not interpreting():
        return False
    gs = w.shape[1] if group_size == -1 else group_size
    return w.ndim == 2 and 0 < gs <= _MAX_GROUP and w.dtype in (torch.float32, torch.float16, torch.bfloat16)


def fake_quantize_scaled_triton(w: torch.Tensor, s: torch.Tensor, bits: int, group_size: int,
                                sym: bool) -> torch.Tensor:
    """``(fake_quantize_contiguous(w.float() * s, ...) / s).to(w.dtype)`` for ``w [out, in]``, ``s [in]``."""
    n_rows, n_cols = w.shape
    gs = n_cols if group_size == -1 else group_size
    w = w if w.stride(1) == 1 else w.contiguous()
    s = s.to(device=w.device, dtype=torch.float32).contiguous()
    # the interpreter casts float32 to bfloat16 by truncation: store float32 there and let torch round
    out_dtype = torch.float32 if interpreting() else w.dtype
    out = torch.empty((n_rows, n_cols), dtype=out_dtype, device=w.device)
    maxq = 2**bits - 1
    one = torch.ones((), dtype=torch.float32)
    inv_maxq, inv_maxq_m1 = float(one / maxq), float(one / (maxq - 1))
    gs_p2 = triton.next_power_of_2(gs)
    rows = min(64, triton.next_power_of_2(n_rows)) if interpreting() else max(1, 4096 // gs_p2)
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(n_cols, gs))
    extra = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": 4}
    _fake_quant_scaled_kernel[grid](
        w, s, out, n_rows, n_cols, w.stride(0), out.stride(0), inv_maxq, inv_maxq_m1,
        GS=gs, GS_P2=gs_p2, ROWS=rows, MAXQ=maxq, SYM=sym, RECIP=w.device.type == "cuda", **extra,
    )
    return out.to(w.dtype)
