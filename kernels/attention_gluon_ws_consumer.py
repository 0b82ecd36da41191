"""The consumer warpgroups of the warp-specialized Gluon attention kernel (:mod:`quantkit.kernels.attention_gluon_ws`):
one work tile of one 64-row half (:func:`_consume_tile`: S = Q K^T, the online softmax, O += P V, in ping-ponged
turns), the loop over a program's work tiles (:func:`_ws_consumer`), and their helpers: the lazy O rescale's warp
vote (LAZY_RESCALE), the P V issue with the tensor-core row sums (ROWSUM_MMA), and the K scale of a tile.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from quantkit.kernels.attention_gluon_common import (
    p_operand,
    pv,
    row_state,
    softmax_tile,
)
from quantkit.kernels.attention_gluon_ws_tiles import HALF_M, ONES_N, _tile_coords


def _rescale_asm(n):
    """LAZY_RESCALE: PTX for one thread's n O values ($0..$n-1, tied to inputs $n..$2n-1) and their rows' alphas
    ($2n..$3n-1): multiply only if some row of the warp has alpha != 1. A thread holds two rows of the wgmma
    accumulator; its values 0 and 2 are one of each (register bases: col + 1, row + 8, then columns). The vote
    makes the branch warp-uniform (bra.uni); no exchange between warps."""
    body = [f"setp.neu.f32 lzp0, ${2 * n}, 0f3F800000;",
            f"setp.neu.or.f32 lzp0, ${2 * n + 2}, 0f3F800000, lzp0;",
            "vote.sync.any.pred lzp1, lzp0, -1;",
            "@!lzp1 bra.uni LZ_SKIP;"]
    body += [f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n)]
    asm = "{\n.reg .pred lzp0, lzp1;\n" + "\n".join(body) + "\nLZ_SKIP:\n}"
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * n)
    return asm, constraints


_RESCALE_ASM_32, _RESCALE_CON_32 = (gl.constexpr(x) for x in _rescale_asm(32))  # head dim 64
_RESCALE_ASM_64, _RESCALE_CON_64 = (gl.constexpr(x) for x in _rescale_asm(64))  # head dim 128


@gluon.jit
def _rescale_o(acc, alpha_o, HEAD_DIM: gl.constexpr):
    """acc * alpha (alpha_o: per row, acc's row layout), skipped by each warp whose rows all have alpha 1."""
    a = gl.expand_dims(alpha_o, 1)
    if HEAD_DIM == 128:
        return gl.inline_asm_elementwise(_RESCALE_ASM_64, _RESCALE_CON_64, [acc, a], dtype=gl.float32,
                                         is_pure=True, pack=64)
    else:
        return gl.inline_asm_elementwise(_RESCALE_ASM_32, _RESCALE_CON_32, [acc, a], dtype=gl.float32,
                                         is_pure=True, pack=32)


@gluon.jit
def _issue_pv(p_op, v_tile, acc, ones_smem, l_zero, dtype: gl.constexpr, IS_FP8: gl.constexpr,
              ROWSUM_MMA: gl.constexpr):
    """Issue O += P V (async); ROWSUM_MMA: also P @ ones_smem into the fresh l_zero, from the same e4m3 P.
    Returns (acc, rs); without ROWSUM_MMA rs is l_zero (nothing issued)."""
    if ROWSUM_MMA:
        p8 = p_op.to(dtype)  # one e4m3 P for both wgmmas
        acc = warpgroup_mma(p8, v_tile.permute((1, 0)), acc, is_async=True)
        rs = warpgroup_mma(p8, ones_smem.permute((1, 0)), l_zero, use_acc=False, is_async=True)
    else:
        acc = pv(p_op, v_tile, acc, dtype, IS_FP8)
        rs = l_zero
    return acc, rs


@gluon.jit
def _k_scale(ks_smem, stage, ks_ptr, offset, row_layout: gl.constexpr, STAGE_KS: gl.constexpr):
    """The K scale of the tile in `stage`, per S row: from its ks_smem row (STAGE_KS) or ks_ptr + offset."""
    if STAGE_KS:
        return ks_smem.index(stage).load(row_layout)
    else:
        return gl.load(ks_ptr + offset)


@gluon.jit
def _consume_tile(wg, q_smem, k_smem, v_smem, ks_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars,
                  desc_o, o_smem, o_ptr, qs_ptr, ks_ptr, v_scale_ptr, sm_scale, stride_om, stride_oh, stride_qsm,
                  stride_ksn, q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head, kv_head, n_tiles, cnt, it, rnd,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_FP8: gl.constexpr,
                  NUM_BUF: gl.constexpr, PINGPONG: gl.constexpr, TMA_STORE: gl.constexpr,
                  STAGE_KS: gl.constexpr, ones_smem, ROWSUM_MMA: gl.constexpr, LAZY_RESCALE: gl.constexpr):
    """One warpgroup, one work tile: rows blk_m0 + wg * 64 .. + 63. Round j (j = 0..n_tiles) issues S_j and
    P_(j-1) V_(j-1) in this warpgroup's turn; the softmax of S_j then overlaps both the P V wgmma and the
    other warpgroup's round. cnt: ring position of key tile 0; it: work tiles done (Q phase); rnd: rounds done
    (turn phase). The flags as in the module docstring; TMA_STORE applies only to a half whose 64 rows lie
    inside the sequence."""
    dtype: gl.constexpr = q_smem.dtype
    MMA_K: gl.constexpr = 32 if IS_FP8 else 16
    # P across the loop's back edge: fp8 P stays fp32 (240 registers a thread allow it) and `pv` converts it
    # to e4m3 in one step, instead of via fp16 with byte permutes
    p_dtype: gl.constexpr = gl.float32 if IS_FP8 else dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, MMA_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if IS_FP8 else 2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # ROWSUM_MMA: the 64 x ONES_N accumulator of P @ ones (every column = the row sums)
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ONES_N, MMA_K])
    row_l: gl.constexpr = gl.SliceLayout(1, l_layout)
    # ROWSUM_MMA: P times 2^8 (<= 256 < 448, e4m3's maximum): small probabilities become normal e4m3 numbers,
    # not subnormals (multiples of 2^-9), so the P @ ones sums match fp32 sums (bench/archive/NOTES_attention.md).
    # LAZY_RESCALE: p <= 2^(P_LOG2 + TAU), within e4m3's 448 (and far inside bf16/fp16's range)
    TAU: gl.constexpr = (2.0 if ROWSUM_MMA else 8.0) if LAZY_RESCALE else 0.0
    P_LOG2: gl.constexpr = 8.0 - TAU if ROWSUM_MMA else 0.0

    my_turn = turn_bars.index(wg)
    their_turn = turn_bars.index(1 - wg)
    q_tile = q_smem.index(wg)
    m0 = blk_m0 + wg * HALF_M
    delta = seqlen_k - seqlen_q
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N  # key tiles below are visible to all of this half's rows
    if IS_CAUSAL:
        full_hi = gl.minimum(full_hi, gl.maximum(m0 + delta + 1, 0) // BLOCK_N * BLOCK_N)
    offs_m = m0 + gl.arange(0, HALF_M, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    qk_scale, m_i, l_i, acc, s_zero = row_state(qs_ptr, sm_scale, q_start, offs_m, seqlen_q, stride_qsm, head,
                                                 HEAD_DIM, BLOCK_N, IS_FP8, o_layout, s_layout)
    row_scale = qk_scale
    # ROWSUM_MMA: l2d holds the running fp32 row sums in every column (compiled away without ROWSUM_MMA)
    l_zero = gl.zeros([HALF_M, ONES_N], gl.float32, layout=l_layout)
    l2d = l_zero
    mbarrier.wait(q_bars.index(wg), it & 1)

    if n_tiles > 0:
        # round 0: S_0 alone
        mbarrier.wait(k_ready.index(cnt % NUM_BUF), (cnt // NUM_BUF) & 1)
        if PINGPONG:
            mbarrier.wait(my_turn, rnd & 1)
        s = warpgroup_mma(q_tile, k_smem.index(cnt % NUM_BUF).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        if PINGPONG:
            mbarrier.arrive(their_turn, count=1)
        if IS_FP8:  # one K scale per tile (prepare_fp8: per KV_SCALE_BLOCK keys)
            row_scale = qk_scale * _k_scale(ks_smem, cnt % NUM_BUF, ks_ptr, kv_start * stride_ksn + kv_head,
                                            row_s, STAGE_KS)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(cnt % NUM_BUF), count=1)
        p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, row_scale, 0, offs_m, offs_n, seqlen_k, delta,
                                           full_hi, IS_CAUSAL, BLOCK_N, not ROWSUM_MMA, P_LOG2, TAU)
        p_op = p_operand(p, p_layout, p_dtype, IS_FP8, HALF_M, BLOCK_N)
        for j in range(1, n_tiles):
            stage = (cnt + j) % NUM_BUF
            prev = (cnt + j - 1) % NUM_BUF
            mbarrier.wait(k_ready.index(stage), ((cnt + j) // NUM_BUF) & 1)
            mbarrier.wait(v_ready.index(prev), ((cnt + j - 1) // NUM_BUF) & 1)
            if PINGPONG:
                mbarrier.wait(my_turn, (rnd + j) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc, rs = _issue_pv(p_op, v_smem.index(prev), acc, ones_smem, l_zero, dtype, IS_FP8, ROWSUM_MMA)
            if PINGPONG:
                mbarrier.arrive(their_turn, count=1)
            if IS_FP8:
                row_scale = qk_scale * _k_scale(ks_smem, stage, ks_ptr, (kv_start + j * BLOCK_N) * stride_ksn + kv_head,
                                                row_s, STAGE_KS)
            if ROWSUM_MMA:
                s = warpgroup_mma_wait(2, deps=[s])  # S_j done; P V and P @ ones may still run
            else:
                s = warpgroup_mma_wait(1, deps=[s])  # S_j done; P_(j-1) V_(j-1) may still run
            mbarrier.arrive(k_empty.index(stage), count=1)
            p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, row_scale, j * BLOCK_N, offs_m, offs_n,
                                               seqlen_k, delta, full_hi, IS_CAUSAL, BLOCK_N, not ROWSUM_MMA,
                                               P_LOG2, TAU)
            if ROWSUM_MMA:
                acc, rs, p_op = warpgroup_mma_wait(0, deps=[acc, rs, p_op])
                # rows of P_(j-1) added in its max's scale, then all rescaled to this round's max
                l2d = (l2d + rs) * gl.expand_dims(gl.convert_layout(alpha, row_l), 1)
            else:
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(prev), count=1)
            if LAZY_RESCALE:
                acc = _rescale_o(acc, gl.convert_layout(alpha, row_o), HEAD_DIM)
            else:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = p_operand(p, p_layout, p_dtype, IS_FP8, HALF_M, BLOCK_N)
        mbarrier.arrive(q_empty.index(wg), count=1)  # every Q K^T of this tile retired
        # round n_tiles: the last P V, still in turn so both warpgroups run the same rounds
        last = cnt + n_tiles - 1
        mbarrier.wait(v_ready.index(last % NUM_BUF), (last // NUM_BUF) & 1)
        if PINGPONG:
            mbarrier.wait(my_turn, (rnd + n_tiles) & 1)
        acc, rs = _issue_pv(p_op, v_smem.index(last % NUM_BUF), acc, ones_smem, l_zero, dtype, IS_FP8, ROWSUM_MMA)
        if PINGPONG:
            mbarrier.arrive(their_turn, count=1)
        if ROWSUM_MMA:
            acc, rs, p_op = warpgroup_mma_wait(0, deps=[acc, rs, p_op])
            l2d = l2d + rs
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(v_empty.index(last % NUM_BUF), count=1)
    else:
        mbarrier.arrive(q_empty.index(wg), count=1)
    if ROWSUM_MMA:  # the columns are equal: max picks one, exactly
        l_i = gl.convert_layout(gl.max(l2d, 1), row_s)

    # deferred normalisation; rows that saw no key output 0
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    if IS_FP8:
        acc = acc * gl.load(v_scale_ptr + kv_head)
    if TMA_STORE and m0 + HALF_M <= seqlen_q:
        # rows past seqlen_q belong to the next sequence: only whole halves go by TMA
        o_buf = o_smem.index(wg)
        tma.store_wait(0)  # this buffer's previous store has been read out
        gl.thread_barrier()  # (the partition's named barrier) before any thread overwrites it
        o_buf.store(acc.to(o_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(desc_o, [q_start + m0, head * HEAD_DIM], o_buf)
    else:
        offs_mo = m0 + gl.arange(0, HALF_M, layout=row_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (o_ptr + gl.expand_dims((q_start + offs_mo).to(gl.int64) * stride_om, 1) + head * stride_oh
                  + gl.expand_dims(offs_d, 0))
        gl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(offs_mo < seqlen_q, 1))


@gluon.jit
def _ws_consumer(wg, q_smem, k_smem, v_smem, ks_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                 turn_bars, desc_o, o_smem, o_ptr, qs_ptr, ks_ptr, v_scale_ptr, sm_scale, stride_om, stride_oh,
                 stride_qsm, stride_ksn,
                 cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE,
                 GROUP: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_FP8: gl.constexpr,
                 NUM_BUF: gl.constexpr, PINGPONG: gl.constexpr, TMA_STORE: gl.constexpr, STAGE_KS: gl.constexpr,
                 ones_smem, ROWSUM_MMA: gl.constexpr, LAZY_RESCALE: gl.constexpr):
    """Consumer warpgroup `wg` over this program's work tiles (the producer's order)."""
    cnt = 0  # K/V tiles consumed so far: ring stage and phase
    it = 0  # work tiles so far: Q buffer phase
    rnd = 0  # wgmma rounds so far: turn phase
    for k in range(gl.cdiv(N_WORK, gl.num_programs(0))):
        q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head, kv_head, n_tiles = _tile_coords(
            k, cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE, GROUP, BLOCK_N,
            IS_CAUSAL)
        if n_tiles >= 0:
            _consume_tile(wg, q_smem, k_smem, v_smem, ks_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                          turn_bars, desc_o, o_smem, o_ptr, qs_ptr, ks_ptr, v_scale_ptr, sm_scale, stride_om,
                          stride_oh, stride_qsm, stride_ksn, q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head,
                          kv_head, n_tiles, cnt, it, rnd, HEAD_DIM, BLOCK_N, IS_CAUSAL, IS_FP8, NUM_BUF, PINGPONG,
                          TMA_STORE, STAGE_KS, ones_smem, ROWSUM_MMA, LAZY_RESCALE)
            cnt += n_tiles
            it += 1
            if n_tiles > 0:
                rnd += n_tiles + 1
    if TMA_STORE:
        tma.store_wait(0)  # the last tile's store has read its buffer before the program exits
