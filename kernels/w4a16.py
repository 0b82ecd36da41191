"""W4A16 GEMM in Triton: ``Y = X W^T`` with 16-bit activations and packed 4-bit (or 8-bit) weights.

Shapes: ``X`` fp16/bf16 ``[M, K]``, ``W`` ``[N, K]`` stored as integer codes with per-group scales
(and zero points when asymmetric), ``Y`` ``[M, N]`` in the dtype of ``X``.

How the kernel works
--------------------
* The weights are read packed from HBM (``K / 8`` int32 words per output row at 4 bits), unpacked in
  registers with shifts and masks, scaled to 16 bits and fed to ``tl.dot``. The 16-bit weights are
  never written back to memory.
* The tensor-core kernels compute the transposed product ``Y^T = W X^T`` tile by tile: the
  dequantized weight tile is the *first* operand, which Hopper's wgmma can take straight from
  registers, and the activations are the second one, in shared memory. ``BLOCK_M`` can then be as
  small as 16 (decode) while ``BLOCK_N`` keeps the tensor-core instruction full.
* Three Triton kernels here and a Gluon one for Hopper (:mod:`quantkit.kernels.w4a16_gluon`), one
  entry point (:func:`w4a16_matmul`, which picks by M and device through :func:`choose_path`):
  - GEMV (M = 1 except on Hopper's largest layers; without the Gluon kernel also M = 2 on small
    layers): no tensor cores. Each program streams the packed words
    of BLOCK_N output rows over a K slice with 16-byte loads, unpacks them in the load's own register
    layout, forms exact ``code - zero`` in fp32 (one ``lop3`` per code, exponent trick), reduces
    along K and scales once per group (split-K with fp32 atomics; on small layers one program per row
    block over the whole K, stored directly: a single launch). ``_w4a16_gemv_kernel``.
  - Gluon (Hopper, every other M, the paired layout below): the same paired-nibble dequantization
    with the loads in a TMA ring fed by a producer warp, mma.sync up to 64 rows (stream-K over all
    SMs) and asynchronous wgmma overlapped with the dequantization above.
  - paired nibbles (every other M elsewhere, 4-bit weights with K a multiple of 128): a tensor-core kernel
    whose weight operand needs no reshape. Shifting a word right by 4j puts codes j and j+4 at bits
    0 and 16; one ``lop3`` turns them into two 16-bit floats in one register, one packed subtract
    and one packed multiply dequantize both, and that register *is* a wgmma A-operand register
    (two neighbouring K positions). The activations are gathered once per call into the matching
    column order (``W4A16Weights.pair_index``). Split-K with atomics up to 64 rows, one program
    per output tile above. ``_w4a16_pairs_kernel``.
  - the first tensor-core kernel (8-bit codes, K not a multiple of 128): the dequantized tile
    ``[BLOCK_N, BLOCK_K]`` from a 3-D unpack and reshape, as wgmma's A (``W X^T``) or B operand,
    split-K for M <= 16, pipelined big tiles with a grouped launch order above. ``_w4a16_kernel``.
* The one-time repack (:func:`prepare_w4a16_weights`) transposes the GPTQ ``qweight`` so that each
  output row's codes are contiguous along K (one 16-byte load gives one thread 32 consecutive
  codes), unpacks the zero points to bytes and, for act-order checkpoints, permutes K so that every
  group is contiguous (the activations' columns are permuted to match). It is not a file format.

The GPTQ layout itself is defined in :mod:`quantkit.pack`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

# The repack and the reference live beside this file and are re-exported here, the kernel's one
# import point.
from quantkit.kernels import device_info
from quantkit.kernels.gpu_timing import gpu_time_us
from quantkit.kernels.w4a16_weights import (
    PAIR_TILE_K,
    W4A16Weights,
    prepare_w4a16_weights,
    w4a16_matmul_ref,
)

__all__ = ["W4A16Weights", "prepare_w4a16_weights", "w4a16_matmul", "w4a16_matmul_ref", "DECODE_MAX_M",
           "GEMV_MAX_M", "pairs_supported", "gluon_available", "choose_path"]

# The first tensor-core kernel splits K (float32 atomics) up to this many rows.
DECODE_MAX_M = 16
# The default path (choose_path). Run 5 (28672x8192): M=1 GEMV 53 us vs paired-nibble 68; M=2 GEMV 89
# vs 68 on the two 121 MB shapes but 12 vs 18 on 4096x4096; from M=4 up the paired-nibble kernel beats
# the first tensor-core kernel at every M measured (70 vs 158 us at 16, 3.7 vs 6.6 ms at 4096).
GEMV_MAX_M = 2
# Without the Gluon kernel, at M = 2 the GEMV still wins below ~34 M weights (run 9: 12 vs 18 us at 16.8 M
# weights; at 58.7 M the paired kernels win, 26-28 vs 30 us).
GEMV_M2_MAX_WEIGHTS = 1 << 25
# With it (run 14, one launch less per call), the Gluon kernel wins at M = 2 on every shape (10.3 vs 12.2
# us at 16.8 M weights, 44.5 vs 89.9 at 235 M) and at M = 1 on the two 235 M-weight shapes (44.2 vs 54.6
# us). The GEMV keeps M = 1 on 16.8 M weights (8.8-9.4 vs ~9.8 us). At 58.7 M it was 17.4-18.4 us against
# the Gluon kernel's 17.9-18.2 at M = 2 (runs 14-18), but its autotuner then timed eagerly, and in run 17
# it picked a config that took 30.6 us on 4096 x 14336 (see _bench_quick, graph-timed since, not yet
# re-measured on the GPU); from 2**25 weights up M = 1 goes to the Gluon kernel, measured 17.5-17.8 us
# there in run 19.
GLUON_M1_MIN_WEIGHTS = 1 << 25
# Layers the direct-load Gluon kernel takes (whole 128-column K tiles per group; it reads the caller's
# activations in one launch) go to it at M = 1 from this many weights: 4.4 against the GEMV's 4.7 us at
# 2048 x 2048, 7.2 against 8.8 at 4096 x 4096 (H200 runs 41 and 43; the GEMV's numbers from run 41).
GLUON_DIRECT_M1_MIN_WEIGHTS = 1 << 22
# Up to this many weights the GEMV does not split K: each program owns whole output rows and stores them
# in the activations' dtype, so a call is one launch (no float32 zeroing before, no cast after). Run 21c
# (M = 1): 5.0 vs 5.9 us at 2048 x 2048, 8.9 vs 9.0 at 4096 x 4096; 20.9 vs 17.5 at 14336 x 4096, hence the
# bound.
GEMV_DIRECT_MAX_WEIGHTS = 1 << 24


# ----------------------------------------------------------------------------------------------
# Autotune configs: all in one place. BLOCK_M is the activation-row tile (the wgmma N dimension),
# BLOCK_N the output-feature tile (the wgmma M dimension), BLOCK_K the reduction tile.
# ----------------------------------------------------------------------------------------------
def _cfg(bn, bm, bk, warps, stages, group_n=8, w_is_a=True, gather=False):
    kw = dict(BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, GROUP_N=group_n, W_IS_A=w_is_a, W_GATHER=gather)
    return triton.Config(kw, num_warps=warps, num_stages=stages)


def _gemv_cfg(bn, bk, warps, pipe=1, progs_per_sm=8):
    return triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, PIPE=pipe, PROGS_PER_SM=progs_per_sm),
                         num_warps=warps, num_stages=max(pipe, 1))


# GEMV (M <= GEMV_MAX_M): BLOCK_M is the launcher's (next power of two >= M); the K split is the
# grid's second axis (_gemv_split_k, about PROGS_PER_SM programs per SM, no empty K slices).
# BLOCK_K may span several groups (v4: more bytes in flight per program). Configs whose per-thread
# product tile is too large for the registers at the given BLOCK_M, or whose BLOCK_K neither
# divides nor is a multiple of the group, are pruned.
GEMV_CONFIGS = [
    _gemv_cfg(64, 128, 4),
    _gemv_cfg(128, 128, 4),  # run 3's winner on every shape
    _gemv_cfg(128, 128, 8, pipe=3),
    _gemv_cfg(128, 256, 4),
    _gemv_cfg(128, 256, 8, pipe=2),
    _gemv_cfg(64, 512, 4),
    _gemv_cfg(128, 512, 8),
    _gemv_cfg(128, 512, 8, progs_per_sm=4),
    _gemv_cfg(256, 256, 8, progs_per_sm=4),
    _gemv_cfg(64, 256, 4, pipe=3, progs_per_sm=16),
]
# Direct (unsplit) GEMV, small layers: short row blocks so that the grid still covers the SMs
# (4096 rows / 16 = 256 programs), every program streaming its rows' whole K through a pipelined loop.
# Deep pipelines: a program has only its own rows to stream, so most of its K should be in flight at
# once (4096 x 4096: 8 tiles of 512 codes per row block).
GEMV_DIRECT_CONFIGS = [
    _gemv_cfg(8, 512, 4, pipe=3),
    _gemv_cfg(16, 512, 4, pipe=3),
    _gemv_cfg(16, 512, 4, pipe=6),
    _gemv_cfg(8, 512, 4, pipe=8),
    _gemv_cfg(16, 256, 4, pipe=8),
    _gemv_cfg(32, 256, 4, pipe=4),
    _gemv_cfg(8, 256, 2, pipe=8),
    # 1024-code tiles: 4.6 against 5.0 us at 2048 x 2048, M = 1 (H200 run 33). Whole rows in one or two
    # tiles (every load of a program issued at once: 2-8 rows x 2048-4096 codes, run 33) and twice the warps
    # per SM (8 warps a program, or 4 rows a program: run 36) were never faster.
    _gemv_cfg(8, 1024, 4, pipe=4),
]
_GEMV_MAX_PRODUCTS_PER_THREAD = 2048
_GEMV_MAX_CODES_PER_THREAD = 256


# Decode: BLOCK_M = 16 (the smallest dot tile). The K split is the grid's second axis, chosen per
# shape by _decode_split_k, so configs differ only in tile shape and pipelining depth.
DECODE_CONFIGS = [
    _cfg(64, 16, 256, 4, 3),
    _cfg(128, 16, 128, 4, 4),
    _cfg(128, 16, 256, 4, 3),
    _cfg(64, 16, 128, 4, 4),
    # v4: X tile as A, dequantized W tile through shared memory as B (no register-A layout change),
    # and the gather unpack (word per K row + shift, no reshape).
    _cfg(64, 16, 128, 4, 4, w_is_a=False),
    _cfg(128, 16, 128, 4, 3, w_is_a=False),
    _cfg(64, 16, 256, 4, 3, w_is_a=False),
    _cfg(128, 16, 256, 8, 3, w_is_a=False),
    _cfg(64, 16, 128, 4, 4, w_is_a=False, gather=True),
    _cfg(128, 16, 128, 4, 3, w_is_a=False, gather=True),
    _cfg(64, 16, 256, 4, 3, w_is_a=False, gather=True),
]
PREFILL_CONFIGS = [
    _cfg(128, 32, 128, 4, 4),
    _cfg(128, 64, 128, 4, 4),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 256, 64, 8, 3),
    _cfg(256, 128, 64, 8, 3),
    # Standard orientation: X tile is wgmma's A (shared memory), the dequantized weight tile is
    # stored to shared memory as B, which lets the wgmma of one K step overlap the next dequant.
    _cfg(128, 256, 64, 8, 3, w_is_a=False),
    _cfg(128, 128, 64, 8, 4, w_is_a=False),
    _cfg(256, 128, 64, 8, 3, w_is_a=False),
    # W as B built from redundant word loads (k // 8) + per-row shift: no reshape.
    _cfg(128, 256, 64, 8, 3, w_is_a=False, gather=True),
    _cfg(256, 128, 64, 8, 3, w_is_a=False, gather=True),
    _cfg(128, 128, 64, 8, 4, w_is_a=False, gather=True),
]
# Paired-nibble tensor-core kernel (4-bit, K a multiple of PAIR_TILE_K): BLOCK_M is the activation
# tile (wgmma N, >= 16), BLOCK_N the weight rows (wgmma M). Up to PAIRS_SPLIT_MAX_M rows the grid is
# split along K (about PROGS_PER_SM programs per SM, float32 atomics); above, one program per tile.
def _pairs_cfg(bn, bm, warps, stages, progs_per_sm=4, group_n=8):
    kw = dict(BLOCK_N=bn, BLOCK_M=bm, GROUP_N=group_n, PROGS_PER_SM=progs_per_sm)
    return triton.Config(kw, num_warps=warps, num_stages=stages)


PAIRS_CONFIGS = [
    # decode (run 5 winners: 64x16 4 stages 8/SM on 28672x8192, 128x16 3 stages 4/SM elsewhere)
    _pairs_cfg(128, 16, 4, 3),
    _pairs_cfg(128, 16, 4, 4, progs_per_sm=8),
    _pairs_cfg(64, 16, 4, 4, progs_per_sm=8),
    _pairs_cfg(64, 16, 4, 3, progs_per_sm=16),
    _pairs_cfg(64, 16, 4, 5, progs_per_sm=4),
    _pairs_cfg(256, 16, 8, 3),
    _pairs_cfg(128, 32, 4, 3),
    _pairs_cfg(64, 32, 4, 4, progs_per_sm=8),
    _pairs_cfg(128, 64, 4, 3),
    _pairs_cfg(128, 64, 8, 3, progs_per_sm=2),
    # prefill (run 5 winner: 128x128, 8 warps, 3 stages)
    _pairs_cfg(128, 128, 8, 3),
    _pairs_cfg(128, 128, 8, 4),
    _pairs_cfg(64, 128, 4, 4),
    _pairs_cfg(256, 128, 8, 3),
    _pairs_cfg(128, 256, 8, 3),
]
PAIRS_SPLIT_MAX_M = 64
# Aim for this many programs per SM in the decode grid: enough bytes in flight to cover latency.
_DECODE_PROGRAMS_PER_SM = 4
_GEMV_PROGRAMS_PER_SM = 8


def _m_bucket(m: int) -> int:
    """Autotune cache key for M: the next power of two (1, 2, 4, ..., capped at 4096)."""
    return min(triton.next_power_of_2(max(m, 1)), 4096)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _unpack_codes(words, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed words ``[ROWS, BLOCK_K*BITS/32]`` (K-contiguous) -> int32 codes ``[ROWS, BLOCK_K]``.

    Code j of a word sits at bit BITS*j and belongs to K index PER_WORD*word + j: a 3-D unpack whose
    reshape keeps each word's codes in the thread that loaded it.
    """
    PER_WORD: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PER_WORD) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [ROWS, BLOCK_K])


