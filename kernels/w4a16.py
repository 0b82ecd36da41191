"""W4A16 GEMM launchers: ``Y = X W^T``, ``X`` fp16/bf16 ``[M, K]``, ``W`` ``[N, K]`` as packed 4-bit (or 8-bit)
codes with per-group scales (and zero points when asymmetric), ``Y`` ``[M, N]`` in X's dtype.

Layers do not call this module: their front door is :func:`quantkit.kernels.dispatch.w4a16_linear`, which runs
the launcher the layer's plan bound at load (:func:`bind_launcher`, one per M bucket; no checks per call).
:func:`w4a16_matmul` is the checked entry for tests, benchmarks and the tuner: it validates its inputs and runs
the config it is given (whose type names the kernel), or the weights' plan for M (in Triton's interpreter, the
non-Hopper rules with small tiles). Kernels: :mod:`quantkit.kernels.w4a16_triton` (sm_80 on, and the CPU
interpreter) and :mod:`quantkit.kernels.w4a16_gluon` (Hopper); the repack is in :mod:`quantkit.kernels.w4a16_weights`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from quantkit.kernels import device_info
from quantkit.kernels.device_info import interpreting
from quantkit.kernels.w4a16_configs import (
    PAIR_TILE_K,
    CudaConfig,
    CutlassConfig,
    DequantConfig,
    GemvConfig,
    GluonConfig,
    PairsConfig,
    TcConfig,
)
from quantkit.kernels.w4a16_select import PAIRS_SPLIT_MAX_M, KernelChoice, LayerFacts, select_w4a16
from quantkit.kernels.w4a16_triton import _gather_columns, _w4a16_gemv_kernel, _w4a16_kernel, _w4a16_pairs_kernel
from quantkit.kernels.w4a16_weights import W4A16Weights, prepare_w4a16_weights, w4a16_matmul_ref

__all__ = ["W4A16Weights", "prepare_w4a16_weights", "w4a16_matmul", "w4a16_matmul_ref", "bind_launcher", "DECODE_MAX_M"]

# The general tensor-core kernel splits K (float32 atomics) up to this many rows.
DECODE_MAX_M = 16


def _decode_split_k(n_tiles: int, k_tiles: int, num_sms: int) -> int:
    """Split K for about 4 programs per SM (bytes in flight to cover load latency), at least 2 K tiles each."""
    want = max(1, (4 * num_sms) // max(n_tiles, 1))
    return max(1, min(want, k_tiles // 2 if k_tiles >= 2 else 1))


def _gemv_split_k(n_tiles: int, k_tiles: int, num_sms: int, progs_per_sm: int) -> int:
    """Split K so the GEMV grid has about ``progs_per_sm`` programs per SM, every K slice non-empty."""
    want = max(1, min(round(progs_per_sm * num_sms / max(n_tiles, 1)), k_tiles))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, want))


def _gemv_matmul(x, w, config: GemvConfig):
    """The GEMV: split K with float32 atomics into a zeroed buffer, then a cast; ``SPLIT_K=1``: one launch."""
    m, k = x.shape
    n = w.out_features
    x = x.contiguous()
    direct = config.SPLIT_K == 1
    out = torch.empty((m, n), device=x.device, dtype=x.dtype) if direct else torch.zeros(
        (m, n), device=x.device, dtype=torch.float32)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    block_m = max(1, triton.next_power_of_2(m))
    if w.group_size % config.BLOCK_K and config.BLOCK_K % w.group_size:
        raise ValueError(f"GEMV BLOCK_K {config.BLOCK_K} must divide the group size {w.group_size} "
                         "or be a multiple of it")
    n_tiles, k_tiles = triton.cdiv(n, config.BLOCK_N), triton.cdiv(k, config.BLOCK_K)
    split = 1 if direct else config.SPLIT_K or _gemv_split_k(
        n_tiles, k_tiles, device_info.num_sms(x.device), config.PROGS_PER_SM)
    # K_WORDS (= K / PER_WORD) as its own argument: its divisibility by 16 keeps the masked word loads 16 bytes wide.
    # The exponent trick (MAGIC) is exact for 4- and 8-bit codes in float32.
    _w4a16_gemv_kernel[(n_tiles, split)](
        x, w.qweight, w.scales, zeros, out, m, n, k, w.qweight.shape[1],
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=w.group_size, BITS=w.bits, HAS_ZEROS=w.zeros is not None, MAGIC=0x4B000000, BLOCK_M=block_m,
        LOP3_ASM=not interpreting(), DIRECT=direct, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        PIPE=config.PIPE, num_warps=config.num_warps, num_stages=max(config.PIPE, 1))
    return out if direct else out.to(x.dtype)


def _pairs_matmul(x, w, config: PairsConfig):
    """The paired-nibble kernel. ``x`` is in the caller's column order; it is gathered once here."""
    m, k = x.shape
    n = w.out_features
    num_sms = device_info.num_sms(x.device)
    # split K up to PAIRS_SPLIT_MAX_M rows, and wherever 128 x 128 output tiles would not fill the SMs
    split = m <= PAIRS_SPLIT_MAX_M or triton.cdiv(n, 128) * triton.cdiv(m, 128) < num_sms
    out = torch.empty((m, n), device=x.device, dtype=torch.float32 if split else x.dtype)
    xp = _gather_columns(x, w.pair_index, out if split else None)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    k_tiles = k // PAIR_TILE_K
    out_tiles = triton.cdiv(n, config.BLOCK_N) * triton.cdiv(m, config.BLOCK_M)
    n_split = 1 if not split else config.SPLIT_K or _gemv_split_k(out_tiles, k_tiles, num_sms, config.PROGS_PER_SM)
    _w4a16_pairs_kernel[(out_tiles, n_split)](
        xp, w.qweight, w.scales, zeros, out, m, n, k,
        xp.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=w.group_size, HAS_ZEROS=w.zeros is not None,
        MAGIC_VALUE=128.0 if x.dtype == torch.bfloat16 else 1024.0, ATOMIC_OUT=split,
        KW=PAIR_TILE_K // 8, PAIR_ASM=not interpreting(), BLOCK_N=config.BLOCK_N, BLOCK_M=config.BLOCK_M,
        GROUP_N=config.GROUP_N, num_warps=config.num_warps, num_stages=config.num_stages)
    return out.to(x.dtype) if split else out


