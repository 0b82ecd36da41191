"""GPTQ's pure core: a streamed Hessian and the column-by-column solver (tensors in, a record out).

GPTQ (Frantar et al., 2022) quantizes the columns of ``W [out, in]`` one at a time and pushes each
column's rounding error onto the columns not yet quantized, weighted by the inverse of the layer's
input Hessian ``H = 2/n sum x x^T``. It minimizes the output error ``tr(dW H dW^T)`` greedily.

* Hessian: float32, streamed batch by batch as a running mean (``n`` may grow), no activations kept.
* Damping: ``damp * mean(diag H)`` on the diagonal; a Cholesky failure multiplies it by 10 (a few
  times) and warns. Dead columns (zero diagonal: an input that is always zero) get ``H_ii = 1`` and
  a zero weight, as their value cannot matter.
* The inverse goes through one Cholesky factorization and a triangular inverse, and the solver works on
  the upper Cholesky factor ``U`` of ``H^-1``: within a block of columns the error is pushed by rank-1
  updates, between blocks by one matrix product (the "lazy batch" update). On the host both run in
  float32 in one matrix, in place (the reference GPTQ code factors in float32 too; host memory is what
  bounds a streamed run: an 8192-wide down_proj's factor is 268 MB in float32, 537 MB in float64); a
  float32 factorization that fails is retried in float64 at the same damping before the damping is
  raised. Accelerators keep float64 (their measured device peaks, and the quality baselines, were made
  with it). The reductions (mean diagonal, errors, mse column weights) are float64 everywhere: vectors.
* Groups are aligned with blocks, so each group's scale is computed from fully updated weights.
* ``desc_act``: columns in order of decreasing ``diag H``; the permutation ends up in ``g_idx``
  (``g_idx[perm[j]] = j // group_size``). ``static_groups``: every group's scale is computed from the
  original weights before the permutation, so ``g_idx`` stays contiguous (no reordering in kernels).
* ``mse``: each group's range is shrunk over a small grid, keeping the scale with the least
  ``sum |w - q(w)|^norm`` (the observer the best peers use: shrink up to 20 %, grid 100, norm 2.4).
  ``mse_weight`` weights each column's term by how much its error costs the layer's output:
  ``"hessian"`` by ``H_jj`` (with norm 2: the diagonal of GPTQ's objective ``tr(dW H dW^T)``),
  ``"residual"`` by ``1 / U_jj^2``, the loss GPTQ's column step itself charges for that column's rounding
  error (the part of input ``j`` that the columns after it cannot absorb); ``"none"``: unweighted, as
  the peers. The CLI's default is ``hessian`` (SmolLM2 asym g64: 22.63 -> 22.17, README).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from quantkit.config import QuantkitError, QuantScheme
from quantkit.methods.gptq_factor import (  # noqa: F401 (re-exported: the factor's home before the split)
    _cholesky_in_place,
    _inverse_factor,
    _inverse_factor_in_place,
    all_finite,
    anti_transpose_,
    damped_inverse_factor,
    invert_lower_,
)
from quantkit.methods.gptq_mse import group_qparams, static_group_qparams  # the range search (min/max or mse)
from quantkit.primitives import (
    default_g_idx,
    dequantize,
    fake_quantize_contiguous,
    num_groups,
)

log = logging.getLogger(__name__)

MSE_WEIGHTS = ("none", "hessian", "residual")


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ's options. ``damp`` is a fraction of the mean Hessian diagonal."""

    damp: float = 0.01
    block_size: int = 128
    desc_act: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    mse: bool = False
    mse_max_shrink: float = 0.2
    mse_grid: int = 100
    # None: 2 with a column weight (the weighted squared error is the diagonal of GPTQ's quadratic
    # objective), 2.4 without (the peers' observer)
    mse_norm: float | None = None
    mse_weight: str = "none"  # "none", "hessian" (H_jj) or "residual" (1 / U_jj^2): see the module doc
    max_damp_escalations: int = 4
    # Quantize each layer in one forward of the whole calibration set, the groups quantized inside
    # it as the forward reaches them (true-sequential at the cost of one pass), when the set holds at
    # most this many tokens; else one early-stopped pass per group over the calibration batches, with
    # Hessians accumulated batch by batch (memory independent of the number of tokens). None: 2^19
    # on the CPU (host memory; saves ~1.1 forwards a layer); on a CUDA device, whenever the forward's
    # estimated peak fits the memory free there (``gptq_method.single_pass_fits``: the whole set's MLP
    # intermediates take ~4 x 7.5 GB for an 8B model at 128 x 2048 tokens), group passes otherwise.
    single_pass_max_tokens: int | None = None
    # Under several ranks a stack of linears is cut by output rows between ranks down to this many
    # rows (GPTQ solves rows independently); no effect in one process.
    split_min_rows: int = 256
    # The column solve: "auto" (the Triton block kernel on CUDA where it supports the options, else the
    # torch loop), "torch" (always the loop), "triton" (the kernel, also under TRITON_INTERPRET=1 on the CPU).
    solver: str = "auto"

    def __post_init__(self) -> None:
        if not 0.0 <= self.damp < 1.0 or not math.isfinite(self.damp):
            raise QuantkitError(f"--damp must be in [0, 1) (a fraction of the mean Hessian diagonal), got {self.damp}")
        if self.block_size < 1:
            raise QuantkitError(f"--block-size must be positive, got {self.block_size}")
        if not 0.0 < self.mse_max_shrink < 1.0:
            raise QuantkitError(f"mse_max_shrink must be in (0, 1), got {self.mse_max_shrink}")
        if self.mse_grid < 1 or self.search_norm <= 0:
            raise QuantkitError(f"mse_grid must be >= 1 and mse_norm > 0, got {self.mse_grid}, {self.mse_norm}")
        if self.max_damp_escalations < 0 or (self.single_pass_max_tokens or 0) < 0:
            raise QuantkitError("max_damp_escalations and single_pass_max_tokens must be >= 0")
        if self.mse_weight not in MSE_WEIGHTS:
            raise QuantkitError(f"mse_weight must be one of {', '.join(MSE_WEIGHTS)}, got {self.mse_weight!r}")
        if self.solver not in ("auto", "torch", "triton"):
            raise QuantkitError(f"solver must be auto, torch or triton, got {self.solver!r}")
        if self.split_min_rows < 1:
            raise QuantkitError(f"split_min_rows must be >= 1, got {self.split_min_rows}")

    @property
    def search_norm(self) -> float:
        """The exponent of the mse search's error: ``mse_norm``, or its default for ``mse_weight``."""
        if self.mse_norm is not None:
            return self.mse_norm
        return 2.4 if self.mse_weight == "none" else 2.0

    def single_pass_limit(self, device: torch.device) -> int | None:
        """``single_pass_max_tokens``, its default resolved for the work device; None on CUDA by default: the
        device's free memory decides (``gptq_method.single_pass_fits``)."""
        if self.single_pass_max_tokens is not None:
            return self.single_pass_max_tokens
        if device.type == "cpu":
            return 1 << 19
        return None if device.type == "cuda" else 0


