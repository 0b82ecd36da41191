"""The FP8 decode GEMV in one launch: ``y = e4m3(x) @ W^T * s_x * s_w (+ bias)`` for 16-bit ``x [M, K]``
(M = 1..4) and e4m3 ``W [N, K]`` with one float32 scale per output channel, as the FP8 linear runs at decode.

Why: the two-launch path (``fp8_quant.quantize_per_token``, then ``gemv.gemv(..., scales=)``) pays a second
launch and a dependency per linear: 0.26 ms of a 3.9 ms decode step on Llama-3-8B at batch 1 (issue #42). Here
the GEMV quantizes its activations itself: after the first weight tile is requested and the previous kernel
waited for (PDL, as ``gemv.py``), each program reads its M rows of ``x`` over all of K (a few KB, L2-resident)
for their absmax, takes ``s = max(absmax / 448, tiny)`` (or the static input scale), and rounds each ``x`` slice
to e4m3 in registers as it multiplies it, with ``fp8_quant``'s own ``e4m3_scale`` / ``e4m3_codes``. The kernel is
``gemv._gemv_kernel`` with ``QUANT_X`` (one kernel, constexpr flags). The weights are read in 8-byte vectors (8
codes), not 16: then each thread's columns are those of its 16-byte loads of 16-bit ``x``; with 16-code vectors
Triton exchanges the x codes through shared memory, a barrier in every step (seen in the sm_90 SASS). The codes,
the scales and the float32 products are those of the two-launch path; at the same config and vector width
(``DenseGemvConfig(..., vec=8)`` there) the result is bitwise the same, and elsewhere (today's 16-byte vectors,
another config) only the float32 summation order differs. The tests check both.

Configs: 1-byte weights get their own table (:data:`TUNED_FP8`, by (N, K, M bucket)), which
``bench/tune_fp8_gemv.py`` measures and prints. The reference is :func:`gemv_fp8_ref` (plain PyTorch).
"""

from __future__ import annotations

import torch
import triton

from quantkit.kernels.device_info import pdl_launch, programmatic_launch
from quantkit.kernels.gemv import DenseGemvConfig, _gemv_kernel, layout_problem, shape_problem, within_k

C = DenseGemvConfig
# The FP8 GEMV's config by (N, K, M bucket: 1, 2 or 4; M = 3 takes 4's), Llama-3-8B's decode linears (qkv, o,
# gate_up, down). M = 1: measured on one H200 (bench/results/fp8_gemv_h200.json, `python bench/tune_fp8_gemv.py`,
# 2026-12-05; us per call and share of the copy rate in the comments). M = 2 and 4: NOT YET MEASURED (the tuner's
# deadline came first): the configs the two-launch path runs (the bf16 table with BLOCK_K doubled).
TUNED_FP8: dict[tuple[int, int, int], DenseGemvConfig] = {
    (6144, 4096, 1): C(16, 512, 8),  # 9.8 us, 92 %
    (4096, 4096, 1): C(8, 1024, 4),  # 7.5 us, 92 %
    (28672, 4096, 1): C(8, 512, 4),  # 36.2 us, 85 %
    (4096, 14336, 1): C(4, 1024, 4),  # 25.6 us, 67 % (the two-launch path: 21.5 us)
    (6144, 4096, 2): C(2, 4096, 8), (6144, 4096, 4): C(2, 2048, 4),
    (4096, 4096, 2): C(2, 4096, 8), (4096, 4096, 4): C(2, 2048, 4),
    (28672, 4096, 2): C(2, 4096, 8), (28672, 4096, 4): C(2, 2048, 4),
    (4096, 14336, 2): C(2, 4096, 8), (4096, 14336, 4): C(2, 2048, 4),
}
DEFAULT_FP8 = {1: C(2, 2048, 4), 2: C(2, 4096, 8), 4: C(2, 2048, 4)}  # a shape the table lacks

# float32 values a thread holds across the tile: M accumulators and the converted weights, BLOCK_N x BLOCK_K /
# (32 x warps) each. The sm_90 build (ptxas 12.x, Triton 3.6) spills past 256 and stays within 255 registers at or
# below it, for every candidate of bench/tune_fp8_gemv.py at K = 4096 (the tuner's pruning rule).
MAX_TILE_FLOATS = 256
VEC = 8  # weight codes a thread loads at once (8 bytes): x's 16-byte loads hold 8 bf16 columns, so they line up


def m_bucket(m: int) -> int:
    """The table's row bucket of ``m`` (1..4): 1, 2, or 4."""
    return 1 if m == 1 else 2 if m == 2 else 4


