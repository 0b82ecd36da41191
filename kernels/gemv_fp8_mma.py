"""The FP8 decode GEMM on tensor cores: ``y = (qx @ W^T) * s_x[m] * s_w[n] (+ bias)`` for e4m3 codes ``qx [M, K]``
(M = 1..64, per-row float32 scales, as ``fp8_quant.quantize_per_token`` writes them) and e4m3 ``W [N, K]`` with one
float32 scale per output channel.

Why: the CUDA-core FP8 GEMV (``gemv.py`` with ``scales=``) turns every weight byte into a float32 in registers
before its multiply-add: on sm_90 twice the instructions a byte of the bf16 GEMV and 120 registers a thread, and in
Llama-3-8B's decode step its linears read their 8 GB at 2.4 TB/s where bf16's read 15 GB at 4.2 TB/s (docs/fp8.md).
Here the weights never leave their 1-byte form: each program computes a ``[BLOCK_N, BLOCK_M]`` block of ``y^T`` as
``W_tile @ qx_tile^T`` ("swap AB": the weight rows fill the MMA's 64-row side, the few activation rows its narrow
side, padded to 16 with zeros that cost no memory traffic). With BLOCK_N >= 64 Triton emits Hopper's FP8
warpgroup MMA (QGMMA) reading both operands from shared memory, filled by ``cp.async`` ``num_stages`` tiles ahead:
a K step is a handful of instructions for kilobytes of weights. With BLOCK_N < 64 it falls back to ``mma.sync`` on
fp16 operands, the codes converted two at a time (exact: every e4m3 value is an fp16 value).

Split K: a 4096-row layer in 64-row tiles is 64 programs for 132 SMs, so ``split_k`` programs share a tile's K.
Each writes its float32 partial block to a workspace and counts itself in at the tile's counter; the last to
arrive sums the partials in split order (deterministic: the same bits every call) and writes ``y``, then resets the
counter to zero for the next call. The counters are one int32 a tile, zero between calls: the runtime keeps one
buffer per linear (:func:`counters_for`), a call without one allocates it zeroed.

ACCUMULATION. The tensor cores' FP8 products are exact, but Hopper's FP8 MMA adds them into its accumulator with
fewer bits than float32, and Triton lets a whole K loop accumulate there by default: in the H100 sweep the error
against the float32 reference grew with the K a program sums (0.0021 at 4096 columns, 0.0034 at 14336, against
0.0018 with 1792 a split; bf16 output rounding alone is ~0.0017). So each K step's MMA sum (BLOCK_K columns) is
added into a float32 accumulator (``max_num_imprecise_acc``; 8 FADDs a thread a step, no spill):
``QUANTKIT_FP8_MMA_ACC=tensorcore`` leaves the whole loop to the tensor cores (an A/B switch). The float32 sums
then differ from the CUDA-core GEMV's only in order. Configs: :func:`mma_config`, a rule fitted to the sweep of
``bench/tune_fp8_mma.py`` on an H100 (bench/results/tune_fp8_mma_h100_e9cd379.json: alone, the kernel reads the
Llama-3-8B linears at 94-102 % of copy bandwidth at M = 1 and 8). The runtime takes it at decode batches of 2..64
rows (``fp8_linear``). The reference is :func:`gemv_fp8_mma_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import ab_switch, num_sms, pdl_launch, programmatic_launch

MAX_M = 64  # activation rows one launch takes: the MMA's narrow side (16, 32 or 64 after padding)
SMEM_BUDGET = 96 * 1024  # the deepest pipeline measured: 4 stages of (64 weight + 32 activation rows) x 256 bytes
MIN_SPLIT_COLUMNS = 4096  # K columns each split keeps at least: below, the reduction costs more than the SMs gain


@dataclass(frozen=True)
class Fp8MmaConfig:
    """Launch config of :func:`gemv_fp8_mma`. ``block_n``: weight rows a program owns (>= 64 for the FP8
    warpgroup MMA); ``block_k``: K columns a step; ``split_k``: programs sharing one tile's K; ``num_stages``: K
    steps the ``cp.async`` pipeline keeps in flight."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name, least in (("block_n", 16), ("block_k", 16), ("num_warps", 1)):  # tl.dot's tiles: >= 16
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"Fp8MmaConfig.{name} must be a power of two >= {least}, got {value}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"Fp8MmaConfig.split_k and num_stages must be >= 1, got {self.split_k}, {self.num_stages}")


