"""Experiment: an M = 1 W4A16 GEMV on the CUDA cores with packed 16-bit math (Gluon, sm_90).

Per packed word (8 codes of one row, columns 8w .. 8w + 7 in the GPTQ order): ``(w >> 4j) & 0x000F000F | MAGIC``
is the pair (MAGIC + code j, MAGIC + code j + 4) in one register (one shift and one lop3), one packed subtraction
of (MAGIC + zero) makes it exact (code - zero), and one packed FMA multiplies it by the activations (x_j, x_{j+4}),
which a ``prmt`` builds once per word from the caller's activations (shared by every row a thread holds). The four
pairs of a word accumulate in one 16-bit pair, then leave as one float32; the group's scale multiplies float32
sums. About 19 instructions per word, 2.4 per code, against ~4.5 for the float32 GEMV of ``w4a16.py``.

Partial sums of a K split meet in the layer's self-resetting workspace (``W4A16Weights.partial_sums``, as the
direct kernel's), so a call is one launch. bf16 and fp16; one group per 128-column K tile.

Outcome (H200 runs 51-52, ``ab_gemv_half2.py``; bench/NOTES_w4a16.md): correct (relative error 2.5-3.7e-3 in bf16,
whose pairs accumulate four products in bf16, against 1.6e-3 for the tensor-core kernels; 3-4e-4 in fp16), but no
faster: 53-57 us against 42-46 for the library's kernels on the 121 MB layers (~2.2 TB/s: like the direct kernel,
a warp's math waits for all of its loads, and two tiles a wait did not help), and within 0.3 us of them on the
8-30 MB ones. Not in the library; kept as the command behind those numbers.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from quantkit.kernels.device_info import num_sms
from quantkit.kernels.w4a16_gluon import _flush

_WORDS = gl.constexpr(16)


def _word_dot_asm(bf16: bool) -> str:
    magic = "0x43004300" if bf16 else "0x64006400"
    t = "bf16x2" if bf16 else "f16x2"
    # $0 out (f32 bits), $1 word, $2..$5 activation pairs j = 0..3, $6 (MAGIC + zero) pair
    lines = [
        "{ .reg .b32 q0, q1, q2, q3, s, lo, hi; .reg .f32 a, b;",
        f"lop3.b32 q0, $1, 0x000F000F, {magic}, 0xEA;",
        "shr.u32 s, $1, 4;", f"lop3.b32 q1, s, 0x000F000F, {magic}, 0xEA;",
        "shr.u32 s, $1, 8;", f"lop3.b32 q2, s, 0x000F000F, {magic}, 0xEA;",
        "shr.u32 s, $1, 12;", f"lop3.b32 q3, s, 0x000F000F, {magic}, 0xEA;",
        f"sub.{t} q0, q0, $6;", f"sub.{t} q1, q1, $6;", f"sub.{t} q2, q2, $6;", f"sub.{t} q3, q3, $6;",
    ]
    if bf16:
        # fma.rn.bf16x2 (sm_90); the pair's halves to float32 are a shift and a mask
        lines += ["mul.rn.bf16x2 q0, q0, $2;", "fma.rn.bf16x2 q0, q1, $3, q0;", "fma.rn.bf16x2 q0, q2, $4, q0;",
                  "fma.rn.bf16x2 q0, q3, $5, q0;", "shl.b32 lo, q0, 16;", "and.b32 hi, q0, 0xFFFF0000;",
                  "mov.b32 a, lo;", "mov.b32 b, hi;"]
    else:
        lines += ["mul.rn.f16x2 q0, q0, $2;", "fma.rn.f16x2 q0, q1, $3, q0;", "fma.rn.f16x2 q0, q2, $4, q0;",
                  "fma.rn.f16x2 q0, q3, $5, q0;", "{ .reg .f16 l, h; mov.b32 {l, h}, q0; cvt.f32.f16 a, l;",
                  "cvt.f32.f16 b, h; }"]
    lines += ["add.f32 a, a, b;", "mov.b32 $0, a; }"]
    return " ".join(lines)


_WORD_DOT_BF16 = gl.constexpr(_word_dot_asm(True))
_WORD_DOT_F16 = gl.constexpr(_word_dot_asm(False))


@gluon.jit
def _prmt(a, b, sel: gl.constexpr):
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _load_tile(w_ptrs, x_ptr, x_offs, scales_ptr, zeros_ptr, rows, row_ok, kt, ok, stride_sg, stride_zg,
               HAS_ZEROS: gl.constexpr):
    words = gl.load(w_ptrs + kt * _WORDS, mask=gl.expand_dims(row_ok & ok, 1), other=0)
    xr = gl.load(x_ptr + kt * 64 + x_offs, mask=ok, other=0)
    scale = gl.load(scales_ptr + kt * stride_sg + rows, mask=row_ok & ok, other=0.0)
    if HAS_ZEROS:
        z = gl.load(zeros_ptr + kt * stride_zg + rows, mask=row_ok & ok, other=0)
    else:
        z = scale
    return words, xr, scale, z


@gluon.jit
def _tile_dot(acc, words, xr, scale, z, HAS_ZEROS: gl.constexpr, BF16: gl.constexpr):
    WL: gl.constexpr = words.type.layout
    XP: gl.constexpr = gl.SliceLayout(0, WL)
    MAGIC_VALUE: gl.constexpr = 128.0 if BF16 else 1024.0
    dtype: gl.constexpr = gl.bfloat16 if BF16 else gl.float16
    if HAS_ZEROS:
        zf = z.to(gl.float32) + MAGIC_VALUE
    else:
        zf = gl.full(scale.shape, MAGIC_VALUE + 8.0, gl.float32, layout=scale.type.layout)
    zb1 = zf.to(dtype).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    zpair = gl.expand_dims(zb1 | (zb1 << 16), 1)
    # registers (x0 x1) (x2 x3) (x4 x5) (x6 x7) of each word -> pairs (x_j, x_j+4)
    even, odd = gl.split(gl.reshape(xr, [_WORDS, 2, 2]))
    r0, r2 = gl.split(even)
    r1, r3 = gl.split(odd)
    r0 = gl.convert_layout(r0, XP, assert_trivial=True)
    r1 = gl.convert_layout(r1, XP, assert_trivial=True)
    r2 = gl.convert_layout(r2, XP, assert_trivial=True)
    r3 = gl.convert_layout(r3, XP, assert_trivial=True)
    p0 = gl.expand_dims(_prmt(r0, r2, 0x5410), 0)
    p1 = gl.expand_dims(_prmt(r0, r2, 0x7632), 0)
    p2 = gl.expand_dims(_prmt(r1, r3, 0x5410), 0)
    p3 = gl.expand_dims(_prmt(r1, r3, 0x7632), 0)
    args = [words, p0, p1, p2, p3, zpair]  # broadcast to [BLOCK_N, 16] by the asm
    if BF16:
        part = gl.inline_asm_elementwise(_WORD_DOT_BF16, "=r,r,r,r,r,r,r", args, dtype=gl.int32, is_pure=True, pack=1)
    else:
        part = gl.inline_asm_elementwise(_WORD_DOT_F16, "=r,r,r,r,r,r,r", args, dtype=gl.int32, is_pure=True, pack=1)
    return acc + part.to(gl.float32, bitcast=True) * gl.expand_dims(scale.to(gl.float32), 1)


@gluon.jit
def _gemv_half2_kernel(w_ptr, x_ptr, scales_ptr, zeros_ptr, c_ptr, ws_ptr, counters_ptr, N, k_tiles, n_splits,
                       stride_wn, stride_sg, stride_zg,
                       HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr, BF16: gl.constexpr, UNROLL: gl.constexpr,
                       num_warps: gl.constexpr):
    """``c[1, N] = x[1, K] @ dequant(qw)^T``; program (tile, split) takes K tiles [split * k / n, (split + 1) * k / n).
    ``x_ptr``: the activations as int32 (pairs of 16-bit values), caller's column order."""
    L3: gl.constexpr = gl.BlockedLayout([1, 4, 4], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0])
    WL: gl.constexpr = gl.SliceLayout(2, L3)  # [BLOCK_N, 16] words: 4 contiguous a thread
    XL: gl.constexpr = gl.SliceLayout(0, L3)  # [16, 4] activation pairs: the thread's 4 words' 16, contiguous
    XP: gl.constexpr = gl.SliceLayout(0, WL)
    ROW: gl.constexpr = gl.SliceLayout(1, WL)

    tn = gl.program_id(0)
    split = gl.program_id(1)
    kt0 = (split * k_tiles) // n_splits
    kt1 = ((split + 1) * k_tiles) // n_splits
    rows = tn * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROW)
    row_ok = rows < N
    offs_w = gl.arange(0, _WORDS, layout=XP)
    w_ptrs = w_ptr + gl.expand_dims(rows * stride_wn, 1) + gl.expand_dims(offs_w, 0)
    x_offs = (gl.expand_dims(gl.arange(0, _WORDS, layout=gl.SliceLayout(1, XL)), 1) * 4
              + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, XL)), 0))
    acc = gl.zeros([BLOCK_N, _WORDS], gl.float32, layout=WL)
    if UNROLL == 2:
        # both tiles' loads issued before either's math: twice the bytes in flight per wait
        for kt in range(kt0, kt1, 2):
            ok = kt + 1 < kt1
            wa, xa, sa, za = _load_tile(w_ptrs, x_ptr, x_offs, scales_ptr, zeros_ptr, rows, row_ok, kt, True,
                                        stride_sg, stride_zg, HAS_ZEROS)
            wb, xb, sb, zb = _load_tile(w_ptrs, x_ptr, x_offs, scales_ptr, zeros_ptr, rows, row_ok, kt + 1, ok,
                                        stride_sg, stride_zg, HAS_ZEROS)
            acc = _tile_dot(acc, wa, xa, sa, za, HAS_ZEROS, BF16)
            acc = _tile_dot(acc, wb, xb, sb, zb, HAS_ZEROS, BF16)
    else:
        for kt in range(kt0, kt1):
            wa, xa, sa, za = _load_tile(w_ptrs, x_ptr, x_offs, scales_ptr, zeros_ptr, rows, row_ok, kt, True,
                                        stride_sg, stride_zg, HAS_ZEROS)
            acc = _tile_dot(acc, wa, xa, sa, za, HAS_ZEROS, BF16)
    total = gl.expand_dims(gl.sum(acc, axis=1), 1)  # [BLOCK_N, 1]
    _flush(total, c_ptr, ws_ptr, counters_ptr, tn, 0, 1, N, kt1 - kt0, k_tiles, BLOCK_N, 1, True, WL, True)


