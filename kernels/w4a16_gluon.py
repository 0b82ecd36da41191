"""W4A16 GEMM in Gluon (`triton.experimental.gluon`) for Hopper: ``Y = X W^T``, decode and prefill.

Why Gluon: Triton waits for each register-operand wgmma before its registers are rewritten (so dequantization
and multiply never overlap) and pipelines loads only a few tiles deep (bench/archive/NOTES_w4a16.md). Gluon places both.

* Paired nibbles (``w4a16_weights._paired_nibble_index``): a packed word shifted right by 4j has codes j and
  j + 4 at bits 0 and 16; one ``lop3`` makes them a pair of 16-bit floats ``MAGIC + code``, one packed
  subtraction and one packed multiply dequantize both, and that register *is* a tensor-core A-operand register.
  A 128-code K tile is four dots of K = 32; the activations are gathered into the matching column order.
* The words are read in the 32-bit A-operand layout (``k_width=1``): thread (g, t) holds words t, t + 4, t + 8,
  t + 12 of rows g and g + 8 of each 16-row block, which is where their pairs sit in the 16-bit A operand of a
  K = 32 dot (``k_width=2``): the conversion is register renaming.
* Ring kernel (:func:`_w4a16_gluon_kernel`): a producer warp (``gl.warp_specialize``) TMAs the weight words
  (64-byte swizzle: conflict-free reads) and activation tiles through NUM_BUF shared-memory stages, each with a
  "ready" and an "empty" mbarrier; the dequantizing warps never load or wait on a CTA-wide barrier. It runs
  under programmatic dependent launch behind ``w4a16_triton._gather_columns`` (gather, workspace zeroing,
  K-tile activation sums) and requests weights before that kernel ends.
* Decode (``WGMMA=False``; M <= 16, a candidate up to 64): ``mma.sync`` m16n8k16, weights as A. Its register
  operands have plain scoreboard dependencies, so dequantizing one dot overlaps the previous MMA with no wait;
  the activation rows are the n = 8 side (M <= 8 wastes nothing). Stream-K: units are (output tile, K tile);
  each of ``num_SMs * CTAS_PER_SM`` programs takes an equal contiguous run (no tail wave); partial tiles meet
  in a float32 workspace (:func:`_flush`). With one group per K tile, zero point and scale go onto each K
  tile's float32 sums instead of every code pair (:func:`_magic_pairs`).
* Prefill (``WGMMA=True``): async wgmma, dequantized A from registers (two warpgroups of 64 or 128 rows),
  activations as B from shared memory; dot j + 1 is dequantized while dot j runs (``warpgroup_mma_wait(1)``).
  One output tile per program (grouped order for L2 reuse), stored once.
* Direct decode (``DIRECT`` configs, M <= 8, one group per K tile; :func:`_w4a16_direct_kernel`): no ring;
  every warp loads its own operands, one unit ahead, from the caller's activations: one launch, no gather
  (act-order weights and ``GATHER_X`` read gathered ones). Partial tiles meet in the layer's
  ``W4A16Weights.partial_sums`` / ``tile_counters``. Faster than the ring up to ~60 M weights.

Scope: 4-bit, K a multiple of 128 (``pair_index`` set), contiguous groups of a multiple of 8 (per channel too),
sym or asym, act-order through ``pair_index``, fp16/bf16, sm_90; GPU only (Gluon has no interpreter path).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantkit.kernels.device_info import gpu_arch, num_sms
from quantkit.kernels.w4a16_configs import _DOT_K, _WORDS, DIRECT_MAX_M, PAIR_TILE_K, GluonConfig
from quantkit.kernels.w4a16_select import _gluon_supports
from quantkit.kernels.w4a16_triton import _gather_columns
from quantkit.kernels.w4a16_weights import W4A16Weights

__all__ = ["w4a16_gluon_matmul"]

# One K tile of the packed weights: 16 int32 words (128 codes) per output row, read as four dots of K = 32.
_WORDS = gl.constexpr(_WORDS)
_DOT_K = gl.constexpr(_DOT_K)
_TILE_K = gl.constexpr(PAIR_TILE_K)
# The producer warp only issues TMA: few registers, leaving the rest to the dequantizing warps.
LOAD_WARP_REGS = gl.constexpr(40)


@gluon.jit
def _tile_coords(tile, tiles_n, tiles_m, GROUP_N: gl.constexpr):
    """Output tile index -> (weight-row tile, activation-row tile), GROUP_N weight tiles swept across
    all activation tiles before the next GROUP_N (their packed words stay in L2 meanwhile)."""
    per_group = GROUP_N * tiles_m
    first_n = (tile // per_group) * GROUP_N
    group_n = gl.minimum(tiles_n - first_n, GROUP_N)
    tn = first_n + (tile % per_group) % group_n
    tm = (tile % per_group) // group_n
    return tn, tm


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
def _ring_barriers(NUM_BUF: gl.constexpr):
    """The ring's "ready" (TMA filled it) and "empty" (consumers released it) mbarriers."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return ready, empty


