"""A 16-bit GEMV for decode-sized batches: ``y = x @ W^T (+ bias)`` for ``x [M, K]`` with M = 1..4 and ``W [N, K]``
row-major, as the runtime stores its bf16 / fp16 linears.

Why not cuBLAS: at batch 1 each cuBLAS launch leaves the GPU idle in front of it, as cuBLAS does not use
programmatic dependent launch (PDL; bench/archive/NOTES_decode.md). This kernel does: on Hopper the next kernel launches
early, and the first weight tile is requested *before* waiting for the previous kernel (only ``x`` depends on it).

Design (memory bound): program p owns rows ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` over all of K (no split, no
workspace, one launch); each step loads a ``[BLOCK_N, BLOCK_K]`` tile in 16-byte vectors and multiply-adds it into
float32 accumulators of that shape, one per activation row, reduced over K at the end. Separate 2-D accumulators
(not one 3-D) share the weight tile's layout, so nothing crosses threads before the final sum. Thousands of small
programs keep several resident per SM and the per-SM work even.

FP8 (``SCALED``): e4m3 weights with per-channel scales, and e4m3 activation codes with per-row scales
(``gemv(..., scales=)``, after ``fp8_quant.quantize_per_token``), or 16-bit activations the kernel quantizes itself
(``QUANT_X``: the one-launch FP8 decode GEMV, whose launcher and configs are ``gemv_fp8.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import gpu_card, interpreting, pdl_launch, programmatic_launch
from quantkit.kernels.fp8_quant import e4m3_codes, e4m3_scale

MAX_M = 4  # activation rows one launch takes (the kernel keeps one accumulator per row)


def require_powers_of_two(config, names: tuple[str, ...]) -> None:
    """Raise ValueError naming the first of ``config``'s fields ``names`` that is not a power of two (the kernels'
    tile sizes and warp counts)."""
    for name in names:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{type(config).__name__}.{name} must be a power of two, got {value}")


@dataclass(frozen=True)
class DenseGemvConfig:
    """Launch config of the 16-bit GEMV (the W4A16 GEMV's is ``w4a16_configs.GemvConfig``). BLOCK_K = 256 * NUM_WARPS
    suits 16-bit weights: a warp's 32 threads x 8 weights (16 bytes) span a tile row and the warps lie along K, so
    x's [BLOCK_K] slice is already in the tile's column layout (no shared-memory exchange). ``vec``: weights a
    thread loads at once (0: 16 bytes' worth); the FP8 GEMV that quantizes its own 16-bit activations takes 8
    (``gemv_fp8.VEC``), and the two-launch FP8 path with ``vec=8`` has its layout, hence its float32 sums.
    ``prefetch``: each step requests the next weight tile before multiplying the one it holds (the kernel's
    PREFETCH; the same sums in the same order, more registers): a tuned FP8 entry may take it, as a 1-byte tile puts
    half a 16-bit tile's bytes in flight."""

    block_n: int
    block_k: int
    num_warps: int
    vec: int = 0
    prefetch: bool = False

    def __post_init__(self):
        require_powers_of_two(self, ("block_n", "block_k", "num_warps"))
        if self.vec < 0 or self.vec & (self.vec - 1):
            raise ValueError(f"DenseGemvConfig.vec must be 0 or a power of two, got {self.vec}")


# The fastest config at M = 1 by shape (N, K), Llama-3-8B's linears on one H200 (bench/archive/studies/ab_bf16_gemv.py,
# timings in bench/archive/NOTES_decode.md).
TUNED_M1: dict[tuple[int, int], DenseGemvConfig] = {
    (6144, 4096): DenseGemvConfig(4, 1024, 4),
    (4096, 4096): DenseGemvConfig(8, 1024, 4),
    (28672, 4096): DenseGemvConfig(4, 1024, 4),
    (4096, 14336): DenseGemvConfig(2, 1024, 4),
    (128256, 4096): DenseGemvConfig(2, 1024, 4),
}


def _gemv_config(m: int, n: int, k: int) -> DenseGemvConfig:
    """The tuned entry at M = 1, else a default by m, sized for registers (m accumulators of BLOCK_N * BLOCK_K /
    (32 * NUM_WARPS) floats a thread). Small K shrinks BLOCK_K."""
    cfg = TUNED_M1.get((n, k)) if m == 1 else None
    if cfg is None:
        # M = 1: the best single config over the five 8B linears
        cfg = DenseGemvConfig(2, 2048, 8) if m == 2 else DenseGemvConfig(2, 1024, 4)
    return within_k(cfg, k)


def within_k(cfg: DenseGemvConfig, k: int) -> DenseGemvConfig:
    """``cfg`` with BLOCK_K no wider than K's next power of two (at least 16), every other field kept: the tables'
    entries are sized for the 8B shapes, and a small K takes a narrower tile."""
    block_k = min(cfg.block_k, max(triton.next_power_of_2(k), 16))
    return cfg if block_k == cfg.block_k else dataclasses.replace(cfg, block_k=block_k)


# The FP8 decode GEMV on e4m3 codes (the runtime's default at one row: the norm or activation kernel in front writes
# the codes) by (card, N, K) at M = 1, measured on that card by `python bench/tune_fp8_gemv.py --path codes`; a
# card or shape not listed takes bf16's config with BLOCK_K doubled (:func:`_fp8_codes_config`). An entry goes in
# only where the whole 8B decode step with the tuner's picks measured faster (`bash bench/gpu_check.sh fp8-codes`).
# H100: bench/results/fp8_codes_tune_h100_1095ee1.json (each pick 99-101 % of a device copy of its bytes); the
# step at batch 1 286.2 / 286.0 tok/s against 279.6 / 279.9 without them (two alternating runs, 2026-12-07,
# bench/results/bench_llama3-8b_fp8_h100_{tuned,table}{1,2}_1095ee1.json).
# H200: bench/results/fp8_codes_tune_h200_d877229.json (97-105 %); the step's graph 2.719 / 2.723 ms against
# 2.927 / 2.927 without them (bench/results/bench_llama3-8b_fp8_h200_{tuned,table}{1,2}_d877229.json).
_H100 = "NVIDIA H100 80GB HBM3"
_H200 = "NVIDIA H200"
TUNED_FP8_CODES: dict[tuple[str, int, int], DenseGemvConfig] = {
    (_H100, 6144, 4096): DenseGemvConfig(4, 512, 4),  # 10.9 us (table config 12.2)
    (_H100, 4096, 4096): DenseGemvConfig(8, 1024, 8),  # 8.1 us (9.9)
    (_H100, 28672, 4096): DenseGemvConfig(2, 2048, 4),  # 42.1 us (43.8)
    (_H100, 4096, 14336): DenseGemvConfig(8, 1024, 8),  # 22.2 us (22.3)
    (_H200, 6144, 4096): DenseGemvConfig(4, 512, 4),  # 8.8 us (10.4)
    (_H200, 4096, 4096): DenseGemvConfig(4, 1024, 4),  # 6.6 us (8.2)
    (_H200, 28672, 4096): DenseGemvConfig(8, 512, 4),  # 32.1 us (37.6)
    (_H200, 4096, 14336): DenseGemvConfig(8, 1024, 8),  # 16.5 us (17.3)
}


def _fp8_codes_config(m: int, n: int, k: int, card: str | None = None) -> DenseGemvConfig:
    """The config of the FP8 GEMV on codes (``gemv(..., scales=)``): the entry measured on ``card`` at M = 1, else
    the 16-bit one with BLOCK_K doubled, as 16-byte vectors of 1-byte weights hold twice the columns. BLOCK_K is
    shrunk to a small K."""
    cfg = TUNED_FP8_CODES.get((card, n, k)) if m == 1 and card else None
    if cfg is None:
        cfg = _gemv_config(m, n, k)
        cfg = dataclasses.replace(cfg, block_k=2 * cfg.block_k)
    return within_k(cfg, k)


@triton.jit
def _row_tile_dot(acc, w, x_ptr, k0, ks, K, EVEN_K: tl.constexpr, xs, QUANT_X: tl.constexpr):
    """``acc + w * x[k0 + ks]`` (float32) for one activation row at ``x_ptr``. QUANT_X: ``x`` is 16-bit and is
    rounded to e4m3 codes with the row's scale ``xs`` first, exactly as ``fp8_quant.quantize_per_token`` does."""
    if EVEN_K:
        x = tl.load(x_ptr + k0 + ks)
    else:
        x = tl.load(x_ptr + k0 + ks, mask=k0 + ks < K, other=0.0)
    x = x.to(tl.float32)
    if QUANT_X:
        x = e4m3_codes(x, xs).to(tl.float32)
    return acc + w * x[None, :]


@triton.jit
def _weight_tile(w_rows, k0, ks, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at column ``k0``, as stored (zeros past K)."""
    if EVEN_K:
        return tl.load(w_rows + k0 + ks[None, :])
    return tl.load(w_rows + k0 + ks[None, :], mask=k0 + ks[None, :] < K, other=0.0)


@triton.jit
def _rows_tile_dot(acc0, acc1, acc2, acc3, w, x_ptr, stride_xm, k0, ks, K, EVEN_K: tl.constexpr, xs0, xs1, xs2, xs3,
                   M: tl.constexpr, QUANT_X: tl.constexpr):
    """One float32 weight tile's products added into the M (1..4) rows' accumulators."""
    acc0 = _row_tile_dot(acc0, w, x_ptr, k0, ks, K, EVEN_K, xs0, QUANT_X)
    if M > 1:
        acc1 = _row_tile_dot(acc1, w, x_ptr + stride_xm, k0, ks, K, EVEN_K, xs1, QUANT_X)
    if M > 2:
        acc2 = _row_tile_dot(acc2, w, x_ptr + 2 * stride_xm, k0, ks, K, EVEN_K, xs2, QUANT_X)
    if M > 3:
        acc3 = _row_tile_dot(acc3, w, x_ptr + 3 * stride_xm, k0, ks, K, EVEN_K, xs3, QUANT_X)
    return acc0, acc1, acc2, acc3


@triton.jit
def _amax_step(amax, x_ptr, k0, ks, K):
    x = tl.load(x_ptr + k0 + ks, mask=k0 + ks < K, other=0.0)
    return tl.maximum(amax, tl.abs(x.to(tl.float32)))


@triton.jit
def _row_scales(x_ptr, stride_xm, K, M: tl.constexpr, AMAX_BLOCK: tl.constexpr):
    """The dynamic e4m3 scales of the M (1..4) activation rows, ``max(absmax / 448, tiny)`` over all of K, as
    ``fp8_quant.quantize_per_token`` computes them: one loop loads every row's next slice together (x is small
    and L2-resident; one round trip per step, not one per row)."""
    ks = tl.arange(0, AMAX_BLOCK)
    a0 = tl.zeros([AMAX_BLOCK], dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    for k0 in range(0, K, AMAX_BLOCK):
        a0 = _amax_step(a0, x_ptr, k0, ks, K)
        if M > 1:
            a1 = _amax_step(a1, x_ptr + stride_xm, k0, ks, K)
        if M > 2:
            a2 = _amax_step(a2, x_ptr + 2 * stride_xm, k0, ks, K)
        if M > 3:
            a3 = _amax_step(a3, x_ptr + 3 * stride_xm, k0, ks, K)
    return (e4m3_scale(tl.max(a0, axis=0)), e4m3_scale(tl.max(a1, axis=0)), e4m3_scale(tl.max(a2, axis=0)),
            e4m3_scale(tl.max(a3, axis=0)))


@triton.jit
def _store_row(acc, y_ptr, b_ptr, rows, N, HAS_BIAS: tl.constexpr, xs, ws_ptr, SCALED: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if SCALED:  # FP8: codes were multiplied; the row's activation scale and each output channel's weight scale
        y = y * xs * tl.load(ws_ptr + rows, mask=rows < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym, xs_ptr, ws_ptr,
                 M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr, QUANT_X: tl.constexpr = False,
                 STATIC_X: tl.constexpr = False, AMAX_BLOCK: tl.constexpr = 16, W_VEC: tl.constexpr = 0,
                 PREFETCH: tl.constexpr = False):
    """``y[m, rows] = x[m] . W[rows]`` for m < M (1..4) and this program's BLOCK_N rows, over all of K. PDL: load the
    first weight tile, let the next kernel launch, then wait for the previous one (which may write ``x``).
    SCALED (FP8 e4m3 ``W``): the dot products of the codes times ``xs[m] * ws[rows]``, where ``x`` holds e4m3 codes
    and ``xs_ptr`` their per-row scales, or with QUANT_X ``x`` is 16-bit and the kernel rounds it to codes itself:
    per row with the absmax scale over all of K (every program computes it; ``AMAX_BLOCK`` columns a step), or
    STATIC_X with the one scale at ``xs_ptr``. W_VEC (0: 16 bytes' worth): weights loaded at once by a thread.
    PREFETCH: each step requests the next weight tile before multiplying the one it holds, so two tiles a program
    are in flight (1-byte weights put half the bytes of a 16-bit tile in flight); the same sums in the same order."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row N - 1 (never stored): the loop's loads need no row mask
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    ks = tl.arange(0, BLOCK_K)
    if W_VEC:  # narrower than 16 bytes: 8 codes line up with x's 16-byte loads of 8 bf16 columns (QUANT_X)
        ks = tl.max_contiguous(ks, W_VEC)
    w = _weight_tile(w_rows, 0, ks, K, EVEN_K)
    if QUANT_X and STATIC_X:  # a constant of the layer, not written by the previous kernel
        xs0 = tl.load(xs_ptr).to(tl.float32)
        xs1 = xs0
        xs2 = xs0
        xs3 = xs0
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if QUANT_X and not STATIC_X:
        xs0, xs1, xs2, xs3 = _row_scales(x_ptr, stride_xm, K, M, AMAX_BLOCK)
    if not QUANT_X:
        xs0 = 1.0  # per-row code scales, read at the end (SCALED) or unused
        xs1 = xs0
        xs2 = xs0
        xs3 = xs0
    zero = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    if PREFETCH:
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_next = _weight_tile(w_rows, k0, ks, K, EVEN_K)
            acc0, acc1, acc2, acc3 = _rows_tile_dot(acc0, acc1, acc2, acc3, w.to(tl.float32), x_ptr, stride_xm,
                                                    k0 - BLOCK_K, ks, K, EVEN_K, xs0, xs1, xs2, xs3, M, QUANT_X)
            w = w_next
        last = (K - 1) // BLOCK_K * BLOCK_K
        acc0, acc1, acc2, acc3 = _rows_tile_dot(acc0, acc1, acc2, acc3, w.to(tl.float32), x_ptr, stride_xm, last,
                                                ks, K, EVEN_K, xs0, xs1, xs2, xs3, M, QUANT_X)
    else:
        acc0, acc1, acc2, acc3 = _rows_tile_dot(acc0, acc1, acc2, acc3, w.to(tl.float32), x_ptr, stride_xm, 0, ks,
                                                K, EVEN_K, xs0, xs1, xs2, xs3, M, QUANT_X)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            wk = _weight_tile(w_rows, k0, ks, K, EVEN_K).to(tl.float32)
            acc0, acc1, acc2, acc3 = _rows_tile_dot(acc0, acc1, acc2, acc3, wk, x_ptr, stride_xm, k0, ks, K, EVEN_K,
                                                    xs0, xs1, xs2, xs3, M, QUANT_X)
    if SCALED and not QUANT_X:
        xs0 = tl.load(xs_ptr)
        if M > 1:
            xs1 = tl.load(xs_ptr + 1)
        if M > 2:
            xs2 = tl.load(xs_ptr + 2)
        if M > 3:
            xs3 = tl.load(xs_ptr + 3)
    _store_row(acc0, y_ptr, b_ptr, rows, N, HAS_BIAS, xs0, ws_ptr, SCALED)
    if M > 1:
        _store_row(acc1, y_ptr + stride_ym, b_ptr, rows, N, HAS_BIAS, xs1, ws_ptr, SCALED)
    if M > 2:
        _store_row(acc2, y_ptr + 2 * stride_ym, b_ptr, rows, N, HAS_BIAS, xs2, ws_ptr, SCALED)
    if M > 3:
        _store_row(acc3, y_ptr + 3 * stride_ym, b_ptr, rows, N, HAS_BIAS, xs3, ws_ptr, SCALED)


def shape_problem(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Why the GEMV kernel cannot take ``x [M, K]`` and ``weight [N, K]`` by their shapes, or "" (shared by every
    launcher of ``_gemv_kernel``: this module's and ``gemv_fp8``'s)."""
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
    m, k = x.shape
    if weight.shape[1] != k:
        return f"x has {k} features, the weight {weight.shape[1]}"
    if not 1 <= m <= MAX_M:
        return f"the GEMV takes 1..{MAX_M} rows, got {m}"
    return ""


def layout_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   others: tuple[torch.Tensor | None, ...] = (), names: str = "x, weight and bias") -> str:
    """Why the GEMV kernel cannot take these operands by their strides, bias shape or devices (``others``: further
    tensors that must sit on x's device, ``names`` says which in the message), or ""."""
    if weight.stride(1) != 1 or x.stride(1) != 1:
        return "x and weight must be contiguous along K"
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        return f"bias must be a contiguous [{weight.shape[0]}] vector, got {tuple(bias.shape)}"
    if any(t is not None and t.device != x.device for t in (weight, bias, *others)):
        return f"{names} must be on one device"
    if x.device.type != "cuda" and not interpreting():
        return "the GEMV runs on CUDA (or under TRITON_INTERPRET=1)"
    return ""


def gemv_supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[bool, str]:
    """Whether :func:`gemv` runs ``x [M, K] @ weight[N, K]^T (+ bias)``: ``(ok, reason it does not)``."""
    reason = shape_problem(x, weight)
    if reason:
        return False, reason
    m = x.shape[0]
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    if scales is not None:  # FP8: e4m3 codes, float32 scales [M, 1] (x) and [1, N] or [N] (weight)
        dtypes = (torch.float8_e4m3fn,)
        xs, ws = scales
        if xs.dtype != torch.float32 or ws.dtype != torch.float32 or xs.numel() != m or ws.numel() != weight.shape[0]:
            return False, f"FP8 scales must be float32 with {m} and {weight.shape[0]} values"
        if not (xs.is_contiguous() and ws.is_contiguous()):
            return False, "FP8 scales must be contiguous"
    if x.dtype not in dtypes or weight.dtype != x.dtype:
        return False, f"x and weight must share a dtype among {dtypes}, got {x.dtype} and {weight.dtype}"
    reason = layout_problem(x, weight, bias)
    return not reason, reason


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: DenseGemvConfig | None = None, *, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` -> ``[M, N]`` in x's dtype, float32 accumulation; M = 1..4.
    ``config`` None: the tuned or default one. Raises ValueError where :func:`gemv_supports` says no.
    ``scales=(xs [M, 1], ws [N])`` (float32): ``x`` and ``weight`` are FP8 e4m3 codes and the result is
    ``(x_codes @ w_codes^T) * xs * ws^T (+ bias)`` in ``out_dtype`` (default bfloat16): half the weight bytes."""
    ok, reason = gemv_supports(x, weight, bias, scales)
    if not ok:
        raise ValueError(reason)
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or (_fp8_codes_config(m, n, k, gpu_card(x.device)) if scales is not None else _gemv_config(m, n, k))
    y = torch.empty((m, n), device=x.device, dtype=out_dtype or (torch.bfloat16 if scales is not None else x.dtype))
    xs, ws = scales if scales is not None else (y, y)  # placeholders, never read unless SCALED
    pdl = programmatic_launch(x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight if bias is None else bias, y, n, k, x.stride(0), weight.stride(0), y.stride(0), xs, ws,
        M=m, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        PDL=pdl, SCALED=scales is not None, W_VEC=cfg.vec, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
        num_stages=1, **pdl_launch(pdl))
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-PyTorch reference: float32 products and sums, bias added in float32, one rounding to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
