"""The device helpers both Gluon W4A16 kernels share (:mod:`quantkit.kernels.w4a16_gluon_ring`, the TMA ring, and
:mod:`quantkit.kernels.w4a16_gluon_direct`, the direct-load decode kernel): the K-tile constants, the launch-order
and run helpers, the group parameters, the paired-nibble dequantization (``lop3`` magic pairs), the four mma.sync
dots of one unit, and the stream-K flush of a tile. The design is in :mod:`quantkit.kernels.w4a16_gluon`'s
docstring. The underscore names are private to these modules: each kernel module imports the helpers its jit
functions call (Gluon resolves a jit function's globals in the module that defines it).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from quantkit.kernels.w4a16_configs import _DOT_K, _WORDS, PAIR_TILE_K

# One K tile of the packed weights: 16 int32 words (128 codes) per output row, read as four dots of K = 32.
_WORDS = gl.constexpr(_WORDS)
_DOT_K = gl.constexpr(_DOT_K)
_TILE_K = gl.constexpr(PAIR_TILE_K)


@gluon.jit
def _wait_for_previous_grid():
    """``griddepcontrol.wait``: under programmatic dependent launch, block until the kernel launched
    before this one has finished and its writes are visible; a no-op in an ordinary launch."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _even_run(pid, n_progs, n_units):
    """Program ``pid``'s contiguous run (first unit, count) of ``n_units`` over ``n_progs``; lengths differ by at
    most one (int64: pid * n_units can pass 2**31)."""
    u0 = ((pid.to(gl.int64) * n_units) // n_progs).to(gl.int32)
    count = (((pid.to(gl.int64) + 1) * n_units) // n_progs).to(gl.int32) - u0
    return u0, count


@gluon.jit
def _group_params(scales_ptr, zeros_ptr, tn, kt, N, stride_sg, stride_zg, offs_n, offs_w,
                  GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Scales (fp16) and zero points (int32) of tile ``tn``, K tile ``kt``: [BLOCK_N, 1] when the K tile lies
    in one group, else [BLOCK_N, 16], one per word (a word's 8 codes share a group)."""
    n = tn * BLOCK_N + offs_n
    k0 = kt * _TILE_K
    mask_n = n < N
    if GROUP_SIZE % _TILE_K == 0:
        g = k0 // GROUP_SIZE
        scale = gl.expand_dims(gl.load(scales_ptr + g * stride_sg + n, mask=mask_n, other=0.0), 1)
        if HAS_ZEROS:
            zero = gl.expand_dims(gl.load(zeros_ptr + g * stride_zg + n, mask=mask_n, other=0).to(gl.int32), 1)
        else:
            zero = gl.full_like(scale, 8, dtype=gl.int32)
    else:
        g = gl.expand_dims((k0 + 8 * offs_w) // GROUP_SIZE, 0)
        rows = gl.expand_dims(n, 1)
        mask = gl.expand_dims(mask_n, 1)
        scale = gl.load(scales_ptr + g * stride_sg + rows, mask=mask, other=0.0)
        if HAS_ZEROS:
            zero = gl.load(zeros_ptr + g * stride_zg + rows, mask=mask, other=0).to(gl.int32)
        else:
            zero = gl.full_like(scale, 8, dtype=gl.int32)
    return scale, zero


@gluon.jit
def _pairs_of(v, a_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """[BLOCK_N, 16 or 1] (one value per word) -> [BLOCK_N, 32] in the 16-bit A layout, each value twice
    (both codes of a pair); register renaming only."""
    v = gl.broadcast(v, gl.full([BLOCK_N, _WORDS], 0, v.dtype, layout=v.type.layout))[0]
    return gl.convert_layout(gl.reshape(gl.join(v, v), [BLOCK_N, 2 * _WORDS]), a_layout)


def _lop3(magic: int, dst: str) -> str:
    """PTX that masks codes j and j + 4 of the shifted word $1 and ORs in the magic exponent: ``dst`` is a pair
    of 16-bit floats ``MAGIC_VALUE + code``."""
    return f"lop3.b32 {dst}, $1, 0x000F000F, {magic:#010x}, 0xEA;"


def _pair_asm(magic: int, suffix: str) -> gl.constexpr:
    """PTX for one register of two codes: ``lop3``, a packed ``sub`` of the zero bias pair $3 and a packed
    ``mul`` by the scale pair $4."""
    return gl.constexpr(f"{{ .reg .b32 t; {_lop3(magic, 't')} sub.{suffix} t, t, $3; mul.{suffix} $0, t, $4; }}")


# MAGIC_VALUE + code as bf16 pairs (128.0 = 0x4300) or fp16 pairs (1024.0 = 0x6400)
_PAIR_ASM_BF16_SCALED = _pair_asm(0x43004300, "bf16x2")
_PAIR_ASM_F16_SCALED = _pair_asm(0x64006400, "f16x2")
# the lop3 alone: MAGIC_VALUE + code, the zero point left for the accumulator (see _magic_pairs)
_PAIR_ASM_BF16_RAW = gl.constexpr(_lop3(0x43004300, "$0"))
_PAIR_ASM_F16_RAW = gl.constexpr(_lop3(0x64006400, "$0"))


@gluon.jit
def _magic_pairs(words, j: gl.constexpr, dtype: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Codes j and j + 4 of every word as 16-bit floats ``MAGIC_VALUE + code``: the A operand [BLOCK_N, 32]
    of dot j, zero point and scale not applied.

    The caller subtracts ``(MAGIC_VALUE + zero) * sum(x)`` per row from the float32 dot: at M <= 16 two FMAs
    per accumulator element are 8-16x fewer than a packed subtraction per register. The cancellation costs
    ~5 of float32's 24 bits (bf16; ~8 for fp16), far below the 16-bit output's precision."""
    shifted = _pairs_of(words >> (4 * j), a_layout, BLOCK_N)
    if dtype == gl.bfloat16:
        pairs = gl.inline_asm_elementwise(_PAIR_ASM_BF16_RAW, "=r,r,r", [shifted], dtype=gl.bfloat16, is_pure=True,
                                          pack=2)
    else:
        pairs = gl.inline_asm_elementwise(_PAIR_ASM_F16_RAW, "=r,r,r", [shifted], dtype=gl.float16, is_pure=True,
                                          pack=2)
    return pairs


@gluon.jit
def _dequant_pairs(words, zero_bias, scale, j: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Codes j and j + 4 of every word, dequantized: the A operand [BLOCK_N, 32] of dot j. Subtracting
    ``MAGIC_VALUE + zero`` from ``MAGIC_VALUE + code`` is exact; then the packed multiply by the scale."""
    shifted = _pairs_of(words >> (4 * j), a_layout, BLOCK_N)
    if zero_bias.dtype == gl.bfloat16:
        asm: gl.constexpr = _PAIR_ASM_BF16_SCALED
    else:
        asm: gl.constexpr = _PAIR_ASM_F16_SCALED
    return gl.inline_asm_elementwise(asm, "=r,r,r,r,r", [shifted, zero_bias, scale], dtype=zero_bias.dtype,
                                     is_pure=True, pack=2)


@gluon.jit
def _flush(acc, c_ptr, ws_ptr, tile_units_ptr, tn, tm, M, N, seg_units, k_tiles, BLOCK_N: gl.constexpr,
           BLOCK_M: gl.constexpr, ATOMIC_OUT: gl.constexpr, acc_layout: gl.constexpr, RESET: gl.constexpr):
    """The tile's sums of ``seg_units`` K tiles into ``c`` [M, N] (contiguous, c's dtype).

    A run holding all ``k_tiles`` of the tile stores it. Otherwise (ATOMIC_OUT) the partial sums are added to
    the zeroed float32 workspace ``ws`` [M, N], then ``seg_units`` to the tile's counter; the program whose
    addition completes ``k_tiles`` converts the tile into ``c`` (no program waits for another) and, with RESET,
    zeroes tile and counter again for the next call (so one layer's calls must run one at a time)."""
    n = tn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    m = tm * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    offs = gl.expand_dims(m, 0).to(gl.int64) * N + gl.expand_dims(n, 1)
    mask = gl.expand_dims(n < N, 1) & gl.expand_dims(m < M, 0)
    if ATOMIC_OUT:
        if seg_units == k_tiles:
            gl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            gl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
            # All threads have issued their sums (barrier) before one thread's release of the count, which
            # covers them (split-K semaphore). Not a per-thread fence: it gave wrong sums
            # (bench/archive/NOTES_w4a16.md).
            gl.thread_barrier()
            done = gl.atomic_add(tile_units_ptr + tn, seg_units, sem="acq_rel") + seg_units
            if done == k_tiles:
                total = gl.load(ws_ptr + offs, mask=mask, cache_modifier=".cg")
                gl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)
                if RESET:
                    gl.store(ws_ptr + offs, gl.zeros_like(total), mask=mask)
                    gl.store(tile_units_ptr + tn, 0)
    else:
        gl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _mma_sync_unit(acc, words, b0, b1, b2, b3, scale, zero, xsum, zb, sc, SCALE_ACC: gl.constexpr,
                   acc_layout: gl.constexpr):
    """One unit's four mma.sync dots on its words [BLOCK_N, 16] (``k_width=1``) and activation operands
    b0-b3, added to ``acc``. SCALE_ACC: the dots multiply ``MAGIC_VALUE + code`` (:func:`_magic_pairs`) into
    a fresh float32 tile; zero point and scale [BLOCK_N, 1] go onto it with the activation sums ``xsum``
    [BLOCK_M]. Otherwise every pair is dequantized with the paired zero bias ``zb`` and scale ``sc``."""
    dtype: gl.constexpr = b0.dtype
    BLOCK_N: gl.constexpr = words.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    MAGIC_VALUE: gl.constexpr = 128.0 if dtype == gl.bfloat16 else 1024.0
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if SCALE_ACC:
        part = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
        part = mma_v2(_magic_pairs(words, 0, dtype, a_layout, BLOCK_N), b0, part)
        part = mma_v2(_magic_pairs(words, 1, dtype, a_layout, BLOCK_N), b1, part)
        part = mma_v2(_magic_pairs(words, 2, dtype, a_layout, BLOCK_N), b2, part)
        part = mma_v2(_magic_pairs(words, 3, dtype, a_layout, BLOCK_N), b3, part)
        row_scale = gl.convert_layout(gl.reshape(scale, [BLOCK_N]), gl.SliceLayout(1, acc_layout))
        row_bias = gl.convert_layout(gl.reshape(zero, [BLOCK_N]), gl.SliceLayout(1, acc_layout))
        bias = gl.expand_dims(row_bias.to(gl.float32) + MAGIC_VALUE, 1) * gl.expand_dims(xsum, 0)
        acc = acc + (part - bias) * gl.expand_dims(row_scale.to(gl.float32), 1)
    else:
        acc = mma_v2(_dequant_pairs(words, zb, sc, 0, a_layout, BLOCK_N), b0, acc)
        acc = mma_v2(_dequant_pairs(words, zb, sc, 1, a_layout, BLOCK_N), b1, acc)
        acc = mma_v2(_dequant_pairs(words, zb, sc, 2, a_layout, BLOCK_N), b2, acc)
        acc = mma_v2(_dequant_pairs(words, zb, sc, 3, a_layout, BLOCK_N), b3, acc)
    return acc