def block_m(m: int) -> int:
    """The MMA's narrow side for ``m`` activation rows: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


def smem_bytes(cfg: Fp8MmaConfig, m: int) -> int:
    """Shared memory of the pipeline: ``num_stages`` tiles of weights and of activation codes, one byte each."""
    return cfg.num_stages * (cfg.block_n + block_m(m)) * cfg.block_k


def mma_config(m: int, n: int, k: int, sms: int = 132) -> Fp8MmaConfig:
    """The rule, fitted to the H100 sweep (bench/results/tune_fp8_mma_h100_e9cd379.json: M = 1, 8, 32 on the
    Llama-3-8B linears): 64-row tiles (the FP8 warpgroup MMA, no conversion), 256 columns a step (one 1-byte row of
    a tile is two 128-byte lines), 4 stages where they fit :data:`SMEM_BUDGET` (best or within 0.3 us of the best
    in every cell, 32 rows included), and a K split only where the tiles leave SMs idle and each split keeps at
    least :data:`MIN_SPLIT_COLUMNS` columns: the largest such split whose programs fit one wave. Measured: 4096x4096
    (64 tiles, K 4096) 8.6 us unsplit against 9.6 split in two; 4096x14336 (64 tiles, K 14336) 23.2 us split in
    two against 24.0 unsplit; the 6144- and 28672-row layers fastest unsplit (the earlier, unmeasured rule split
    them 4 and 2 ways: 12.7 against 10.6 us, 44.3 against 40.8)."""
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    stages = 4
    while stages > 2 and stages * (64 + block_m(m)) * block_k > SMEM_BUDGET:
        stages -= 1
    tiles = triton.cdiv(n, 64)
    split = 1
    while tiles * split * 2 <= sms and k // (split * 2) >= MIN_SPLIT_COLUMNS:
        split *= 2
    return Fp8MmaConfig(64, block_k, split, 4, stages)


def counters_for(n: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 counter a tile for split-K calls on an ``n``-row weight (enough for any config's tiles, which
    are 16 rows at least); the kernel leaves it zeroed after each call, so one buffer serves a linear for its
    lifetime, one call at a time."""
    return torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device)