@triton.jit
def _codes_to_float(codes, zero, MAGIC: tl.constexpr, DTYPE: tl.constexpr):
    """Integer codes -> ``code - zero`` in DTYPE. With MAGIC, ``zero`` holds ``MAGIC_VALUE + zero``.

    MAGIC ORs the code into the mantissa of a float whose ulp is 1 (1024.0 in fp16, 128.0 in bf16,
    2**23 in fp32): the bits then read MAGIC_VALUE + code, exactly, with no int->float conversion
    (those run at a quarter of the FMA rate); one subtraction gives ``code - zero`` exactly.
    """
    if MAGIC != 0:
        if DTYPE == tl.float32:
            q = (codes | MAGIC).to(tl.float32, bitcast=True)
        else:
            q = (codes | MAGIC).to(tl.int16).to(DTYPE, bitcast=True)
        return q - zero
    else:
        return (codes - zero).to(DTYPE)


@triton.jit
def _dequant_tile(words, scale, zero, BITS: tl.constexpr, MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Packed words ``[BLOCK_N, BLOCK_K*BITS/32]`` -> 16-bit weights ``[BLOCK_N, BLOCK_K]``.

    ``scale``/``zero`` broadcast against ``[BLOCK_N, BLOCK_K]`` (``[BLOCK_N, 1]`` or full tiles).
    """
    codes = _unpack_codes(words, BITS, BLOCK_N, BLOCK_K)
    return _codes_to_float(codes, zero, MAGIC, DTYPE) * scale


@triton.jit
def _tile_and_k_slice(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_N: tl.constexpr):
    """This program's output tile ``(pid_n, pid_m)`` and its K tiles ``[kt_start, kt_end)``.

    Grouped order on grid axis 0: GROUP_N weight tiles are swept across all M tiles before the next
    GROUP_N, so the weight tiles in flight stay in L2 while the activations stream. Axis 1 splits K.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_in_group = GROUP_N * num_pid_m
    first_pid_n = (pid // num_pid_in_group) * GROUP_N
    group_size_n = min(num_pid_n - first_pid_n, GROUP_N)
    pid_n = first_pid_n + (pid % num_pid_in_group) % group_size_n
    pid_m = (pid % num_pid_in_group) // group_size_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, tl.num_programs(1))
    kt_start = pid_k * tiles_per_split
    kt_end = min(kt_start + tiles_per_split, k_tiles)
    return pid_n, pid_m, kt_start, kt_end


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, c_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_xk,
    stride_qn, stride_qk,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_cm, stride_cn,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, ATOMIC_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    W_IS_A: tl.constexpr, W_GATHER: tl.constexpr = False,
):
    """``c[M, N] (+)= x[M, K] @ dequant(qw[N, K*BITS/32])^T`` over this program's K slice.

    Grid: (output tiles, K splits). With ATOMIC_OUT the partial sums are atomically added into a
    zeroed float32 ``c``; otherwise ``c`` (x's dtype) is written once. W_IS_A computes the tile
    as ``W X^T`` (weights from registers as wgmma's A), else as ``X W^T`` (weights as B).
    W_GATHER (with W_IS_A False) builds the ``[BLOCK_K, BLOCK_N]`` weight tile from redundant word
    loads (index ``k // PER_WORD``, served by L1) and a per-row shift: no 3-D unpack, no reshape.
    """
    DTYPE = x_ptr.dtype.element_ty
    PER_WORD: tl.constexpr = 32 // BITS
    pid_n, pid_m, kt_start, kt_end = _tile_and_k_slice(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // PER_WORD)
    mask_n = offs_n < N
    mask_m = offs_m < M

    if W_IS_A:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        k0 = kt * BLOCK_K
        rows_k = k0 + offs_k
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + rows_k[:, None] * stride_xk
        xt = tl.load(x_ptrs, mask=mask_m[None, :] & (rows_k[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_M]

        if GROUP_SIZE % BLOCK_K == 0:
            # The whole K tile lies in one group: one scale (and zero) row per tile.
            g = k0 // GROUP_SIZE
            s_ptrs = scales_ptr + g * stride_sg + offs_n[:, None] * stride_sn
            z_ptrs = zeros_ptr + g * stride_zg + offs_n[:, None] * stride_zn
            g_mask = mask_n[:, None]
        else:
            # Several groups per tile (e.g. g32 with BLOCK_K 128): per-row gather, served from L1.
            g = rows_k // GROUP_SIZE
            s_ptrs = scales_ptr + g[None, :] * stride_sg + offs_n[:, None] * stride_sn
            z_ptrs = zeros_ptr + g[None, :] * stride_zg + offs_n[:, None] * stride_zn
            g_mask = mask_n[:, None] & (rows_k[None, :] < K)
        scale = tl.load(s_ptrs, mask=g_mask, other=0.0).to(DTYPE)
        if HAS_ZEROS:
            zero = tl.load(z_ptrs, mask=g_mask, other=0).to(tl.int32)
        else:
            zero = tl.full([1, 1], 1 << (BITS - 1), tl.int32)
        if MAGIC != 0:
            zero = (zero + MAGIC_VALUE).to(DTYPE)  # exact: small integers
        if W_GATHER:
            # [BLOCK_K, BLOCK_N]: every K row re-reads its word (same address for PER_WORD rows).
            wg_ptrs = qw_ptr + offs_n[None, :] * stride_qn + (rows_k // PER_WORD)[:, None] * stride_qk
            words_kn = tl.load(wg_ptrs, mask=mask_n[None, :] & (rows_k[:, None] < K), other=0)
            codes = (words_kn >> ((rows_k % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)
            w_kn = _codes_to_float(codes, tl.trans(zero), MAGIC, DTYPE) * tl.trans(scale)
            acc = tl.dot(tl.trans(xt), w_kn, acc)
        else:
            # K is a multiple of PER_WORD, so word-level masking is exact at the K tail.
            rows_w = k0 // PER_WORD + offs_kw
            w_ptrs = qw_ptr + offs_n[:, None] * stride_qn + rows_w[None, :] * stride_qk
            words = tl.load(w_ptrs, mask=mask_n[:, None] & (rows_w[None, :] < K // PER_WORD), other=0)
            w = _dequant_tile(words, scale, zero, BITS, MAGIC, MAGIC_VALUE, BLOCK_N, BLOCK_K, DTYPE)
            if W_IS_A:
                acc = tl.dot(w, xt, acc)
            else:
                acc = tl.dot(tl.trans(xt), tl.trans(w), acc)

    if W_IS_A:
        c_ptrs = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn
        c_mask = mask_n[:, None] & mask_m[None, :]
    else:
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        c_mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC_OUT:
        tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _gemv_tile(acc, x_ptr, qw_ptr, scales_ptr, zeros_ptr, kt, offs_m, mask_m, offs_n, mask_n,
               M, K, K_WORDS, stride_xm, stride_qn, stride_sg, stride_zg,
               GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOP3_ASM: tl.constexpr):
    """One K tile of the GEMV: ``acc[m, n] += sum_g s[g, n] * sum_{k in g} (q[n, k] - z[g, n]) * x[m, k]``.

    The tile may span several groups (BLOCK_K a multiple of GROUP_SIZE) or lie inside one (BLOCK_K
    divides GROUP_SIZE). It is loaded 4-D, ``[BLOCK_N, NG, GW, 1]`` (NG groups of GW words): the
    per-group partial sums are then a plain reduction over the last two axes, with no reshape.
    """
    PER_WORD: tl.constexpr = 32 // BITS
    NG: tl.constexpr = BLOCK_K // GROUP_SIZE if BLOCK_K > GROUP_SIZE else 1  # groups in the tile
    GW: tl.constexpr = BLOCK_K // PER_WORD // NG  # words per group (or per tile when NG = 1)
    k0 = kt * BLOCK_K
    offs_g = tl.arange(0, NG)
    # Packed words, K-contiguous per output row: 16-byte vector loads. The load's coalesced layout
    # (4 words = 16 bytes per thread) also holds the PER_WORD codes of each word in that thread.
    rows_w = k0 // PER_WORD + offs_g[:, None] * GW + tl.arange(0, GW)[None, :]  # [NG, GW]
    words = tl.load(qw_ptr + offs_n[:, None, None, None] * stride_qn + rows_w[None, :, :, None],
                    mask=mask_n[:, None, None, None] & (rows_w[None, :, :, None] < K_WORDS), other=0)
    # Unpack without moving codes to bit 0: code j (j = HALF*h + i) sits at bit 16*h + BITS*i and is
    # masked in place after one 16-bit shift per word: ((w >> 16h) & (MASK << BITS*i)) | MAGIC is one
    # LOP3 per code and reads as the float 2**23 + code * 2**(BITS*i), exactly (fields < 2**16).
    # Subtracting 2**23 + zero * 2**(BITS*i) gives (code - zero) * 2**(BITS*i) exactly; the x values
    # carry the 2**-(BITS*i) instead (exact, and x is shared by all the rows a thread holds).
    HALF: tl.constexpr = PER_WORD // 2
    jj = tl.arange(0, PER_WORD)
    hi = ((jj // HALF) * 16).to(tl.uint32)
    lo = (jj % HALF) * BITS
    shifted = words.to(tl.uint32, bitcast=True) >> hi[None, None, None, :]  # [BLOCK_N, NG, GW, PER_WORD]
    field_mask = (((1 << BITS) - 1) << lo).to(tl.uint32)[None, None, None, :]
    # One scale / zero per (row, group of the tile); groups past K (partial last tile) are masked.
    g = k0 // GROUP_SIZE + offs_g
    g_mask = mask_n[:, None] & ((k0 + offs_g * GROUP_SIZE) < K)[None, :]
    scale = tl.load(scales_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=g_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + g[None, :] * stride_zg + offs_n[:, None], mask=g_mask, other=0).to(tl.int32)
    else:
        zero = tl.full([BLOCK_N, NG], 1 << (BITS - 1), tl.int32)
    zero_j = zero[:, :, None, None] << lo[None, None, None, :]  # zero * 2**(BITS*i) < 2**16
    if MAGIC != 0:
        # The fp32 exponent trick: no int->float conversion per code.
        if LOP3_ASM:
            # (shifted & mask) | MAGIC as one lop3 (ptxas emits two LOP3s for the two immediates).
            bits = tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                [shifted, tl.broadcast_to(field_mask, shifted.shape),
                 tl.full(shifted.shape, MAGIC, tl.uint32)],
                dtype=tl.uint32, is_pure=True, pack=1)
        else:
            bits = (shifted & field_mask) | MAGIC
        q = bits.to(tl.float32, bitcast=True) - (zero_j + 8388608).to(tl.float32)
    else:
        q = ((shifted & field_mask).to(tl.int32, bitcast=True) - zero_j).to(tl.float32)
    unit = tl.exp2((-lo).to(tl.float32))  # 2**-(BITS*i), exact
    # x rows as [NG, GW, PER_WORD] (16-byte loads); one row at a time keeps the tile 4-D.
    rows_k = (k0 + (offs_g[:, None, None] * GW + tl.arange(0, GW)[None, :, None]) * PER_WORD
              + jj[None, None, :])
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for m in tl.static_range(BLOCK_M):
        x = tl.load(x_ptr + m * stride_xm + rows_k, mask=(rows_k < K) & (m < M), other=0.0).to(tl.float32)
        x = x * unit[None, None, :]
        # Integer-code dot products per (row, group) in fp32, then one scale per group.
        pg = tl.sum(tl.sum(q * x[None, :, :, :], axis=3), axis=2)  # [BLOCK_N, NG]
        p = tl.sum(pg * scale, axis=1)  # [BLOCK_N]
        part = tl.where(offs_m[:, None] == m, p[None, :], part)
    return acc + part


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, c_ptr,
    M, N, K, K_WORDS, M_BUCKET,
    stride_xm, stride_qn, stride_sg, stride_zg, stride_cm,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr,
    PROGS_PER_SM: tl.constexpr = 8, LOP3_ASM: tl.constexpr = False, DIRECT: tl.constexpr = False,
):
    """Decode GEMV, no tensor cores: ``c[M, N] += x[M, K] @ dequant(qw[N, K*BITS/32])^T`` over a K slice.

    Grid: (N tiles, K splits). Every program owns BLOCK_N output rows of W and all (<= BLOCK_M) rows
    of x, streams its K slice of packed words once and adds its float32 partial sums atomically into
    a zeroed ``c``; with DIRECT (one K split) it stores its rows into ``c`` in c's dtype instead. x must
    be K-contiguous (the launcher makes it so). PROGS_PER_SM is read by the launcher's grid only (the K
    split), a tuning knob of the config. LOP3_ASM (GPU only, not the interpreter) builds each code's
    float bits with one inline ``lop3``.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, tl.num_programs(1))
    kt_start = pid_k * tiles_per_split
    kt_end = min(kt_start + tiles_per_split, k_tiles)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PIPE > 1:
        # Software-pipelined loads (a dot-less loop is pipelined only when asked explicitly).
        for kt in tl.range(kt_start, kt_end, num_stages=PIPE):
            acc = _gemv_tile(acc, x_ptr, qw_ptr, scales_ptr, zeros_ptr, kt, offs_m, mask_m, offs_n, mask_n,
                             M, K, K_WORDS, stride_xm, stride_qn, stride_sg, stride_zg,
                             GROUP_SIZE, BITS, HAS_ZEROS, MAGIC, BLOCK_M, BLOCK_N, BLOCK_K, LOP3_ASM)
    else:
        for kt in range(kt_start, kt_end):
            acc = _gemv_tile(acc, x_ptr, qw_ptr, scales_ptr, zeros_ptr, kt, offs_m, mask_m, offs_n, mask_n,
                             M, K, K_WORDS, stride_xm, stride_qn, stride_sg, stride_zg,
                             GROUP_SIZE, BITS, HAS_ZEROS, MAGIC, BLOCK_M, BLOCK_N, BLOCK_K, LOP3_ASM)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    if DIRECT:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    else:
        tl.atomic_add(c_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :], sem="relaxed")


@triton.jit
def _nibble_pairs(words, zero_bias, scale, j: tl.constexpr, MAGIC2: tl.constexpr, PAIR_ASM: tl.constexpr,
                  BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """Words ``[BLOCK_N, KW]`` -> dequantized codes ``j`` and ``j + 4`` of each word, ``[BLOCK_N, 2 * KW]``.

    ``(w >> 4j) & 0x000F000F | MAGIC2`` is a pair of 16-bit floats ``MAGIC_VALUE + code`` (exact), the
    two elements of one tensor-core operand register; ``zero_bias`` holds ``MAGIC_VALUE + zero``, so
    one packed subtraction gives ``code - zero`` exactly and one packed multiply applies the scale.
    With PAIR_ASM (GPU) that is one lop3, one sub.x2 and one mul.x2 per two codes, in place.
    """
    dtype = zero_bias.dtype
    shifted = words >> (4 * j)
    zb = tl.broadcast_to(zero_bias, [BLOCK_N, 2 * KW])
    sc = tl.broadcast_to(scale, [BLOCK_N, 2 * KW])
    if PAIR_ASM:
        # Both 32-bit copies of the word reach the asm as $1, $2 (pack=2); the 16-bit operands arrive
        # packed in pairs ($3, $4) and the result leaves as one register of two halves ($0).
        both = tl.reshape(tl.join(shifted, shifted), [BLOCK_N, 2 * KW])
        if dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; "
                "sub.bf16x2 t, t, $3; mul.bf16x2 $0, t, $4; }",
                "=r,r,r,r,r", [both, zb, sc], dtype=dtype, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; "
                "sub.f16x2 t, t, $3; mul.f16x2 $0, t, $4; }",
                "=r,r,r,r,r", [both, zb, sc], dtype=dtype, is_pure=True, pack=2)
    else:
        pair = (shifted & 0x000F000F) | MAGIC2
        lo = pair.to(tl.int16).to(dtype, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(dtype, bitcast=True)
        return (tl.reshape(tl.join(lo, hi), [BLOCK_N, 2 * KW]) - zb) * sc


@triton.jit
def _w4a16_pairs_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, c_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_qn, stride_sg, stride_zg, stride_cm,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC_VALUE: tl.constexpr, ATOMIC_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, KW: tl.constexpr, GROUP_N: tl.constexpr,
    PAIR_ASM: tl.constexpr = False, PROGS_PER_SM: tl.constexpr = 4,
):
    """Paired-nibble tensor-core kernel (4-bit): ``c[M, N] (+)= x[M, K] @ dequant(qw)^T`` over a K slice.

    ``x`` arrives with its columns in :func:`paired_nibble_index` order, so each K tile of 8*KW codes is
    four dots of width 2*KW whose weight operand comes out of the packed words already paired: no
    reshape, no layout change, ~2 instructions per code (``_nibble_pairs``). The weight tile is
    wgmma's A operand from registers, the activation tile B from shared memory, so BLOCK_M may be 16.
    (Staging the weights in shared memory as B instead never won an autotune in run 6: NOTES_w4a16.md.)
    Grid: (output tiles in grouped order, K splits); ATOMIC_OUT adds float32 partial sums into a
    zeroed ``c``, otherwise ``c`` is written once. PROGS_PER_SM is read by the launcher's grid only.
    """
    DTYPE = x_ptr.dtype.element_ty
    BLOCK_K: tl.constexpr = 8 * KW
    MAGIC2: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
    # Groups cover whole tiles (one scale per row and tile) or several groups share a tile (per word).
    TILE_GROUP: tl.constexpr = GROUP_SIZE % BLOCK_K == 0
    # K is a multiple of BLOCK_K here.
    pid_n, pid_m, kt_start, kt_end = _tile_and_k_slice(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, KW)
    offs_d = tl.arange(0, 2 * KW)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        rows_w = kt * KW + offs_w
        words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + rows_w[None, :], mask=mask_n[:, None], other=0)
        if TILE_GROUP:
            g = (kt * BLOCK_K) // GROUP_SIZE
            scale = tl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(DTYPE)[:, None]
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + g * stride_zg + offs_n, mask=mask_n, other=0).to(tl.int32)[:, None]
            else:
                zero = tl.full([BLOCK_N, 1], 8, tl.int32)
        else:
            # Word w holds original columns 8w..8w+7, all in group (kt*BLOCK_K + 8w) // GROUP_SIZE; both
            # codes of a pair come from one word, so the per-word scale is joined with itself.
            g = (kt * BLOCK_K + 8 * offs_w) // GROUP_SIZE
            sw = tl.load(scales_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=mask_n[:, None], other=0.0)
            scale = tl.reshape(tl.join(sw, sw), [BLOCK_N, 2 * KW]).to(DTYPE)
            if HAS_ZEROS:
                zw = tl.load(zeros_ptr + g[None, :] * stride_zg + offs_n[:, None], mask=mask_n[:, None], other=0)
                zero = tl.reshape(tl.join(zw, zw), [BLOCK_N, 2 * KW]).to(tl.int32)
            else:
                zero = tl.full([BLOCK_N, 1], 8, tl.int32)
        zero_bias = (zero + MAGIC_VALUE).to(DTYPE)  # exact: small integers
        for j in tl.static_range(4):
            w = _nibble_pairs(words, zero_bias, scale, j, MAGIC2, PAIR_ASM, BLOCK_N, KW)
            cols = kt * BLOCK_K + j * 2 * KW + offs_d
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + cols[:, None], mask=mask_m[None, :], other=0.0)
            acc = tl.dot(w, xt, acc)
    c_ptrs = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None]
    c_mask = mask_n[:, None] & mask_m[None, :]
    if ATOMIC_OUT:
        tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _bench_quick(kernel_call, quantiles):
    """Autotune timing, in ms (one value per quantile): GPU time from CUDA-graph replays with L2
    evicted (:func:`gpu_timing.gpu_time_us`), as the Gluon tuner times its configs.

    Eager timing (``do_bench``) measures the host when the kernel is shorter than its launch: on the
    device machine a Triton launch costs ~100 us of Python against 5-20 us of GPU time for the GEMV,
    so every config timed alike and the pick was arbitrary (H200 run 17: a 30.6 us GEMV config on
    4096 x 14336, where 17-18 us is usual). Eager timing stays as the fallback if a capture fails."""
    try:
        ms = gpu_time_us(kernel_call) / 1e3
    except RuntimeError:
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)
    return [ms] * len(quantiles) if quantiles else ms


_decode_tuned = triton.autotune(
    configs=DECODE_CONFIGS, key=["M_BUCKET", "N", "K"], reset_to_zero=["c_ptr"], do_bench=_bench_quick
)(_w4a16_kernel)
_prefill_tuned = triton.autotune(configs=PREFILL_CONFIGS, key=["M_BUCKET", "N", "K"], do_bench=_bench_quick)(
    _w4a16_kernel
)


def _pairs_prune(configs, named_args, **kwargs):
    """Keep the activation tiles that fit M: 16 up to M = 16, then the two powers of two around M."""
    bucket = named_args["M_BUCKET"]
    target = min(max(bucket, 16), 256)
    ok = [c for c in configs if c.kwargs["BLOCK_M"] in (target, max(16, target // 2))]
    return ok or configs[:1]


_pairs_tuned = triton.autotune(
    configs=PAIRS_CONFIGS, key=["M_BUCKET", "N", "K", "GROUP_SIZE", "HAS_ZEROS"], reset_to_zero=["c_ptr"],
    prune_configs_by=dict(early_config_prune=_pairs_prune), do_bench=_bench_quick,
)(_w4a16_pairs_kernel)


def _gemv_block_k_ok(block_k: int, group_size: int) -> bool:
    """The GEMV tile lies inside one group or covers whole groups."""
    return group_size % block_k == 0 or block_k % group_size == 0


def _gemv_config_ok(meta: dict, block_m: int, group_size: int) -> bool:
    codes = meta["BLOCK_N"] * meta["BLOCK_K"] // (32 * meta.get("num_warps", 4))  # per thread per tile
    # With several x rows the dequantized tile stays live across the row loop (one register per code):
    # over 128 codes per thread it spills (sm_90 compile: 256 codes at BLOCK_M 2 -> 184 B of stack).
    max_codes = _GEMV_MAX_CODES_PER_THREAD if block_m == 1 else _GEMV_MAX_CODES_PER_THREAD // 2
    return (_gemv_block_k_ok(meta["BLOCK_K"], group_size) and codes <= max_codes
            and block_m * codes <= _GEMV_MAX_PRODUCTS_PER_THREAD)


def _gemv_prune(configs, named_args, **kwargs):
    ok = [c for c in configs
          if _gemv_config_ok(c.all_kwargs(), kwargs["BLOCK_M"], kwargs["GROUP_SIZE"])]
    if ok:
        return ok
    # Odd group sizes: keep the configs whose BLOCK_K fits the group.
    return [c for c in configs if _gemv_block_k_ok(c.kwargs["BLOCK_K"], kwargs["GROUP_SIZE"])] or configs[-1:]


def _gemv_autotuned(configs, **kwargs):
    """The GEMV kernel autotuned over ``configs``, one cache per (M bucket, N, K, group, zeros)."""
    return triton.autotune(configs=configs, key=["M_BUCKET", "N", "K", "GROUP_SIZE", "HAS_ZEROS"],
                           prune_configs_by=dict(early_config_prune=_gemv_prune), do_bench=_bench_quick,
                           **kwargs)(_w4a16_gemv_kernel)


_gemv_tuned = _gemv_autotuned(GEMV_CONFIGS, reset_to_zero=["c_ptr"])  # split K: atomics into a zeroed c
_gemv_direct_tuned = _gemv_autotuned(GEMV_DIRECT_CONFIGS)  # direct: every program stores its own rows


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _decode_split_k(n_tiles: int, k_tiles: int, num_sms: int) -> int:
    """Split K so the grid has about _DECODE_PROGRAMS_PER_SM programs per SM, at least 2 K tiles each."""
    want = max(1, (_DECODE_PROGRAMS_PER_SM * num_sms) // max(n_tiles, 1))
    return max(1, min(want, k_tiles // 2 if k_tiles >= 2 else 1))


def _gemv_split_k(n_tiles: int, k_tiles: int, num_sms: int, progs_per_sm: int = _GEMV_PROGRAMS_PER_SM) -> int:
    """Split K so the GEMV grid has about ``progs_per_sm`` programs per SM, every K slice non-empty."""
    want = max(1, min(round(progs_per_sm * num_sms / max(n_tiles, 1)), k_tiles))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, want))


def _gemv_matmul(x, w, config, magic, direct: bool | None = None):
    """The GEMV path: split K with float32 atomics into a zeroed buffer and one cast at the end, or with
    ``direct`` (default: layers of at most GEMV_DIRECT_MAX_WEIGHTS; a config with ``SPLIT_K=1``) one
    program per row block storing the result itself: a single launch."""
    m, k = x.shape
    n = w.out_features
    x = x.contiguous()
    if direct is None:
        direct = config.get("SPLIT_K") == 1 if config is not None else n * k <= GEMV_DIRECT_MAX_WEIGHTS
    if direct:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    num_sms = device_info.num_sms(x.device)
    block_m = max(1, triton.next_power_of_2(m))

    def grid(meta):
        if direct:
            return (triton.cdiv(n, meta["BLOCK_N"]), 1)
        split = meta.get("SPLIT_K") or _gemv_split_k(
            triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"]), num_sms,
            meta.get("PROGS_PER_SM", _GEMV_PROGRAMS_PER_SM))
        return (triton.cdiv(n, meta["BLOCK_N"]), split)

    # K_WORDS (= K / PER_WORD) as its own argument: its divisibility by 16 lets the masked word
    # loads stay 16 bytes wide.
    args = (x, w.qweight, w.scales, zeros, out, m, n, k, w.qweight.shape[1], _m_bucket(m),
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0), out.stride(0))
    flags = dict(GROUP_SIZE=w.group_size, BITS=w.bits, HAS_ZEROS=w.zeros is not None,
                 MAGIC=0x4B000000 if magic else 0, BLOCK_M=block_m, LOP3_ASM=magic and not _interpreting(),
                 DIRECT=direct)
    configs = GEMV_DIRECT_CONFIGS if direct else GEMV_CONFIGS
    if config is None and _interpreting():
        ok = [c.all_kwargs() for c in configs if _gemv_config_ok(c.all_kwargs(), block_m, w.group_size)]
        config = ok[0] if ok else dict(BLOCK_N=32, BLOCK_K=min(32, w.group_size))
    if config is not None:
        meta = dict(PIPE=1, num_warps=4, num_stages=1) | config
        if not _gemv_block_k_ok(meta["BLOCK_K"], w.group_size):
            raise ValueError(f"GEMV BLOCK_K {meta['BLOCK_K']} must divide the group size {w.group_size} "
                             "or be a multiple of it")
        launch_grid = grid(meta)
        meta.pop("SPLIT_K", None)
        _w4a16_gemv_kernel[launch_grid](*args, **flags, **meta)
    else:
        (_gemv_direct_tuned if direct else _gemv_tuned)[grid](*args, **flags)
    return out if direct else out.to(x.dtype)


@triton.jit
def _gather_columns_kernel(x_ptr, index_ptr, out_ptr, zero_ptr, sums_ptr, M, K, n_zero, stride_xm,
                           BLOCK: tl.constexpr, SUM_TILE: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr):
    """``out[m, c] = x[m, index[c]]`` (out contiguous) and, in the same launch, ``zero_ptr[:n_zero] = 0``
    and, with SUM_TILE > 0, ``sums_ptr[m, t]`` = float32 sum of out[m, t*SUM_TILE : (t+1)*SUM_TILE].

    LAUNCH_DEPENDENTS: let a kernel launched after this one with programmatic dependent launch start
    now (it waits with ``griddepcontrol.wait`` before it reads what this one writes)."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
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
    ~7.5 us at every decode shape on the H200 (bench/profile_w4a16.py, run 12), as long as the GEMM on
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
    _gather_columns_kernel[grid](x, index, out, zero, tile_sums, m, k, zero.numel(), x.stride(0), BLOCK=block,
                                 SUM_TILE=sum_tile, LAUNCH_DEPENDENTS=x.is_cuda and not _interpreting())
    return out


def pairs_supported(w: W4A16Weights) -> bool:
    """Whether the paired-nibble kernel takes these weights (4-bit, K a multiple of PAIR_TILE_K)."""
    return w.pair_index is not None and w.bits == 4


def _pairs_matmul(x, w, config):
    """The paired-nibble path. ``x`` is in the caller's column order; it is gathered once here."""
    m, k = x.shape
    n = w.out_features
    num_sms = device_info.num_sms(x.device)
    # Split K (float32 atomics) for decode, and wherever 128 x 128 output tiles would not fill the SMs
    # (run 6: 8192x28672 at M = 256 ran 128 programs on 132 SMs, each over all of K: 0.42x cuBLAS).
    split = m <= PAIRS_SPLIT_MAX_M or triton.cdiv(n, 128) * triton.cdiv(m, 128) < num_sms
    out = torch.empty((m, n), device=x.device, dtype=torch.float32 if split else x.dtype)
    xp = gather_columns(x, w.pair_index, out if split else None)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    k_tiles = k // PAIR_TILE_K

    def grid(meta):
        n_tiles = triton.cdiv(n, meta["BLOCK_N"])
        out_tiles = n_tiles * triton.cdiv(m, meta["BLOCK_M"])
        if not split:
            return (out_tiles, 1)
        s = meta.get("SPLIT_K") or _gemv_split_k(out_tiles, k_tiles, num_sms, meta.get("PROGS_PER_SM", 4))
        return (out_tiles, s)

    args = (xp, w.qweight, w.scales, zeros, out, m, n, k, _m_bucket(m),
            xp.stride(0), w.qweight.stride(0), w.scales.stride(0), zeros.stride(0), out.stride(0))
    flags = dict(GROUP_SIZE=w.group_size, HAS_ZEROS=w.zeros is not None,
                 MAGIC_VALUE=128.0 if x.dtype == torch.bfloat16 else 1024.0, ATOMIC_OUT=split,
                 KW=PAIR_TILE_K // 8, PAIR_ASM=not _interpreting())
    if config is None and _interpreting():
        config = dict(BLOCK_N=32, BLOCK_M=16)
    if config is not None:
        meta = dict(GROUP_N=8, num_warps=4, num_stages=3) | config
        launch_grid = grid(meta)
        meta.pop("SPLIT_K", None)
        meta.pop("PROGS_PER_SM", None)
        _w4a16_pairs_kernel[launch_grid](*args, **flags, **meta)
    else:
        _pairs_tuned[grid](*args, **flags)
    return out.to(x.dtype) if split else out


def gluon_available(x: torch.Tensor, w: W4A16Weights) -> bool:
    """Whether the Gluon kernel (:mod:`quantkit.kernels.w4a16_gluon`, Hopper only) takes this call."""
    if _interpreting() or not x.is_cuda or not pairs_supported(w):
        return False
    from quantkit.kernels.w4a16_gluon import gluon_supported

    return gluon_supported(x, w)


def choose_path(m: int, w: W4A16Weights, gluon: bool = False) -> str:
    """The kernel :func:`w4a16_matmul` runs for ``m`` activation rows by default (``gluon``: the Gluon
    kernel can run here, see :func:`gluon_available`)."""
    pairs = pairs_supported(w)
    weights = w.in_features * w.out_features
    if gluon:
        direct = w.partial_sums is not None  # the direct Gluon kernel takes this layer
        return "gemv" if m == 1 and weights < (GLUON_DIRECT_M1_MIN_WEIGHTS if direct else GLUON_M1_MIN_WEIGHTS) \
            else "gluon"
    if m == 1 or (m <= GEMV_MAX_M and (not pairs or weights < GEMV_M2_MAX_WEIGHTS)):
        return "gemv"
    return "pairs" if pairs else "tc"


def _check_inputs(x: torch.Tensor, w: W4A16Weights) -> None:
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if w.group_size is None:
        raise ValueError("the kernel needs contiguous groups of one length; use w4a16_matmul_ref")
    if not (x.is_cuda or _interpreting()):
        raise ValueError("the Triton kernel needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if x.device != w.qweight.device:
        raise ValueError(f"x on {x.device}, weights on {w.qweight.device}")


def w4a16_matmul(x: torch.Tensor, w: W4A16Weights, config: dict | None = None,
                 fast_dequant: bool = True, path: str | None = None) -> torch.Tensor:
    """``x [M, K]`` fp16/bf16 -> ``x @ W^T`` ``[M, N]`` through the Triton kernel.

    ``path``: ``"gemv"`` (no tensor cores), ``"gluon"`` (the Gluon kernel: Hopper, the paired layout),
    ``"pairs"`` (the paired-nibble tensor-core kernel, 4-bit with K a multiple of
    PAIR_TILE_K), ``"tc"`` (the first tensor-core kernel: split-K for
    M <= DECODE_MAX_M, direct store above) or None (:func:`choose_path`: by M and what the weights allow).
    ``config`` bypasses the autotuner (tests, the interpreter): for "tc" ``BLOCK_N, BLOCK_M,
    BLOCK_K`` (optional ``SPLIT_K, GROUP_N, W_IS_A, W_GATHER, num_warps, num_stages``), for "gemv"
    ``BLOCK_N, BLOCK_K`` (optional ``SPLIT_K, PIPE, num_warps``), for "pairs" ``BLOCK_N, BLOCK_M``
    (optional ``SPLIT_K, GROUP_N, num_warps, num_stages``), for "gluon" the fields of
    ``w4a16_gluon.GluonConfig``. ``fast_dequant=False`` makes the GEMV and
    the first tensor-core kernel use int->float conversions instead of the exponent trick (kept for
    comparison); the paired kernel has only its packed form.
    """
    _check_inputs(x, w)
    if path is None:
        path = choose_path(x.shape[0], w, gluon_available(x, w))
    if path == "gluon":
        from quantkit.kernels.w4a16_gluon import GluonConfig, w4a16_gluon_matmul

        return w4a16_gluon_matmul(x, w, GluonConfig(**config) if config is not None else None)
    if path == "pairs":
        if not pairs_supported(w):
            raise ValueError(f"the paired-nibble kernel needs 4-bit codes and K a multiple of {PAIR_TILE_K}, "
                             f"got {w.bits}-bit, K = {w.in_features}")
        return _pairs_matmul(x, w, config)
    if w.perm is not None:
        x = x[:, w.perm]
    m, k = x.shape
    n = w.out_features
    if path == "gemv":
        if m > 64:
            raise ValueError(f"the GEMV path takes at most 64 rows, got {m}")
        return _gemv_matmul(x, w, config, fast_dequant)
    if path != "tc":
        raise ValueError(f"path must be 'gemv', 'gluon', 'tc', 'pairs' or None, got {path!r}")
    decode = m <= DECODE_MAX_M
    # The exponent trick needs MAGIC_VALUE + code exact: 8-bit codes overflow bf16's mantissa.
    use_magic = fast_dequant and (w.bits == 4 or x.dtype == torch.float16)
    magic, magic_value = 0, 0.0
    if use_magic:
        magic, magic_value = (0x4300, 128.0) if x.dtype == torch.bfloat16 else (0x6400, 1024.0)
    out = torch.zeros((m, n), device=x.device, dtype=torch.float32) if decode else torch.empty(
        (m, n), device=x.device, dtype=x.dtype)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    num_sms = device_info.num_sms(x.device)

    def grid(meta):
        out_tiles = triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"])
        if not decode:
            return (out_tiles, 1)  # a 16-bit output cannot take partial sums
        split = meta.get("SPLIT_K") or _decode_split_k(
            triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"]), num_sms)
        return (out_tiles, split)

    args = (x, w.qweight, w.scales, zeros, out, m, n, k, _m_bucket(m),
            x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1),
            w.scales.stride(0), w.scales.stride(1), zeros.stride(0), zeros.stride(1),
            out.stride(0), out.stride(1))
    flags = dict(GROUP_SIZE=w.group_size, BITS=w.bits, HAS_ZEROS=w.zeros is not None,
                 MAGIC=magic, MAGIC_VALUE=magic_value, ATOMIC_OUT=decode)
    if config is None and _interpreting():
        config = (DECODE_CONFIGS if decode else PREFILL_CONFIGS)[0].all_kwargs()
    if config is not None:
        meta = dict(GROUP_N=8, W_IS_A=True, W_GATHER=False, num_warps=4, num_stages=2) | config
        launch_grid = grid(meta)
        meta.pop("SPLIT_K", None)
        _w4a16_kernel[launch_grid](*args, **flags, **meta)
    else:
        (_decode_tuned if decode else _prefill_tuned)[grid](*args, **flags)
    return out.to(x.dtype) if decode else out