def tile_floats(cfg: DenseGemvConfig, m: int) -> int:
    """float32 registers a thread needs for the tile: (m accumulators + the converted weights) x its share."""
    return (m + 1) * cfg.block_n * cfg.block_k // (32 * cfg.num_warps)


def fits(cfg: DenseGemvConfig, m: int, k: int, vec: int = VEC) -> bool:
    """Whether ``cfg`` is a sensible FP8 config for ``m`` rows and ``k`` columns: every thread owns at least one
    ``vec``-code vector of the tile (no replicated threads; the GEMV on codes loads 16), BLOCK_K no wider than K,
    the tile within registers."""
    return (cfg.block_n * cfg.block_k >= vec * 32 * cfg.num_warps and cfg.block_k <= max(triton.next_power_of_2(k), 16)
            and tile_floats(cfg, m_bucket(m)) <= MAX_TILE_FLOATS)


def fp8_gemv_config(m: int, n: int, k: int) -> DenseGemvConfig:
    """The table's config for ``(n, k, m_bucket(m))``, else the bucket's default; BLOCK_K shrunk to a small K."""
    return within_k(TUNED_FP8.get((n, k, m_bucket(m))) or DEFAULT_FP8[m_bucket(m)], k)


def amax_block(m: int, k: int, num_warps: int) -> int:
    """Columns of ``x`` each absmax step loads per row: 64 / m values a thread (at least 8, one 16-byte vector), so
    all rows' slices of a step are in flight together in few registers; no wider than K."""
    per_thread = max(8, 64 // triton.next_power_of_2(m))
    return min(32 * num_warps * per_thread, max(triton.next_power_of_2(k), 16))


def gemv_fp8_supports(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      input_scale: torch.Tensor | None = None) -> tuple[bool, str]:
    """Whether :func:`gemv_fp8` runs these operands: ``(ok, reason it does not)``."""
    reason = shape_problem(x, weight)
    if reason:
        return False, reason
    n = weight.shape[0]
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weight.dtype != torch.float8_e4m3fn:
        return False, f"x must be 16- or 32-bit and the weight float8_e4m3fn, got {x.dtype} and {weight.dtype}"
    if w_scale.dtype != torch.float32 or w_scale.numel() != n or not w_scale.is_contiguous():
        return False, f"the weight scale must be {n} contiguous float32 values, got {tuple(w_scale.shape)}"
    if input_scale is not None and (input_scale.dtype != torch.float32 or input_scale.numel() != 1):
        return False, "the static input scale must be one float32 value"
    reason = layout_problem(x, weight, bias, (w_scale, input_scale), "x, weight, scales and bias")
    return not reason, reason


def gemv_fp8(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
             input_scale: torch.Tensor | None = None, config: DenseGemvConfig | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``e4m3(x [M, K]) @ weight[N, K]^T * s_x * w_scale (+ bias)`` -> ``[M, N]`` in ``out_dtype`` (default: x's),
    one launch, M = 1..4. ``w_scale``: float32, N values (``[1, N]`` or ``[N]``); ``input_scale``: one float32
    value (static activations) or None (per-token absmax scales). ``config`` None: :func:`fp8_gemv_config`.
    Raises ValueError where :func:`gemv_fp8_supports` says no."""
    ok, reason = gemv_fp8_supports(x, weight, w_scale, bias, input_scale)
    if not ok:
        raise ValueError(reason)
    (m, k), n = x.shape, weight.shape[0]
    cfg = config or fp8_gemv_config(m, n, k)
    y = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    static = input_scale is not None
    pdl = programmatic_launch(x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight if bias is None else bias, y, n, k, x.stride(0), weight.stride(0), y.stride(0),
        input_scale if static else w_scale, w_scale, M=m, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, PDL=pdl, SCALED=True, QUANT_X=True, STATIC_X=static,
        AMAX_BLOCK=amax_block(m, k, cfg.num_warps), W_VEC=cfg.vec or VEC, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch(pdl))
    return y


def gemv_fp8_ref(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The plain-PyTorch reference: ``x`` quantized per token (or statically) by ``quantize_per_token_ref``, both
    operands dequantized to float32, one float32 matmul, bias added in float32, one rounding to ``out_dtype``."""
    from quantkit.kernels.fp8_quant_ref import activations_through_e4m3

    y = activations_through_e4m3(x, 0, input_scale) @ (weight.float() * w_scale.reshape(-1, 1)).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