@dataclass(frozen=True)
class GPTQResult:
    """Codes int32 ``[out, in]`` (original column order), ``scales`` float32 / ``zeros`` int32 ``[G, out]``,
    ``g_idx`` int32 ``[in]``, the damping fraction actually used, and per output row the H-weighted
    squared errors ``dW_r H dW_r^T`` of GPTQ and of plain RTN and the row's energy ``W_r H W_r^T``
    (float32 ``[out]`` each), so that the errors of any slice of rows (one of several stacked linears)
    come without another matrix product."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    damp: float
    row_err_gptq: torch.Tensor
    row_err_rtn: torch.Tensor
    row_energy: torch.Tensor

    @property
    def err_gptq(self) -> float:
        """Relative output error ``tr(dW H dW^T) / tr(W H W^T)`` of the GPTQ weights (after)."""
        return relative_error(self.row_err_gptq, self.row_energy)

    @property
    def err_rtn(self) -> float:
        """The same for plain round-to-nearest (before)."""
        return relative_error(self.row_err_rtn, self.row_energy)

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[out, in]``: exactly what a GPTQ reader reconstructs."""
        return dequantize(self.codes, self.scales, self.zeros, self.g_idx)


def relative_error(row_err: torch.Tensor, row_energy: torch.Tensor) -> float:
    """Sum of per-row H-weighted errors over the rows' energy (``[rows]`` each)."""
    return float(relative_error_tensor(row_err, row_energy))


def relative_error_tensor(row_err: torch.Tensor, row_energy: torch.Tensor) -> torch.Tensor:
    """``relative_error`` as a float64 scalar where the rows are: many are stacked and read in one host round trip."""
    return row_err.double().sum() / row_energy.double().sum().clamp_min(1e-30)