def _tc_matmul(x, w, config: TcConfig):
    """The general tensor-core kernel: split K for M <= DECODE_MAX_M, one program per output tile above."""
    m, k = x.shape
    n = w.out_features
    decode = m <= DECODE_MAX_M
    # The exponent trick needs MAGIC_VALUE + code exact: 8-bit codes overflow bf16's mantissa (then int->float).
    magic, magic_value = 0, 0.0
    if w.bits == 4 or x.dtype == torch.float16:
        magic, magic_value = (0x4300, 128.0) if x.dtype == torch.bfloat16 else (0x6400, 1024.0)
    out = torch.zeros((m, n), device=x.device, dtype=torch.float32) if decode else torch.empty(
        (m, n), device=x.device, dtype=x.dtype)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    n_tiles = triton.cdiv(n, config.BLOCK_N)
    out_tiles = n_tiles * triton.cdiv(m, config.BLOCK_M)
    split = 1  # a 16-bit output cannot take partial sums
    if decode:
        split = config.SPLIT_K or _decode_split_k(n_tiles, triton.cdiv(k, config.BLOCK_K),
                                                  device_info.num_sms(x.device))
    _w4a16_kernel[(out_tiles, split)](
        x, w.qweight, w.scales, zeros, out, m, n, k,
        x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1),
        w.scales.stride(0), w.scales.stride(1), zeros.stride(0), zeros.stride(1), out.stride(0), out.stride(1),
        GROUP_SIZE=w.group_size, BITS=w.bits, HAS_ZEROS=w.zeros is not None, MAGIC=magic, MAGIC_VALUE=magic_value,
        ATOMIC_OUT=decode, BLOCK_N=config.BLOCK_N, BLOCK_M=config.BLOCK_M, BLOCK_K=config.BLOCK_K,
        GROUP_N=config.GROUP_N, W_IS_A=config.W_IS_A, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out.to(x.dtype) if decode else out