def gemv_half2(x: torch.Tensor, w, block_n: int = 128, num_warps: int = 4, progs_per_sm: int = 8,
               unroll: int = 1) -> torch.Tensor:
    """x [1, K] (bf16/fp16, caller's order) -> [1, N]; w: W4A16Weights with a workspace, no act-order."""
    assert x.shape[0] == 1 and w.partial_sums is not None and w.perm is None and w.group_size % 128 == 0
    k, n = w.in_features, w.out_features
    x = x.contiguous()
    k_tiles = k // 128
    tiles_n = triton.cdiv(n, block_n)
    n_splits = max(1, min(k_tiles, round(num_sms(x.device) * progs_per_sm / tiles_n)))
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    zeros = w.zeros if w.zeros is not None else w.scales
    _gemv_half2_kernel[(tiles_n, n_splits)](
        w.qweight, x.view(torch.int32), w.scales, zeros, out, w.partial_sums, w.tile_counters, n, k_tiles, n_splits,
        w.qweight.stride(0), w.scales.stride(0), zeros.stride(0) if w.zeros is not None else 0,
        HAS_ZEROS=w.zeros is not None, BLOCK_N=block_n, BF16=x.dtype == torch.bfloat16, UNROLL=unroll,
        num_warps=num_warps)
    return out