@triton.jit
def _scaled_store(acc, y_ptr, stride_ym, xs_ptr, ws_ptr, b_ptr, rn, rm, M, N, HAS_BIAS: tl.constexpr):
    """``y[rm, rn] = acc[rn, rm] * xs[rm] * ws[rn] (+ b[rn])``, rounded once to y's dtype."""
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    out = acc * ws[:, None] * xs[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None], out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_mma_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                    stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PDL: tl.constexpr, PROMOTE: tl.constexpr = 0):
    """Program (t, s): rows ``[t * BLOCK_N, (t + 1) * BLOCK_N)`` of ``W`` over K columns ``[s * K_SPLIT, (s + 1) *
    K_SPLIT)`` (a multiple of BLOCK_K), accumulated as ``W_tile @ x_tile^T``; with SPLIT_K > 1 the last program of
    the tile to finish reduces the partials (see the module's docstring)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # rows past N read row N - 1 (never stored), so the weight loads need no row mask
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    if PDL:  # the codes are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :])
            x = tl.load(x_rows + ks[None, :], mask=rm[:, None] < M, other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        if PROMOTE > 0:  # the tensor cores' sum of each K step added into float32 (module docstring: ACCUMULATION)
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if SPLIT_K == 1:
        _scaled_store(acc, y_ptr, stride_ym, xs_ptr, ws_ptr, b_ptr, rn, rm, M, N, HAS_BIAS)
    else:
        part_mask = (rn[:, None] < N) & (rm[None, :] < M)
        part = part_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]  # split s at part_ptr + s * M * N
        tl.store(part + pid_k * M * N, acc, mask=part_mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the tile's last program: the sum in split order, whoever came last
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=part_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)  # zero again for the next call
            _scaled_store(total, y_ptr, stride_ym, xs_ptr, ws_ptr, b_ptr, rn, rm, M, N, HAS_BIAS)


def gemv_fp8_mma_supports(qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> tuple[bool, str]:
    """Whether :func:`gemv_fp8_mma` runs these operands: ``(ok, reason it does not)``."""
    if qx.dim() != 2 or weight.dim() != 2 or qx.shape[1] != weight.shape[1]:
        return False, f"qx [M, K] and weight [N, K] must agree on K, got {tuple(qx.shape)} and {tuple(weight.shape)}"
    m, n = qx.shape[0], weight.shape[0]
    if not 1 <= m <= MAX_M:
        return False, f"M must be 1..{MAX_M}, got {m}"
    if qx.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        return False, f"qx and weight must be float8_e4m3fn, got {qx.dtype} and {weight.dtype}"
    if qx.stride(1) != 1 or weight.stride(1) != 1:
        return False, "qx and weight must be contiguous along K"
    if x_scale.dtype != torch.float32 or x_scale.numel() != m or not x_scale.is_contiguous():
        return False, f"the activation scales must be {m} float32 values, got {tuple(x_scale.shape)} {x_scale.dtype}"
    if w_scale.dtype != torch.float32 or w_scale.numel() != n or not w_scale.is_contiguous():
        return False, f"the weight scales must be {n} contiguous float32 values, got {tuple(w_scale.shape)}"
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        return False, f"the bias must be {n} contiguous values, got {tuple(bias.shape)}"
    if len({t.device for t in (qx, x_scale, weight, w_scale) + ((bias,) if bias is not None else ())}) != 1:
        return False, "every operand must be on one device"
    return True, ""


def gemv_fp8_mma(qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, config: Fp8MmaConfig | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``(qx [M, K] @ weight[N, K]^T) * x_scale[m] * w_scale[n] (+ bias)`` -> ``[M, N]`` in ``out_dtype``, one
    launch. ``x_scale``: M float32 values (``[M, 1]`` from ``quantize_per_token``); ``w_scale``: N float32 values.
    ``config`` None: :func:`mma_config`. ``counters``: int32, at least one per tile, zero (:func:`counters_for`);
    None allocates them. Raises ValueError where :func:`gemv_fp8_mma_supports` says no."""
    ok, reason = gemv_fp8_mma_supports(qx, x_scale, weight, w_scale, bias)
    if not ok:
        raise ValueError(reason)
    (m, k), n = qx.shape, weight.shape[0]
    cfg = config or mma_config(m, n, k, num_sms(qx.device))
    tiles = triton.cdiv(n, cfg.block_n)
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)  # a split past K would have nothing to add
    y = torch.empty((m, n), device=qx.device, dtype=out_dtype)
    if split > 1:
        part = torch.empty((split, m, n), device=qx.device, dtype=torch.float32)
        if counters is None:
            counters = counters_for(n, qx.device)
        elif counters.dtype != torch.int32 or counters.numel() < tiles:
            raise ValueError(f"counters must hold {tiles} int32 values, got {counters.numel()} {counters.dtype}")
    else:
        part = counters = y  # not read
    pdl = programmatic_launch(qx.device)
    promote = cfg.block_k if ab_switch("QUANTKIT_FP8_MMA_ACC", ("float32", "tensorcore")) == "float32" else 0
    _fp8_mma_kernel[(tiles, split)](
        qx, x_scale, weight, w_scale, weight if bias is None else bias, y, part, counters, m, n, k, k_split,
        qx.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m(m),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, EVEN_K=k % cfg.block_k == 0, PDL=pdl, PROMOTE=promote,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl))
    return y


def gemv_fp8_mma_ref(qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The plain-PyTorch reference: both operands dequantized to float32, one float32 matmul, the bias added in
    float32, one rounding to ``out_dtype``."""
    y = (qx.float() * x_scale.reshape(-1, 1)) @ (weight.float() * w_scale.reshape(-1, 1)).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