def _planned_choice(x: torch.Tensor, w: W4A16Weights) -> KernelChoice:
    """The kernel and config for ``x``'s row count: the weights' plan on CUDA; in Triton's interpreter the
    non-Hopper rules (small tiles)."""
    m = x.shape[0]
    if w.plan is not None and x.is_cuda:
        return w.plan.choice(m)
    choice = select_w4a16(m, w.facts(), "sm80")
    small = {"gemv": GemvConfig(32, min(32, w.group_size or 32), SPLIT_K=choice.config.SPLIT_K)
             if choice.kernel == "gemv" else None,
             "pairs": PairsConfig(32, 16), "tc": TcConfig(64, 16, 64) if m <= DECODE_MAX_M else TcConfig(64, 32, 64)}
    return KernelChoice(choice.kernel, small.get(choice.kernel), "interpreter: " + choice.reason)


def _check_inputs(x: torch.Tensor, w: W4A16Weights) -> None:
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if w.group_size is None:
        raise ValueError("the kernel needs contiguous groups of one length; use w4a16_matmul_ref")
    if not (x.is_cuda or interpreting()):
        raise ValueError("the Triton kernel needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if x.device != w.qweight.device:
        raise ValueError(f"x on {x.device}, weights on {w.qweight.device}")


def w4a16_matmul(x: torch.Tensor, w: W4A16Weights, config=None) -> torch.Tensor:
    """``x [M, K]`` fp16/bf16 -> ``x @ W^T`` ``[M, N]``. ``config`` None: the weights' plan for M; otherwise a
    config of :mod:`quantkit.kernels.w4a16_configs`, whose type names the kernel."""
    _check_inputs(x, w)
    if config is None:
        choice = _planned_choice(x, w)
        if choice.kernel == "reference":
            raise ValueError(f"no W4A16 kernel serves this layer: {choice.reason}; use w4a16_matmul_ref")
        config = choice.config
    if isinstance(config, GluonConfig):
        from quantkit.kernels.w4a16_gluon import w4a16_gluon_matmul

        return w4a16_gluon_matmul(x, w, config)
    if isinstance(config, CudaConfig):
        from quantkit.kernels.w4a16_cuda import w4a16_cuda_matmul

        return w4a16_cuda_matmul(x, w, config)
    if isinstance(config, DequantConfig):
        return _launcher(config)(x, w)
    if isinstance(config, CutlassConfig):
        from quantkit.kernels.w4a16_cutlass import w4a16_cutlass_matmul

        return w4a16_cutlass_matmul(x, w, config)
    if isinstance(config, PairsConfig):
        if w.pair_index is None:  # set for 4-bit codes with K a multiple of the tile only
            raise ValueError(f"the paired-nibble kernel needs 4-bit codes and K a multiple of {PAIR_TILE_K}, "
                             f"got {w.bits}-bit, K = {w.in_features}")
    elif not isinstance(config, (GemvConfig, TcConfig)):
        raise TypeError("config must be a GemvConfig, PairsConfig, TcConfig, GluonConfig, CudaConfig, CutlassConfig "
                        f"or DequantConfig, got {config!r}")
    elif isinstance(config, GemvConfig) and x.shape[0] > 64:
        raise ValueError(f"the GEMV takes at most 64 rows, got {x.shape[0]}")
    return _launcher(config)(x, w)


def _launcher(config) -> Callable[[torch.Tensor, W4A16Weights], torch.Tensor]:
    """``run(x, w)`` for a Triton config (gemv, pairs, tc or dequant), inputs already checked: the column gather for
    act-order weights (the pairs kernel and dequantize-then-cuBLAS gather their own), then the launch."""
    if isinstance(config, DequantConfig):
        from quantkit.kernels.w4a16_dequant import w4a16_dequant_matmul

        return lambda x, w: w4a16_dequant_matmul(x, w, config)
    if isinstance(config, PairsConfig):
        return lambda x, w: _pairs_matmul(x, w, config)
    launch = _gemv_matmul if isinstance(config, GemvConfig) else _tc_matmul
    return lambda x, w: launch(x if w.perm is None else x[:, w.perm], w, config)


def bind_launcher(choice: KernelChoice, facts: LayerFacts, bucket: int):
    """The launcher ``run(x, w)`` a layer's plan holds for one M bucket (None for the reference): chosen once, at
    load, so the call runs it without re-checking support (the plan was made for these weights on their GPU and
    the caller passes fp16/bf16 activations of ``facts.k`` columns). A Gluon config is bound to its launch when it
    fits every M of the bucket, as the selection checks; otherwise to the checked entry, which says why not."""
    if choice.kernel == "reference":
        return None
    config = choice.config
    if isinstance(config, CudaConfig):
        return _cuda_launcher(config, bind_launcher(choice.fallback, facts, bucket))
    if isinstance(config, CutlassConfig):
        return _cutlass_launcher(config, bind_launcher(choice.fallback, facts, bucket))
    if isinstance(config, GluonConfig):
        from quantkit.kernels import w4a16_gluon

        lo = bucket // 2 + 1 if bucket > 1 else 1
        if config.fits(lo, facts.group_size) and config.fits(bucket, facts.group_size):
            return lambda x, w: w4a16_gluon.launch(x, w, config)
        return lambda x, w: w4a16_gluon.w4a16_gluon_matmul(x, w, config)
    return _launcher(config)


def _cutlass_launcher(config, fallback):
    """``run(x, w)`` for a ``cutlass`` choice (prefill): the CUTLASS kernel where it takes the call and its library
    builds (decided once per activation dtype; the build, ~1 minute once per machine, on the first call), else
    ``fallback``. The kernel reads the layer's codes in place, with the bf16 scales and zero terms the front door
    made at load (``W4A16Weights.cutlass``)."""

    def available(x, w):
        from quantkit.kernels import w4a16_cutlass

        return w4a16_cutlass.available(x, w, config)[0]

    def matmul(x, w):
        from quantkit.kernels.w4a16_cutlass import w4a16_cutlass_matmul

        return w4a16_cutlass_matmul(x, w, config)

    return _built_kernel_or_fallback("CUTLASS", available, matmul, lambda x: x.dtype, fallback)


def _cuda_launcher(config, fallback):
    """``run(x, w)`` for a ``cuda`` choice: the CUDA kernel where its library builds (decided once per dtype and
    row tile, the build on the first call), else ``fallback`` (the Triton choice), with one log line from the
    build (:func:`quantkit.kernels.w4a16_cuda.library`)."""

    def available(x, w):
        from quantkit.kernels import w4a16_cuda

        return w4a16_cuda.available(x, w, config)[0]

    def matmul(x, w):
        from quantkit.kernels.w4a16_cuda import w4a16_cuda_matmul

        return w4a16_cuda_matmul(x, w, config)

    return _built_kernel_or_fallback("CUDA", available, matmul, lambda x: (x.dtype, x.shape[0] > 8), fallback)


def _built_kernel_or_fallback(name: str, available, matmul, key, fallback):
    """``run(x, w)`` for a kernel built with nvcc on first use: ``matmul`` where ``available(x, w)`` said yes for
    the call's ``key(x)`` (asked once per key: the answer may cost a build), else ``fallback``."""
    usable = {}

    def run(x, w):
        k = key(x)
        if k not in usable:
            usable[k] = available(x, w)
        if usable[k]:
            return matmul(x, w)
        if fallback is None:
            raise ValueError(f"the {name} W4A16 kernel is not available here and no fallback was planned")
        return fallback(x, w)

    return run
