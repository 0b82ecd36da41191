"""The W4A16 direct-load decode kernel (:func:`_w4a16_direct_kernel`, ``DIRECT`` configs, M <= 8, one group per K
tile): no ring; every warp loads its own operands, one unit ahead. The design is in
:mod:`quantkit.kernels.w4a16_gluon`'s docstring, the launcher there (``_launch_direct``).

The ring's fixed costs per call (set-up, first round trip, barriers) weigh on decode calls of 8-30 MB layers, so
here every warp loads its operands straight into the mma.sync registers. A dot sums over K, so any word order serves
if the activations follow it: thread (g, t) reads its *physical* words 4t .. 4t + 3 (one 16-byte load) as A-operand
words t, t + 4, t + 8, t + 12, and its activation columns likewise; a reshape and a permute relabel the registers
and the conversion to the dot-operand layouts moves no data (``assert_trivial``). Larger layers lose: all of a
warp's global loads share one scoreboard on sm_90, so any first use waits for every load in flight.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from quantkit.kernels.w4a16_gluon_common import (
    _DOT_K,
    _TILE_K,
    _WORDS,
    _even_run,
    _flush,
    _group_params,
    _mma_sync_unit,
    _wait_for_previous_grid,
)


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