class HessianAccumulator:
    """``H = 2/n sum_t x_t x_t^T`` over every token seen so far, float32, kept as a running mean."""

    _mm_out_fp32 = True  # whether torch.mm(..., out_dtype=float32) works here (probed on first use)

    def __init__(self, in_features: int, device: torch.device | str = "cpu", chunk_rows: int = 8192) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)  # [in, in]
        self.n = 0
        self.chunk_rows = chunk_rows

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Add the tokens of ``x [..., in]`` (any float dtype); converted to float32 chunk by chunk."""
        x = x.reshape(-1, x.shape[-1])  # [m, in]
        m = x.shape[0]
        if m == 0:
            return
        total = self.n + m
        self.H.mul_(self.n / total)
        # 16-bit activations on CUDA: products of 16-bit numbers are exact in float32, so a 16-bit
        # matmul that accumulates and returns float32 is as accurate as casting first, and runs on
        # the tensor cores (about 10x the float32 rate). Elsewhere: cast chunk by chunk.
        low_precision = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        for start in range(0, m, self.chunk_rows):
            xc = x[start : start + self.chunk_rows].to(self.H.device)  # [c, in]
            if low_precision and self._mm_out_fp32:
                try:
                    self.H.add_(torch.mm(xc.t(), xc, out_dtype=torch.float32), alpha=2.0 / total)
                    continue
                except (RuntimeError, TypeError):
                    HessianAccumulator._mm_out_fp32 = False
            xc = xc.float()
            self.H.addmm_(xc.t(), xc, alpha=2.0 / total)
        self.n = total


def output_error(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> float:
    """Relative output error ``tr(dW H dW^T) / tr(W H W^T)`` of ``w_hat`` for ``w [out, in]``."""
    w = w.float()
    dw = w_hat.float() - w
    num = ((dw @ H) * dw).sum()
    den = ((w @ H) * w).sum()
    return float(num / den.clamp_min(1e-30))


def mse_column_weights(config: GPTQConfig, H: torch.Tensor, U: torch.Tensor,
                       perm: torch.Tensor | None) -> torch.Tensor | None:
    """The mse search's column weights float32 ``[in]`` in solve (position) order, scaled to mean 1, or
    None when unweighted. ``H`` unpermuted, ``U`` the solve's factor (permuted by ``perm`` when given)."""
    if not config.mse or config.mse_weight == "none":
        return None
    if config.mse_weight == "hessian":
        weight = H.diagonal().double()
        if perm is not None:
            weight = weight[perm]
    else:  # "residual": what GPTQ's step charges for column j's error e: e^2 / U_jj^2
        weight = torch.diagonal(U).double().pow(-2)
    return (weight / weight.mean().clamp_min(1e-300)).float()


