"""The W4A16 ring kernel (:func:`_w4a16_gluon_kernel`): a producer warp TMAs the packed words and activation tiles
through NUM_BUF shared-memory stages ("ready" / "empty" mbarriers), the consumer warps dequantize and multiply
with mma.sync (decode, stream-K) or async wgmma (prefill). The design is in :mod:`quantkit.kernels.w4a16_gluon`'s
docstring, the launcher there (:func:`quantkit.kernels.w4a16_gluon.launch`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from quantkit.kernels.w4a16_gluon_common import (
    _DOT_K,
    _TILE_K,
    _WORDS,
    _dequant_pairs,
    _even_run,
    _flush,
    _group_params,
    _mma_sync_unit,
    _pairs_of,
    _wait_for_previous_grid,
)

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