@gluon.jit
def _invalidate_ring(ready, empty, NUM_BUF: gl.constexpr):
    for s in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def _unit_coords(i, u0, pid, n_progs, k_tiles, tiles_n, tiles_m, GROUP_N: gl.constexpr, PERSISTENT: gl.constexpr):
    """The program's i-th unit -> (weight-row tile, activation-row tile, K tile). A contiguous run starts at
    grid unit ``u0``; a PERSISTENT program owns whole output tiles pid, pid + n_progs, ... in turn."""
    if PERSISTENT:
        tile = pid + (i // k_tiles) * n_progs
        kt = i % k_tiles
    else:
        tile = (u0 + i) // k_tiles
        kt = (u0 + i) % k_tiles
    tn, tm = _tile_coords(tile, tiles_n, tiles_m, GROUP_N)
    return tn, tm, kt


@gluon.jit
def _load_weights(desc_w, w_smem, ready, stage, tn, kt, x_bytes: gl.constexpr, BLOCK_N: gl.constexpr):
    """Arm ``stage`` for one unit (weight words plus ``x_bytes`` of activations); TMA the words of (tn, kt)."""
    bar = ready.index(stage)
    mbarrier.expect(bar, desc_w.block_type.nbytes + x_bytes)
    tma.async_copy_global_to_shared(desc_w, [tn * BLOCK_N, kt * _WORDS], bar, w_smem.index(stage))


@gluon.jit
def _load_partition(desc_w, desc_x, w_smem, x_smem, ready, empty, u0, count, pid, n_progs, k_tiles, tiles_n, tiles_m,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_N: gl.constexpr, NUM_BUF: gl.constexpr,
                    PERSISTENT: gl.constexpr):
    """Producer warp: TMA of each unit's weight words [BLOCK_N, 16] and activation boxes into stage
    i % NUM_BUF once the consumers have released it. The first NUM_BUF units' weights do not depend on the
    gather launched before this kernel, so they are requested before waiting for it (launch gap, gather and
    first weight round trip overlap)."""
    BOXES: gl.constexpr = _TILE_K // desc_x.block_type.shape[1]  # activation boxes per unit
    x_bytes: gl.constexpr = BOXES * desc_x.block_type.nbytes
    for i in range(gl.minimum(count, NUM_BUF)):
        tn, tm, kt = _unit_coords(i, u0, pid, n_progs, k_tiles, tiles_n, tiles_m, GROUP_N,
                                  PERSISTENT)
        _load_weights(desc_w, w_smem, ready, i, tn, kt, x_bytes, BLOCK_N)
    _wait_for_previous_grid()
    for i in range(count):
        stage = i % NUM_BUF
        tn, tm, kt = _unit_coords(i, u0, pid, n_progs, k_tiles, tiles_n, tiles_m, GROUP_N,
                                  PERSISTENT)
        if i >= NUM_BUF:
            # the consumers release stage s for the r-th time after unit s + r * NUM_BUF
            mbarrier.wait(empty.index(stage), ((i // NUM_BUF) + 1) & 1)
            _load_weights(desc_w, w_smem, ready, stage, tn, kt, x_bytes, BLOCK_N)
        for j in gl.static_range(BOXES):
            tma.async_copy_global_to_shared(desc_x, [tm * BLOCK_M, kt * _TILE_K + j * (_TILE_K // BOXES)],
                                            ready.index(stage), x_smem.index(stage * BOXES + j))


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
            # covers them (split-K semaphore). Not a per-thread fence: it gave wrong sums (bench/archive/NOTES_w4a16.md).
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
def _x_dot(x_smem, stage, j: gl.constexpr):
    """Dot j's [BLOCK_M, 32] activations in ring stage ``stage``: its own box, or a slice of a 64-column box."""
    BOX_K: gl.constexpr = x_smem.shape[2]
    box = x_smem.index(stage * (_TILE_K // BOX_K) + (j * _DOT_K) // BOX_K)
    if BOX_K == _DOT_K:
        return box
    else:
        return box.slice((j * _DOT_K) % BOX_K, _DOT_K, dim=1)


@gluon.jit
def _unit(acc, a_prev, scale, zero, w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, xsum_ptr, M, N, k_tiles,
          stride_sg, stride_zg, u, lo, hi, tn, tm, kt_base, offs_n, offs_w, GROUP_SIZE: gl.constexpr,
          HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr,
          WGMMA: gl.constexpr, SCALE_ACC: gl.constexpr, acc_layout: gl.constexpr):
    """One unit (K tile) of the consumer: wait for its stage, dequantize into four K = 32 A operands,
    multiply. Returns the accumulator, the wgmma A operand still in flight, and the next unit's scales and
    zeros (loaded now, used next time). SCALE_ACC: see :func:`_mma_sync_unit`; ``xsum`` [M, k_tiles] holds
    each K tile's activation sums, from the gather."""
    dtype: gl.constexpr = x_smem.dtype
    MAGIC_VALUE: gl.constexpr = 128.0 if dtype == gl.bfloat16 else 1024.0
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
    i = u  # units are numbered by their ring position (see _mma_partition)
    stage = i % NUM_BUF
    kt = u - kt_base
    scale_next, zero_next = _group_params(scales_ptr, zeros_ptr, tn, gl.minimum(kt + 1, hi - 1 - kt_base), N,
                                          stride_sg, stride_zg, offs_n, offs_w, GROUP_SIZE, HAS_ZEROS, BLOCK_N)
    if SCALE_ACC:
        m_idx = tm * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
        xsum = gl.load(xsum_ptr + m_idx * k_tiles + kt, mask=m_idx < M, other=0.0)
    else:
        zb = _pairs_of((zero + MAGIC_VALUE).to(dtype), a_layout, BLOCK_N)  # exact: small integers
        sc = _pairs_of(scale.to(dtype), a_layout, BLOCK_N)
    mbarrier.wait(ready.index(stage), (i // NUM_BUF) & 1)
    words = w_smem.index(stage).load(w_layout)
    if WGMMA:
        # dot j is issued, then dot j + 1 dequantized while it runs; wait(1) retires dot j - 1
        for j in gl.static_range(4):
            a = _dequant_pairs(words, zb, sc, j, a_layout, BLOCK_N)
            acc = warpgroup_mma(a, _x_dot(x_smem, stage, j).permute((1, 0)), acc, is_async=True)
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
            if j == 0:
                # the previous unit's wgmmas have all retired: its stage may be refilled
                mbarrier.arrive(empty.index((i + NUM_BUF - 1) % NUM_BUF), pred=u > lo)
            a_prev = a
    else:
        b0 = _x_dot(x_smem, stage, 0).permute((1, 0)).load(b_layout)
        b1 = _x_dot(x_smem, stage, 1).permute((1, 0)).load(b_layout)
        b2 = _x_dot(x_smem, stage, 2).permute((1, 0)).load(b_layout)
        b3 = _x_dot(x_smem, stage, 3).permute((1, 0)).load(b_layout)
        # the consumer warps hold the stage in registers: the producer may refill it
        mbarrier.arrive(empty.index(stage))
        if SCALE_ACC:
            acc = _mma_sync_unit(acc, words, b0, b1, b2, b3, scale, zero, xsum, zero, zero, True, acc_layout)
        else:
            acc = _mma_sync_unit(acc, words, b0, b1, b2, b3, scale, zero, scale, zb, sc, False, acc_layout)
    return acc, a_prev, scale_next, zero_next


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


@gluon.jit
def _mma_partition(w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, xsum_ptr, c_ptr, ws_ptr, tile_units_ptr, M,
                   N, u0,
                   count, pid, n_progs, k_tiles, tiles_n, tiles_m, stride_sg, stride_zg, GROUP_SIZE: gl.constexpr,
                   HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_N: gl.constexpr,
                   NUM_BUF: gl.constexpr, WGMMA: gl.constexpr, ATOMIC_OUT: gl.constexpr, PERSISTENT: gl.constexpr,
                   num_warps: gl.constexpr):
    """Consumer warps: one segment per output tile the run touches (stream-K pieces, or whole tiles), each
    segment's units, then its flush. Units are numbered by ring position; ``kt_base`` maps them to K tiles.

    With wgmma the segment's last unit is peeled off the loop and drained in straight-line code: any other
    drain placement made ptxas read the accumulator early or serialize the wgmmas (bench/archive/NOTES_w4a16.md)."""
    dtype: gl.constexpr = x_smem.dtype
    if WGMMA:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
    offs_w = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, w_layout))
    # mma.sync, one group per K tile: scale the float32 sums, not every dequantized pair (fewer instructions)
    SCALE_ACC: gl.constexpr = (not WGMMA) and (GROUP_SIZE % _TILE_K == 0)
    # the activation sums and the stream-K workspace come from the gather launched before this kernel
    _wait_for_previous_grid()

    if PERSISTENT:
        n_segments = gl.cdiv(count, k_tiles)
    else:
        n_segments = (u0 + count - 1) // k_tiles - u0 // k_tiles + 1
    for seg in range(n_segments):
        if PERSISTENT:
            tn, tm = _tile_coords(pid + seg * n_progs, tiles_n, tiles_m, GROUP_N)
            kt_base = seg * k_tiles  # ring position of the tile's K tile 0
            lo = kt_base
            hi = kt_base + k_tiles
        else:
            t = u0 // k_tiles + seg
            tn, tm = _tile_coords(t, tiles_n, tiles_m, GROUP_N)
            kt_base = t * k_tiles - u0
            lo = gl.maximum(0, kt_base)
            hi = gl.minimum(count, kt_base + k_tiles)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
        a_prev = gl.zeros([BLOCK_N, 2 * _WORDS], dtype, layout=a_layout)  # wgmma: the A operand in flight
        scale, zero = _group_params(scales_ptr, zeros_ptr, tn, lo - kt_base, N, stride_sg, stride_zg, offs_n,
                                    offs_w, GROUP_SIZE, HAS_ZEROS, BLOCK_N)
        for u in range(lo, hi - 1 if WGMMA else hi):
            acc, a_prev, scale, zero = _unit(acc, a_prev, scale, zero, w_smem, x_smem, ready, empty, scales_ptr,
                                             zeros_ptr, xsum_ptr, M, N, k_tiles, stride_sg, stride_zg, u, lo, hi,
                                             tn, tm, kt_base,
                                             offs_n, offs_w, GROUP_SIZE, HAS_ZEROS, BLOCK_N, BLOCK_M, NUM_BUF,
                                             WGMMA, SCALE_ACC, acc_layout)
        if WGMMA:
            acc, a_prev, scale, zero = _unit(acc, a_prev, scale, zero, w_smem, x_smem, ready, empty, scales_ptr,
                                             zeros_ptr, xsum_ptr, M, N, k_tiles, stride_sg, stride_zg, hi - 1,
                                             lo, hi, tn, tm, kt_base,
                                             offs_n, offs_w, GROUP_SIZE, HAS_ZEROS, BLOCK_N, BLOCK_M, NUM_BUF,
                                             WGMMA, SCALE_ACC, acc_layout)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((hi - 1) % NUM_BUF))  # the segment's last stage
        _flush(acc, c_ptr, ws_ptr, tile_units_ptr, tn, tm, M, N, hi - lo, k_tiles, BLOCK_N, BLOCK_M, ATOMIC_OUT,
               acc_layout, False)


@gluon.jit
def _w4a16_gluon_kernel(desc_w, desc_x, scales_ptr, zeros_ptr, xsum_ptr, c_ptr, ws_ptr, tile_units_ptr, M, N, k_tiles,
                        tiles_n, tiles_m, stride_sg, stride_zg,
                        GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_M: gl.constexpr, GROUP_N: gl.constexpr, NUM_BUF: gl.constexpr,
                        WGMMA: gl.constexpr, ATOMIC_OUT: gl.constexpr, PERSISTENT: gl.constexpr,
                        num_warps: gl.constexpr):
    """``c[M, N] (+)= x[M, K] @ dequant(qw)^T`` over this program's run of (tile, K tile) units; ``x`` (behind
    ``desc_x``) in paired-nibble column order, ``c`` contiguous. ATOMIC_OUT: stream-K runs, partial tiles meet
    in ``ws`` (:func:`_flush`). PERSISTENT: every n_progs-th tile, the producer running on into the next tile
    while the consumers store the last (launch and pipeline fill paid once per SM). Otherwise one tile a run."""
    pid = gl.program_id(0)
    n_progs = gl.num_programs(0)
    n_tiles = tiles_n * tiles_m
    if PERSISTENT:
        u0 = 0
        count = gl.cdiv(n_tiles - pid, n_progs) * k_tiles
    else:
        u0, count = _even_run(pid, n_progs, n_tiles * k_tiles)

    w_smem = gl.allocate_shared_memory(gl.int32, [NUM_BUF, BLOCK_N, _WORDS], desc_w.layout)
    BOX_K: gl.constexpr = desc_x.block_type.shape[1]
    x_smem = gl.allocate_shared_memory(desc_x.dtype, [NUM_BUF * (_TILE_K // BOX_K), BLOCK_M, BOX_K], desc_x.layout)
    ready, empty = _ring_barriers(NUM_BUF)
    gl.warp_specialize([
        (_mma_partition, (w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, xsum_ptr, c_ptr, ws_ptr, tile_units_ptr,
                          M, N, u0, count, pid, n_progs, k_tiles, tiles_n, tiles_m, stride_sg, stride_zg, GROUP_SIZE,
                          HAS_ZEROS, BLOCK_N, BLOCK_M, GROUP_N, NUM_BUF, WGMMA, ATOMIC_OUT, PERSISTENT, num_warps)),
        (_load_partition, (desc_w, desc_x, w_smem, x_smem, ready, empty, u0, count, pid, n_progs, k_tiles, tiles_n,
                           tiles_m, BLOCK_N, BLOCK_M, GROUP_N, NUM_BUF, PERSISTENT)),
    ], [1], [LOAD_WARP_REGS])
    _invalidate_ring(ready, empty, NUM_BUF)


# --- The direct-load decode kernel (DIRECT configs) -------------------------------------------------------------
# The ring's fixed costs per call (set-up, first round trip, barriers) weigh on decode calls of 8-30 MB layers, so
# here every warp loads its operands straight into the mma.sync registers. A dot sums over K, so any word order
# serves if the activations follow it: thread (g, t) reads its *physical* words 4t .. 4t + 3 (one 16-byte load) as
# A-operand words t, t + 4, t + 8, t + 12, and its activation columns likewise; a reshape and a permute relabel the
# registers and the conversion to the dot-operand layouts moves no data (``assert_trivial``). Larger layers lose:
# all of a warp's global loads share one scoreboard on sm_90, so any first use waits for every load in flight.


@triton.constexpr_function
def _direct_words_layout(block_n, num_warps):
    """[block_n, 16] packed words, thread (g, t) of warp w holding physical words 4t .. 4t + 3 (registers 0-3) of
    rows g and g + 8 of each 16-row block: the A layout of :func:`_mma_partition` after :func:`_as_a_words`."""
    reg = [[0, 1], [0, 2], [8, 0]]
    rows = 16 * num_warps
    while rows < block_n:
        reg.append([rows, 0])
        rows *= 2
    warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warps, [], [block_n, 16])


@triton.constexpr_function
def _direct_x_layout(block_m, num_warps):
    """[block_m, 32] activations of one dot, thread (g, t) holding columns 8t .. 8t + 7 of rows g (and g + 8): the
    B layout after :func:`_as_b_columns`. Every warp holds the whole tile (the B operand is shared)."""
    reg = [[0, 1], [0, 2], [0, 4]] + ([[8, 0]] if block_m == 16 else [])
    warps = [[0, 0] for _ in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], warps, [], [block_m, 32])


@triton.constexpr_function
def _direct_raw_x_layout(block_m, num_warps):
    """[block_m, 128] activations of one K tile in the caller's column order, thread (g, t) holding columns
    32t .. 32t + 31 of rows g (and g + 8): exactly the columns that its four B operands need (see
    :func:`_direct_raw_activations`). Every warp holds the whole tile."""
    reg = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]] + ([[8, 0]] if block_m == 16 else [])
    warps = [[0, 0] for _ in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, [[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warps, [], [block_m, 128])


@gluon.jit
def _as_a_words(words, w_layout: gl.constexpr):
    """Physical word 4t + i of a row -> A-operand word t + 4i (relabelled, nothing moves)."""
    BLOCK_N: gl.constexpr = words.shape[0]
    words = gl.reshape(gl.permute(gl.reshape(words, [BLOCK_N, 4, 4]), (0, 2, 1)), [BLOCK_N, 16])
    return gl.convert_layout(words, w_layout, assert_trivial=True)


@gluon.jit
def _as_b_columns(x, b_layout: gl.constexpr):
    """[BLOCK_M, 32] activation columns 8t + 2i + h (pair h of physical word 4t + i) -> the B operand [32, BLOCK_M]
    at K position 8i + 2t + h, which is pair h of A-operand word t + 4i: the same relabelling as :func:`_as_a_words`."""
    BLOCK_M: gl.constexpr = x.shape[0]
    x = gl.reshape(gl.permute(gl.reshape(x, [BLOCK_M, 4, 4, 2]), (0, 2, 1, 3)), [BLOCK_M, 32])
    return gl.convert_layout(gl.permute(x, (1, 0)), b_layout, assert_trivial=True)


@gluon.jit
def _direct_words(w_ptr, stride_wn, N, tn, kt, ok, offs_n, offs_q, w_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Unit (tn, kt)'s packed words [BLOCK_N, 16] in the A layout; nothing is read unless ``ok``."""
    rows = tn * BLOCK_N + offs_n
    ptrs = w_ptr + gl.expand_dims(rows * stride_wn, 1) + gl.expand_dims(kt * _WORDS + offs_q, 0)
    words = gl.load(ptrs, mask=gl.expand_dims((rows < N) & ok, 1), other=0)
    return _as_a_words(words, w_layout)


@gluon.jit
def _direct_x(x_ptr, stride_xm, M, kt, j: gl.constexpr, ok, offs_m, offs_c, b_layout: gl.constexpr):
    """Dot j of K tile kt: the gathered activations' columns [BLOCK_M, 32] as the B operand."""
    ptrs = x_ptr + gl.expand_dims(offs_m * stride_xm, 1) + gl.expand_dims(kt * _TILE_K + j * _DOT_K + offs_c, 0)
    x = gl.load(ptrs, mask=gl.expand_dims((offs_m < M) & ok, 1), other=0.0)
    return _as_b_columns(x, b_layout)


@gluon.jit
def _direct_activations(x_ptr, xsum_ptr, stride_xm, M, k_tiles, kt, ok, b_layout: gl.constexpr,
                        sum_layout: gl.constexpr, GATHERED: gl.constexpr, BLOCK_M: gl.constexpr,
                        num_warps: gl.constexpr):
    """K tile kt's four activation operands and its activation sums [BLOCK_M] (``sum_layout``); nothing is read
    unless ``ok``. GATHERED: from the gathered activations and the sums the gather wrote; otherwise from the
    caller's activations (:func:`_direct_raw_activations`)."""
    if GATHERED:
        load_x_layout: gl.constexpr = _direct_x_layout(BLOCK_M, num_warps)
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load_x_layout))
        offs_c = gl.arange(0, _DOT_K, layout=gl.SliceLayout(0, load_x_layout))
        m_idx = gl.arange(0, BLOCK_M, layout=sum_layout)
        x0 = _direct_x(x_ptr, stride_xm, M, kt, 0, ok, offs_m, offs_c, b_layout)
        x1 = _direct_x(x_ptr, stride_xm, M, kt, 1, ok, offs_m, offs_c, b_layout)
        x2 = _direct_x(x_ptr, stride_xm, M, kt, 2, ok, offs_m, offs_c, b_layout)
        x3 = _direct_x(x_ptr, stride_xm, M, kt, 3, ok, offs_m, offs_c, b_layout)
        xsum = gl.load(xsum_ptr + m_idx * k_tiles + kt, mask=(m_idx < M) & ok, other=0.0)
    else:
        raw_layout: gl.constexpr = _direct_raw_x_layout(BLOCK_M, num_warps)
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, raw_layout))
        offs_k = gl.arange(0, _TILE_K, layout=gl.SliceLayout(0, raw_layout))
        x0, x1, x2, x3, xsum = _direct_raw_activations(x_ptr, stride_xm, M, kt, ok, offs_m, offs_k, b_layout,
                                                       sum_layout)
    return x0, x1, x2, x3, xsum


@gluon.jit
def _direct_raw_activations(x_ptr, stride_xm, M, kt, ok, offs_m, offs_k, b_layout: gl.constexpr,
                            sum_layout: gl.constexpr):
    """As :func:`_direct_activations`, from the caller's column order, the K tile's sums computed here.

    Dot j, column c = 8t + 2i + h (pair h of physical word 4t + i) multiplies code j + 4h of that word: original
    column 8 (4t + i) + j + 4h = 32t + 8i + 4h + j (``w4a16_weights._paired_nibble_index``). So thread (g, t)'s four
    dots read columns 32t .. 32t + 31, one 64-byte load; splitting off the column's two low bits (j) in registers
    gives the four operands."""
    BLOCK_M: gl.constexpr = offs_m.shape[0]
    ptrs = x_ptr + gl.expand_dims(offs_m * stride_xm, 1) + gl.expand_dims(kt * _TILE_K + offs_k, 0)
    x = gl.load(ptrs, mask=gl.expand_dims((offs_m < M) & ok, 1), other=0.0)
    xsum = gl.convert_layout(gl.sum(x.to(gl.float32), axis=1), sum_layout)
    # [BLOCK_M, (t, i, h), j // 2, j % 2]
    x_even, x_odd = gl.split(gl.reshape(x, [BLOCK_M, _DOT_K, 2, 2]))
    x0, x2 = gl.split(x_even)
    x1, x3 = gl.split(x_odd)
    return (_as_b_columns(x0, b_layout), _as_b_columns(x1, b_layout), _as_b_columns(x2, b_layout),
            _as_b_columns(x3, b_layout), xsum)


@gluon.jit
def _w4a16_direct_kernel(w_ptr, x_ptr, scales_ptr, zeros_ptr, xsum_ptr, c_ptr, ws_ptr, counters_ptr, M, N, k_tiles,
                         tiles_n, stride_wn, stride_xm, stride_sg, stride_zg,
                         GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr,
                         BLOCK_M: gl.constexpr, GATHERED: gl.constexpr, UNROLL: gl.constexpr,
                         num_warps: gl.constexpr):
    """Decode, stream-K, M <= BLOCK_M: ``c[M, N] (+)= x[M, K] @ dequant(qw)^T`` as the mma.sync ring kernel, but
    every warp loads its own operands, the next unit's before this unit's multiplies. ``w_ptr``: packed words
    [N, K / 8] as stored; ``x_ptr``: activations [M, K]. GATHERED: ``x`` and its K-tile sums ``xsum`` come from
    ``w4a16_triton._gather_columns``; otherwise the caller's activations, summed here. Partial tiles meet
    through :func:`_flush` in the layer's workspace ``ws`` and counters, left zeroed."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 8])
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_layout, k_width=2)
    load_w_layout: gl.constexpr = _direct_words_layout(BLOCK_N, num_warps)
    sum_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    # one group per K tile (GluonConfig.fits): the zero point and the scale go onto each unit's float32 sums
    gl.static_assert(GROUP_SIZE % _TILE_K == 0, "the direct kernel takes one group per K tile")

    offs_q = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, load_w_layout))
    offs_n_load = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_w_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
    offs_w = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, w_layout))  # unused by _group_params here

    pid = gl.program_id(0)
    u0, count = _even_run(pid, gl.num_programs(0), tiles_n * k_tiles)  # count >= 1: the grid has <= units

    # unit 0's weights do not depend on the kernel before this one (the gather, or whatever wrote x)
    words = _direct_words(w_ptr, stride_wn, N, u0 // k_tiles, u0 % k_tiles, True, offs_n_load, offs_q, w_layout,
                          BLOCK_N)
    scale, zero = _group_params(scales_ptr, zeros_ptr, u0 // k_tiles, u0 % k_tiles, N, stride_sg, stride_zg, offs_n,
                                offs_w, GROUP_SIZE, HAS_ZEROS, BLOCK_N)
    _wait_for_previous_grid()
    x0, x1, x2, x3, xsum = _direct_activations(x_ptr, xsum_ptr, stride_xm, M, k_tiles, u0 % k_tiles, True, b_layout,
                                               sum_layout, GATHERED, BLOCK_M, num_warps)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    seg_first = 0
    if UNROLL == 2:
        # Two units an iteration, the operand sets trading places: saves moving the next unit's operands back into
        # the loop's registers every iteration. Past the run (odd counts) the second unit reads and adds nothing.
        for i in range(0, count, 2):
            acc, seg_first, w_b, y0, y1, y2, y3, ysum, scale_b, zero_b = _direct_unit(
                acc, seg_first, words, x0, x1, x2, x3, xsum, scale, zero, i, u0, count, w_ptr, x_ptr, scales_ptr,
                zeros_ptr, xsum_ptr, c_ptr, ws_ptr, counters_ptr, M, N, k_tiles, stride_wn, stride_xm, stride_sg,
                stride_zg, offs_n_load, offs_q, offs_n, offs_w, w_layout, b_layout, sum_layout, acc_layout,
                GROUP_SIZE, HAS_ZEROS, GATHERED, num_warps)
            acc, seg_first, words, x0, x1, x2, x3, xsum, scale, zero = _direct_unit(
                acc, seg_first, w_b, y0, y1, y2, y3, ysum, scale_b, zero_b, i + 1, u0, count, w_ptr, x_ptr,
                scales_ptr, zeros_ptr, xsum_ptr, c_ptr, ws_ptr, counters_ptr, M, N, k_tiles, stride_wn, stride_xm,
                stride_sg, stride_zg, offs_n_load, offs_q, offs_n, offs_w, w_layout, b_layout, sum_layout,
                acc_layout, GROUP_SIZE, HAS_ZEROS, GATHERED, num_warps)
    else:
        for i in range(count):
            acc, seg_first, words, x0, x1, x2, x3, xsum, scale, zero = _direct_unit(
                acc, seg_first, words, x0, x1, x2, x3, xsum, scale, zero, i, u0, count, w_ptr, x_ptr, scales_ptr,
                zeros_ptr, xsum_ptr, c_ptr, ws_ptr, counters_ptr, M, N, k_tiles, stride_wn, stride_xm, stride_sg,
                stride_zg, offs_n_load, offs_q, offs_n, offs_w, w_layout, b_layout, sum_layout, acc_layout,
                GROUP_SIZE, HAS_ZEROS, GATHERED, num_warps)


@gluon.jit
def _direct_unit(acc, seg_first, words, x0, x1, x2, x3, xsum, scale, zero, i, u0, count, w_ptr, x_ptr, scales_ptr,
                 zeros_ptr, xsum_ptr, c_ptr, ws_ptr, counters_ptr, M, N, k_tiles, stride_wn, stride_xm, stride_sg,
                 stride_zg, offs_n_load, offs_q, offs_n, offs_w, w_layout: gl.constexpr, b_layout: gl.constexpr,
                 sum_layout: gl.constexpr, acc_layout: gl.constexpr, GROUP_SIZE: gl.constexpr,
                 HAS_ZEROS: gl.constexpr, GATHERED: gl.constexpr, num_warps: gl.constexpr):
    """Unit i of the direct kernel's run: loads unit i + 1's operands (not past the run), multiplies unit i's
    (``words`` .. ``zero``) into ``acc``, and flushes where the unit ends the tile or the run (``seg_first``: the
    tile's first unit in the run). Past the run the operands are zeros and nothing is flushed. Returns (acc,
    seg_first, next operands)."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    u = u0 + i
    un = u0 + gl.minimum(i + 1, count - 1)
    more = i + 1 < count
    w_n = _direct_words(w_ptr, stride_wn, N, un // k_tiles, un % k_tiles, more, offs_n_load, offs_q, w_layout,
                        BLOCK_N)
    x0_n, x1_n, x2_n, x3_n, xsum_n = _direct_activations(x_ptr, xsum_ptr, stride_xm, M, k_tiles, un % k_tiles, more,
                                                         b_layout, sum_layout, GATHERED, BLOCK_M, num_warps)
    scale_n, zero_n = _group_params(scales_ptr, zeros_ptr, un // k_tiles, un % k_tiles, N, stride_sg, stride_zg,
                                    offs_n, offs_w, GROUP_SIZE, HAS_ZEROS, BLOCK_N)
    acc = _mma_sync_unit(acc, words, x0, x1, x2, x3, scale, zero, xsum, zero, zero, True, acc_layout)
    if (i < count) & (((u % k_tiles) == k_tiles - 1) | (i == count - 1)):  # the unit ends a tile or the run
        _flush(acc, c_ptr, ws_ptr, counters_ptr, u // k_tiles, 0, M, N, i + 1 - seg_first, k_tiles, BLOCK_N, BLOCK_M,
               True, acc_layout, True)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
        seg_first = i + 1
    return acc, seg_first, w_n, x0_n, x1_n, x2_n, x3_n, xsum_n, scale_n, zero_n


def w4a16_gluon_matmul(x: torch.Tensor, w: W4A16Weights, config: GluonConfig) -> torch.Tensor:
    """``x [M, K]`` -> ``x @ W^T`` through the Gluon kernel ``config`` selects (see the module docstring)."""
    if not (x.is_cuda and _gluon_supports(w.facts(), gpu_arch(x.device)) and w.pair_index is not None
            and x.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError("the Gluon W4A16 kernel needs a Hopper GPU, fp16/bf16 activations and 4-bit weights "
                         f"with K a multiple of {PAIR_TILE_K} and groups of a multiple of 8")
    if not config.fits(x.shape[0], w.group_size):
        raise ValueError(f"{config} does not fit M = {x.shape[0]}, group {w.group_size} "
                         "(shared memory, registers or tile)")
    return launch(x, w, config)


def launch(x: torch.Tensor, w: W4A16Weights, config: GluonConfig) -> torch.Tensor:
    """The launch itself, for inputs and a config already checked (by :func:`w4a16_gluon_matmul`, or at load by
    the selection that bound it: :func:`quantkit.kernels.w4a16.bind_launcher`)."""
    if config.DIRECT:
        return _launch_direct(x, w, config)
    m, k = x.shape
    n = w.out_features
    block_m = config.block_m(m)
    k_tiles = k // PAIR_TILE_K
    tiles_n, tiles_m = triton.cdiv(n, config.BLOCK_N), triton.cdiv(m, block_m)
    stream_k = config.STREAM_K and tiles_m == 1
    persistent = config.PERSISTENT and not stream_k
    # the gather also zeroes, for stream-K, the float32 workspace [M, N] and the tile counters behind it
    ws = torch.empty(m * n + tiles_n if stream_k else 0, device=x.device, dtype=torch.float32)
    # and, for the mma.sync path with one group per K tile, each K tile's activation sums (_magic_pairs)
    xsum = None
    if not config.WGMMA and w.group_size % PAIR_TILE_K == 0:
        xsum = torch.empty((m, k_tiles), device=x.device, dtype=torch.float32)
    xp = _gather_columns(x, w.pair_index, ws, xsum)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if stream_k:
        tile_units = ws[m * n:].view(torch.int32)  # zero bits are int32 zeros
        grid = (min(tiles_n * k_tiles, num_sms(x.device) * config.CTAS_PER_SM),)
    else:
        ws, tile_units = out, out  # unused
        grid = (tiles_n * tiles_m,)
        if persistent:
            grid = (min(tiles_n * tiles_m, num_sms(x.device) * config.CTAS_PER_SM),)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    desc_w = TensorDescriptor(w.qweight, [n, k // 8], [w.qweight.stride(0), 1], [config.BLOCK_N, int(_WORDS)],
                              _swizzled_layout(64, 32))
    desc_x = TensorDescriptor(xp, [m, k], [xp.stride(0), 1], [block_m, config.X_BOX_K],
                              _swizzled_layout(2 * config.X_BOX_K, 16))
    _w4a16_gluon_kernel[grid](desc_w, desc_x, w.scales, zeros, xsum if xsum is not None else ws, out, ws, tile_units,
                              m, n, k_tiles, tiles_n,
                              tiles_m, w.scales.stride(0), zeros.stride(0),
                              GROUP_SIZE=w.group_size, HAS_ZEROS=w.zeros is not None, BLOCK_N=config.BLOCK_N,
                              BLOCK_M=block_m, GROUP_N=config.GROUP_N, NUM_BUF=config.NUM_BUF,
                              WGMMA=config.WGMMA, ATOMIC_OUT=stream_k, PERSISTENT=persistent,
                              num_warps=config.num_warps,
                              maxnreg=config.maxnreg(), launch_pdl=True)
    return out


def _launch_direct(x: torch.Tensor, w: W4A16Weights, config: GluonConfig) -> torch.Tensor:
    """:func:`_w4a16_direct_kernel`, behind the column gather for act-order weights or GATHER_X."""
    m, k = x.shape
    n = w.out_features
    if w.tile_counters is None or w.partial_sums is None or w.partial_sums.numel() < m * n:
        raise ValueError("the direct W4A16 kernel needs the layer's zeroed stream-K workspace (M <= "
                         f"{DIRECT_MAX_M}): prepare the weights with prepare_w4a16_weights")
    block_m = config.block_m(m)
    k_tiles = k // PAIR_TILE_K
    tiles_n = triton.cdiv(n, config.BLOCK_N)
    gathered = w.perm is not None or config.GATHER_X
    if gathered:
        xsum = torch.empty((m, k_tiles), device=x.device, dtype=torch.float32)
        x = _gather_columns(x, w.pair_index, None, xsum)
    else:
        x = x if x.stride(1) == 1 else x.contiguous()
        xsum = w.partial_sums  # unused
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    grid = (min(tiles_n * k_tiles, num_sms(x.device) * config.CTAS_PER_SM),)
    _w4a16_direct_kernel[grid](w.qweight, x, w.scales, zeros, xsum, out, w.partial_sums, w.tile_counters, m, n,
                               k_tiles, tiles_n, w.qweight.stride(0), x.stride(0), w.scales.stride(0),
                               zeros.stride(0), GROUP_SIZE=w.group_size, HAS_ZEROS=w.zeros is not None,
                               BLOCK_N=config.BLOCK_N, BLOCK_M=block_m, GATHERED=gathered, UNROLL=config.UNROLL,
                               num_warps=config.num_warps, maxnreg=config.maxnreg(), launch_pdl=True)
    return out


@functools.cache
def _swizzled_layout(swizzle_bytes: int, bits: int) -> gl.NVMMASharedLayout:
    """A 2-D TMA/MMA shared layout, cached: building one validates, costing host time on every decode call."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle_bytes, element_bitwidth=bits, rank=2)