def _columns(
    W: torch.Tensor, U: torch.Tensor, scheme: QuantScheme, gs: int, config: GPTQConfig,
    col_params: tuple[torch.Tensor, torch.Tensor] | None, errors: torch.Tensor | None = None,
    mse_weight: torch.Tensor | None = None, in_place: bool = False,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The GPTQ column loop on ``W [out, in]`` (already permuted) and ``U [in, in]``.

    ``gs``: the group size (the input width for one group).
    ``col_params``: fixed per-column ``(scale, zero as float)`` ``[in, out]`` (static groups or one group),
    or None to compute a group's parameters when the loop reaches its first column.
    ``errors``: if given (float32 ``[in, out]``), receives every column's scaled error (for tests).
    ``mse_weight``: the mse search's column weights float32 ``[in]`` in position order (None: unweighted).
    Returns codes int32 ``[out, in]`` and the per-position group parameters computed on the way.
    The loop works on ``W^T [in, out]`` so that a column and the rank-1 updates are contiguous.
    ``in_place``: ``W`` is the transpose of a contiguous float32 matrix the caller gives up; the loop works
    in it (no copy), and the codes come back in it (whole numbers in float32, a view): the caller converts
    them once it has freed what it no longer needs.
    """
    out_features, in_features = W.shape
    block = config.block_size
    if col_params is None and block % gs:
        block = gs * max(1, block // gs)  # a group never straddles two blocks
    Wt = W.t().contiguous()  # [in, out]
    if Wt.data_ptr() == W.data_ptr() and not (in_place and Wt.dtype == torch.float32):
        Wt = Wt.clone()  # the caller's tensor stays as it is
    # Codes are built as floats (whole numbers) and converted once at the end: fewer small kernels
    # per column, which is what the loop's time is made of on a GPU. They go into the rows of ``Wt``
    # already done (a block is read from its own copy ``W1``, and later updates touch later rows only).
    codes_t = Wt  # [in, out]
    dq = torch.empty(out_features, dtype=torch.float32, device=W.device)  # [out] scratch
    maxq = 2**scheme.bits - 1
    groups: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i1 in range(0, in_features, block):
        i2 = min(i1 + block, in_features)
        W1 = Wt[i1:i2].clone()  # [B, out]
        E1 = torch.empty_like(W1)  # [B, out] scaled errors
        U1 = U[i1:i2, i1:i2]  # [B, B]
        for i in range(i2 - i1):
            col = i1 + i
            if col_params is not None:
                scale, zero_f = col_params[0][col], col_params[1][col]
            elif col % gs == 0:
                cw = None if mse_weight is None else mse_weight[col : col + gs]
                scale, zero = group_qparams(W1[i : i + gs].t(), scheme, config, cw)
                groups.append((scale, zero))
                zero_f = zero.float()
            w = W1[i]  # [out]
            # primitives.quantize's arithmetic for one column, in place: q = clamp(round(w / s) + z), dq = (q - z) s
            q = torch.div(w, scale, out=codes_t[col]).round_().add_(zero_f).clamp_(0, maxq)
            torch.sub(q, zero_f, out=dq).mul_(scale)
            err = torch.sub(w, dq, out=E1[i]).div_(U1[i, i])
            W1[i + 1 :].addr_(U1[i, i + 1 :], err, alpha=-1.0)
        if errors is not None:
            errors[i1:i2] = E1
        if i2 < in_features:
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1.0)
    codes = codes_t.t()  # [out, in]
    return (codes if in_place and codes_t is Wt else codes.to(torch.int32)), groups


def solve_columns(
    W: torch.Tensor, U: torch.Tensor, scheme: QuantScheme, gs: int, config: GPTQConfig,
    col_params: tuple[torch.Tensor, torch.Tensor] | None, mse_weight: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The column solve (arguments of :func:`_columns`): codes int32 ``[out, in]`` and, without
    ``col_params``, the groups' scales / zeros ``[G, out]`` in position order (else None, None).

    The one dispatch point between the Triton block kernel (``config.solver``, see GPTQConfig) and the
    torch loop; an option the kernel cannot take falls back to the loop with a debug log saying why.
    """
    use_kernel = config.solver == "triton" or (config.solver == "auto" and W.is_cuda)
    if use_kernel:
        block = config.block_size
        if col_params is None and block % gs:
            block = gs * max(1, block // gs)  # a group never straddles two blocks (as in _columns)
        ok, reason = _kernel_supported(block, W.device)
        if ok:
            from quantkit.kernels.gptq_solve import gptq_columns_triton

            if col_params is not None:
                col_params = tuple(_rows_of(t) for t in col_params)
            return gptq_columns_triton(W, U, scheme.bits, scheme.sym, gs, block, col_params, config.mse,
                                       config.mse_max_shrink, config.mse_grid, config.search_norm,
                                       mse_weight=mse_weight)
        log.debug("GPTQ solve on the torch loop: %s", reason)
    codes, groups = _columns(W, U, scheme, gs, config, col_params, mse_weight=mse_weight, in_place=in_place)
    if col_params is not None:
        return codes, None, None
    return codes, torch.stack([s for s, _ in groups]), torch.stack([z for _, z in groups])


@dataclass(frozen=True)
class GroupRows:
    """Per-position parameters ``table[index[j]]`` (``[in, out]`` when made whole) without making them whole:
    ``rows[j]`` is position ``j``'s ``[out]`` row. The static-groups solve reads one row per column, so the
    ``[in, out]`` tables (two of the weight's size) are never built on the host."""

    table: torch.Tensor  # [G, out]
    index: torch.Tensor  # [in], the group of each position

    def __getitem__(self, j):
        return self.table[self.index[j]]

    def whole(self) -> torch.Tensor:
        return self.table[self.index]


def _rows_of(t) -> torch.Tensor:
    return t.whole() if isinstance(t, GroupRows) else t


def _kernel_supported(block: int, device: torch.device) -> tuple[bool, str]:
    try:
        from quantkit.kernels.gptq_solve import block_solve_supported
    except ImportError as exc:  # no Triton on this platform
        return False, f"Triton is not available ({exc})"
    return block_solve_supported(block, device)


def gptq_quantize(
    w: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, config: GPTQConfig = GPTQConfig(), name: str = "",
    spill_hessian: bool = False,
) -> GPTQResult:
    """Quantize ``w [out, in]`` against the input Hessian ``H [in, in]``; ``name`` labels errors.

    ``spill_hessian`` (host only; a float32 ``H`` of 64 MiB or more): ``H`` waits in a temporary file while
    the factor is built and the columns solved (``quantkit.methods.hessian_spill``), so the two ``[in, in]``
    matrices are never resident together; ``H`` holds its values again when this returns."""
    out_features, in_features = w.shape
    if H.shape != (in_features, in_features):
        raise ValueError(f"{name}: Hessian {tuple(H.shape)} does not match weight {tuple(w.shape)}")
    for what, t in (("weight", w), ("Hessian", H)):
        if not all_finite(t):
            raise FloatingPointError(f"GPTQ {name or 'layer'}: NaN or Inf in the {what}")
    H32 = H.detach().float()
    # The working copy, transposed ([in, out], as the column loop reads it) and converted in one copy;
    # the original ``w`` is read again for the errors at the end.
    Wt = torch.empty(in_features, out_features, dtype=torch.float32, device=w.device)
    Wt.copy_(w.detach().t())
    W = Wt.t()  # [out, in] view
    dead = torch.diagonal(H32) == 0
    any_dead = bool(dead.any())
    if any_dead:  # in place and undone below: no copy of the Hessian (0.8 GB for an 8B down_proj)
        H32[dead, dead] = 1.0
        W[:, dead] = 0.0
    spill = None
    if spill_hessian and H32.device.type == "cpu" and H32.is_contiguous() and H32.numel() * 4 >= 64 * 2**20:
        from quantkit.methods.hessian_spill import SpilledHessian

        spill = SpilledHessian(H32)  # H32's memory is given back until ``restore``
    try:
        gs = scheme.group_size if scheme.group_size != -1 else in_features
        G = num_groups(in_features, scheme.group_size)
        static = config.static_groups or scheme.group_size == -1
        g_idx = default_g_idx(in_features, scheme.group_size, device=W.device)  # [in]
        fixed = None
        Hs = H32 if spill is None else spill  # what the factor reads
        perm = torch.argsort(Hs.diagonal(), descending=True) if config.desc_act else None
        U, damp_used = damped_inverse_factor(Hs, config.damp, config.max_damp_escalations, name, perm)
        mse_w = mse_column_weights(config, Hs, U, perm)  # [in] in position order, or None
    except BaseException:
        if spill is not None:
            spill.restore()
            if any_dead:
                H32[dead, dead] = 0.0
        raise
    finally:
        if any_dead and spill is None:
            H32[dead, dead] = 0.0
    if static:
        static_w = mse_w
        if mse_w is not None and perm is not None:  # back to the original column order
            static_w = torch.empty_like(mse_w)
            static_w[perm] = mse_w
        scales_g, zeros_g = _static_params(W, scheme, config, gs, static_w)  # [G, out]
    if perm is not None:
        Wt = Wt[perm]  # rows of W^T = columns of W; the Hessian was permuted inside ``damped_inverse_factor``
    W = Wt.t()
    del Wt  # the solve works in it (in_place) and leaves the codes there
    if static:
        col_group = g_idx.long() if perm is None else g_idx.long()[perm]  # group of each position
        fixed = (GroupRows(scales_g, col_group), GroupRows(zeros_g.float(), col_group))  # [in, out] each

    codes_p, scales, zeros = solve_columns(W, U, scheme, gs, config, fixed, mse_w, in_place=True)
    del W, U, fixed
    # codes_p: whole numbers in the loop's float32 buffer (in_place), converted now that the factor is freed
    if static:
        scales, zeros = scales_g, zeros_g
    if perm is None:
        codes = codes_p.to(torch.int32)
    else:  # back to the original column order, through one byte a code (bits <= 8): one int32 copy alive
        small = codes_p.to(torch.uint8 if scheme.bits <= 8 else torch.int32)
        del codes_p
        codes = torch.empty(small.shape, dtype=torch.int32, device=small.device)
        step = max(1, (1 << 20) // max(1, small.shape[1]))
        for r in range(0, small.shape[0], step):  # index_put wants one dtype: widen a block of rows at a time
            codes[r : r + step, perm] = small[r : r + step].to(torch.int32)
        del small
        if not static:
            g_idx = torch.empty_like(g_idx)
            g_idx[perm] = torch.arange(in_features, device=codes.device, dtype=torch.int32) // gs
    assert scales.shape == (G, out_features), (scales.shape, G)
    if spill is not None:
        spill.restore()  # the factor is freed: H's values come back for the errors
        if any_dead:
            H32[dead, dead] = 0.0
    rows = _row_errors_packed(w.detach(), codes, scales, zeros, g_idx, H32, scheme, name)  # [3, out]
    return GPTQResult(codes, scales, zeros, g_idx, damp_used, rows[0], rows[1], rows[2])


def _row_errors_packed(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       g_idx: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, name: str = "",
                       chunk_elements: int | None = None) -> torch.Tensor:
    """``_row_errors`` of the GPTQ weights given as codes, dequantized a block of rows at a time (about
    ``chunk_elements`` values; default 4 MB of float32 on the host, where memory bounds a streamed run,
    256 MB on an accelerator, where larger products run faster), so no whole float32 copy of the weight
    is made. Raises if a dequantized weight is not finite (the blocks' flags read once, after the last)."""
    if chunk_elements is None:
        chunk_elements = 1 << 20 if w.device.type == "cpu" else 1 << 26
    # The products are display-only (no decision reads them): on an accelerator the three [out, in] x [in, in]
    # float32 products a linear cost more than the Hessian (~0.18 s a layer on an 8B shape at the float32 rate),
    # so H and the differences go through bfloat16 there (float32 accumulation; the ratios keep ~3 digits).
    # The host keeps float32, where bfloat16 products are slower, not faster.
    Hm = H if w.device.type == "cpu" else H.to(torch.bfloat16)
    out = torch.empty(3, w.shape[0], dtype=torch.float32, device=w.device)
    finite = torch.ones((), dtype=torch.bool, device=w.device)
    step = max(1, chunk_elements // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows = slice(start, start + step)
        w_gptq = dequantize(codes[rows], scales[:, rows], zeros[:, rows], g_idx)
        finite &= torch.isfinite(w_gptq).all()
        out[:, rows] = _row_errors(w[rows].float(), w_gptq, Hm, scheme, chunk_elements)
    if not finite:
        raise FloatingPointError(f"GPTQ {name or 'layer'}: NaN or Inf in the quantized weight")
    return out


def _row_errors(w: torch.Tensor, w_gptq: torch.Tensor, H: torch.Tensor, scheme: QuantScheme,
                chunk_elements: int = 1 << 26) -> torch.Tensor:
    """Per row of ``w [out, in]``: ``dW H dW^T`` of GPTQ and of plain RTN, and ``W H W^T``: ``[3, out]``.

    The products run in ``H``'s dtype (float32, or bfloat16 for speed), the sums in float32. Rows go through
    in chunks of about ``chunk_elements`` values (256 MB in float32), so the bookkeeping never holds more
    than a few such blocks (a stacked 8B gate/up weight is 470 MB)."""
    w_rtn = fake_quantize_contiguous(w, scheme.bits, scheme.group_size, scheme.sym)
    out = torch.empty(3, w.shape[0], dtype=torch.float32, device=w.device)
    step = max(1, chunk_elements // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows = slice(start, start + step)
        for k, d in enumerate((w_gptq[rows] - w[rows], w_rtn[rows] - w[rows], w[rows])):
            out[k, rows] = ((d.to(H.dtype) @ H).float() * d).sum(dim=1)
    return out


def _static_params(
    W: torch.Tensor, scheme: QuantScheme, config: GPTQConfig, gs: int, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group parameters ``[G, out]`` of the original (unpermuted) weights (``weight [in]``: the mse
    search's column weights in the original order, or None)."""
    return static_group_qparams(W, scheme, config, gs, weight)  # every group at once (gptq_mse's doc)


def _static_params_loop(
    W: torch.Tensor, scheme: QuantScheme, config: GPTQConfig, gs: int, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_static_params` one group at a time: the reference the batched search is tested against."""
    pairs = [group_qparams(W[:, c : c + gs], scheme, config, None if weight is None else weight[c : c + gs])
             for c in range(0, W.shape[1], gs)]
    return torch.stack([s for s, _ in pairs]), torch.stack([z for _, z in pairs])

