"""The Triton W4A16 kernels (launched by :mod:`quantkit.kernels.w4a16`), and the column gather in front of the
paired-nibble kernels (Triton and Gluon).

``Y = X W^T``: 16-bit ``X [M, K]``, packed 4- or 8-bit ``W [N, K]`` (K contiguous per row, ``W4A16Weights``),
per-group scales, optional zero points; weights are unpacked and scaled in registers, never written back.

* ``_w4a16_gemv_kernel``: CUDA cores, one or two activation rows. 16-byte loads, exact ``code - zero`` in
  float32 by the exponent trick (one ``lop3`` per code), one scale per group; split K with float32 atomics,
  or (``DIRECT``) one program per row block over all of K.
* ``_w4a16_pairs_kernel``: tensor cores, 4-bit, K a multiple of 128, the paired-nibble trick of
  :mod:`quantkit.kernels.w4a16_gluon` (no reshape of the weight tile; activations gathered into
  ``W4A16Weights.pair_index`` order).
* ``_w4a16_kernel``: tensor cores, the general case (8-bit, K not a multiple of 128): a 3-D unpack and
  reshape, the tile as wgmma's A (``W X^T``, so BLOCK_M can be 16) or B operand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import interpreting, pdl_launch, programmatic_launch
from quantkit.kernels.w4a16_configs import PAIR_TILE_K


@triton.jit
def _unpack_codes(words, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed words ``[ROWS, BLOCK_K*BITS/32]`` -> int32 codes ``[ROWS, BLOCK_K]``. Code j of a word (bit
    BITS*j) is K index PER_WORD*word + j, so the reshape keeps a word's codes in the thread that loaded it."""
    PER_WORD: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PER_WORD) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [ROWS, BLOCK_K])


@triton.jit
def _codes_to_float(codes, zero, MAGIC: tl.constexpr, DTYPE: tl.constexpr):
    """Integer codes -> ``code - zero`` in DTYPE. With MAGIC, ``zero`` holds ``MAGIC_VALUE + zero``.

    MAGIC ORs the code into the mantissa of a float whose ulp is 1 (1024.0 in fp16, 128.0 in bf16, 2**23 in
    fp32): the bits read MAGIC_VALUE + code exactly, without an int->float conversion (a quarter of the FMA
    rate)."""
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
    """Packed words -> 16-bit weights ``[BLOCK_N, BLOCK_K]``; ``scale``/``zero`` ``[BLOCK_N, 1]`` or full tiles."""
    codes = _unpack_codes(words, BITS, BLOCK_N, BLOCK_K)
    return _codes_to_float(codes, zero, MAGIC, DTYPE) * scale


@triton.jit
def _tile_and_k_slice(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_N: tl.constexpr):
    """This program's output tile ``(pid_n, pid_m)`` and K tiles ``[kt_start, kt_end)``. Axis 0 in grouped
    order: GROUP_N weight tiles sweep all M tiles before the next GROUP_N (they stay in L2). Axis 1 splits K."""
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
    M, N, K,
    stride_xm, stride_xk,
    stride_qn, stride_qk,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_cm, stride_cn,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, ATOMIC_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    W_IS_A: tl.constexpr,
):
    """``c[M, N] (+)= x[M, K] @ dequant(qw[N, K*BITS/32])^T`` over this program's K slice. ATOMIC_OUT: add
    into a zeroed float32 ``c``; otherwise write ``c`` (x's dtype) once. W_IS_A: ``W X^T`` (weights as wgmma's
    A, from registers), else ``X W^T``."""
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
            g = k0 // GROUP_SIZE
            s_ptrs = scales_ptr + g * stride_sg + offs_n[:, None] * stride_sn
            z_ptrs = zeros_ptr + g * stride_zg + offs_n[:, None] * stride_zn
            g_mask = mask_n[:, None]
        else:
            # Several groups per tile: per-column gather, served from L1.
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

    The tile spans several groups or lies inside one. Loaded 4-D, ``[BLOCK_N, NG, GW, 1]`` (NG groups of GW
    words), the per-group sums are a plain reduction over the last two axes, with no reshape."""
    PER_WORD: tl.constexpr = 32 // BITS
    NG: tl.constexpr = BLOCK_K // GROUP_SIZE if BLOCK_K > GROUP_SIZE else 1  # groups in the tile
    GW: tl.constexpr = BLOCK_K // PER_WORD // NG  # words per group (or per tile when NG = 1)
    k0 = kt * BLOCK_K
    offs_g = tl.arange(0, NG)
    # 16-byte loads (4 words a thread); each word's codes stay in the thread that loaded it.
    rows_w = k0 // PER_WORD + offs_g[:, None] * GW + tl.arange(0, GW)[None, :]  # [NG, GW]
    words = tl.load(qw_ptr + offs_n[:, None, None, None] * stride_qn + rows_w[None, :, :, None],
                    mask=mask_n[:, None, None, None] & (rows_w[None, :, :, None] < K_WORDS), other=0)
    # Codes are not moved to bit 0: code j (j = HALF*h + i), at bit 16*h + BITS*i, is masked in place after one
    # 16-bit shift: ((w >> 16h) & (MASK << BITS*i)) | MAGIC, one LOP3, reads as the float 2**23 + code * 2**(BITS*i)
    # exactly (fields < 2**16). Subtracting 2**23 + zero * 2**(BITS*i) is exact; x carries the 2**-(BITS*i)
    # instead (exact, and x is shared by all the rows a thread holds).
    HALF: tl.constexpr = PER_WORD // 2
    jj = tl.arange(0, PER_WORD)
    hi = ((jj // HALF) * 16).to(tl.uint32)
    lo = (jj % HALF) * BITS
    shifted = words.to(tl.uint32, bitcast=True) >> hi[None, None, None, :]  # [BLOCK_N, NG, GW, PER_WORD]
    field_mask = (((1 << BITS) - 1) << lo).to(tl.uint32)[None, None, None, :]
    # groups past K (partial last tile) are masked
    g = k0 // GROUP_SIZE + offs_g
    g_mask = mask_n[:, None] & ((k0 + offs_g * GROUP_SIZE) < K)[None, :]
    scale = tl.load(scales_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=g_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + g[None, :] * stride_zg + offs_n[:, None], mask=g_mask, other=0).to(tl.int32)
    else:
        zero = tl.full([BLOCK_N, NG], 1 << (BITS - 1), tl.int32)
    zero_j = zero[:, :, None, None] << lo[None, None, None, :]  # zero * 2**(BITS*i) < 2**16
    if MAGIC != 0:
        if LOP3_ASM:
            # one lop3 (ptxas emits two for the two immediates)
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
        pg = tl.sum(tl.sum(q * x[None, :, :, :], axis=3), axis=2)  # [BLOCK_N, NG], then one scale per group
        p = tl.sum(pg * scale, axis=1)  # [BLOCK_N]
        part = tl.where(offs_m[:, None] == m, p[None, :], part)
    return acc + part


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, c_ptr,
    M, N, K, K_WORDS,
    stride_xm, stride_qn, stride_sg, stride_zg, stride_cm,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr,
    LOP3_ASM: tl.constexpr = False, DIRECT: tl.constexpr = False,
):
    """Decode GEMV, no tensor cores: ``c[M, N] += x[M, K] @ dequant(qw[N, K*BITS/32])^T`` over a K slice.

    Grid: (N tiles, K splits). A program owns BLOCK_N rows of W and all (<= BLOCK_M) rows of x (K-contiguous)
    and adds float32 partial sums atomically into a zeroed ``c``; DIRECT (one split) stores in c's dtype.
    LOP3_ASM (GPU only) builds each code's float bits with one inline ``lop3``."""
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
        # a loop without a dot is software-pipelined only when asked
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
    ``zero_bias`` holds ``MAGIC_VALUE + zero``: subtracting it from ``MAGIC_VALUE + code`` is exact. PAIR_ASM
    (GPU): one lop3, one sub.x2 and one mul.x2 per two codes."""
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
    M, N, K,
    stride_xm, stride_qn, stride_sg, stride_zg, stride_cm,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC_VALUE: tl.constexpr, ATOMIC_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, KW: tl.constexpr, GROUP_N: tl.constexpr,
    PAIR_ASM: tl.constexpr = False,
):
    """Paired-nibble kernel (4-bit): ``c[M, N] (+)= x[M, K] @ dequant(qw)^T`` over a K slice.

    ``x`` columns in ``W4A16Weights.pair_index`` order: a K tile of 8*KW codes is four dots of width 2*KW.
    Weights are wgmma's A from registers, activations B from shared memory, so BLOCK_M may be 16. Grid and
    ATOMIC_OUT as :func:`_w4a16_kernel`."""
    DTYPE = x_ptr.dtype.element_ty
    BLOCK_K: tl.constexpr = 8 * KW
    MAGIC2: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
    TILE_GROUP: tl.constexpr = GROUP_SIZE % BLOCK_K == 0  # else one scale per word
    # K is a multiple of BLOCK_K here: no K masks
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


@triton.jit
def _gather_columns_kernel(x_ptr, index_ptr, out_ptr, zero_ptr, sums_ptr, M, K, n_zero, stride_xm,
                           BLOCK: tl.constexpr, SUM_TILE: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
                           WAIT_PREVIOUS: tl.constexpr):
    """``out[m, c] = x[m, index[c]]`` (contiguous), ``zero_ptr[:n_zero] = 0`` and, with SUM_TILE > 0,
    ``sums_ptr[m, t]`` = float32 sum of out[m, t*SUM_TILE : (t+1)*SUM_TILE].

    LAUNCH_DEPENDENTS: let the next kernel (programmatic dependent launch) start now; it waits with
    ``griddepcontrol.wait`` before reading. WAIT_PREVIOUS: this one is such a dependent itself."""
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


def _gather_columns(x: torch.Tensor, index: torch.Tensor, zero: torch.Tensor | None = None,
                    tile_sums: torch.Tensor | None = None) -> torch.Tensor:
    """``x[:, index]`` (contiguous); in the same launch, zeroes ``zero`` (contiguous float32 or int32, e.g.
    split-K partial sums) and fills ``tile_sums`` (contiguous float32 ``[M, K / PAIR_TILE_K]``) with the sum of
    each ``PAIR_TILE_K`` columns of the result (for kernels that subtract the zero point after the dot).
    One launch instead of ``torch.index_select`` plus a zeroing launch (bench/archive/NOTES_w4a16.md)."""
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
    # PDL on Hopper: in a decode step its launch overlaps the kernel before it
    pdl = programmatic_launch(x.device)
    _gather_columns_kernel[grid](x, index, out, zero, tile_sums, m, k, zero.numel(), x.stride(0), BLOCK=block,
                                 SUM_TILE=sum_tile, LAUNCH_DEPENDENTS=x.is_cuda and not interpreting(),
                                 WAIT_PREVIOUS=pdl, **pdl_launch(pdl))
    return out

