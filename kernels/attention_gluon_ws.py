"""
Hopper attention forward in Gluon with FlashAttention-3's full structure: warp specialization, two consumer
warpgroups ping-ponged over the tensor core, and the intra-warpgroup overlap of `attention_gluon.py`. As in
FA3, no CTA-wide barrier is left in the loop.

* Partitions (`gl.warp_specialize`): a producer (the default partition, 4 warps, few registers) issues every
  TMA load; two consumer warpgroups own the two 64-row halves of a 128-row query tile.
* K and V stages each have a "ready" mbarrier (TMA) and an "empty" one (count 2: each consumer arrives once
  its wgmma that read the stage has retired); K runs one round ahead of V.
* Ping-pong: each consumer waits on its own "turn" mbarrier before issuing a round (S_j = Q K_j^T and
  O += P_(j-1) V_(j-1)) and arrives on the other's right after, so the tensor core alternates between the
  rounds and each softmax runs under the other's round (Gluon 3.6 has no named barriers).
* PERSISTENT grid (one program per SM, `_tile_coords`): the producer's ring runs on across work tiles.
* TMA_STORE: a 64-row half leaves through shared memory and one TMA store. STAGE_KS (fp8): the producer puts
  each K tile's scale in shared memory, so no round waits on a global load.
* ROWSUM_MMA (fp8, hd128): the row sums come from a P @ ones wgmma issued with P V instead of BLOCK_N / 2
  FADDs a thread and round. Each round's sum starts fresh (use_acc=False: the fp8 wgmma's reduced-precision
  accumulation sums one tile, never a whole row, which drifts) and is added to fp32 sums. P is computed times
  2^8 so that small probabilities are normal e4m3 numbers, not subnormals.
* LAZY_RESCALE (FA4's conditional rescale): a row's max is raised only when a tile's logits exceed it by more
  than TAU (log2 units; `softmax_tile`), and a warp skips the O rescale when none of its 16 rows raised it
  (`_rescale_o`). l uses the same max: the same softmax.

`attention_select` picks it for fp8 and for 16-bit rows past the short ones; `_default_config` holds which
flag pays where (H200), bench/archive/NOTES_attention.md the measurements. Scope as `attention_gluon.py`, fp8 included.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantkit.kernels.attention_gluon_common import (
    make_descriptors,
    p_operand,
    pv,
    row_state,
    smem_layout,
    softmax_tile,
)
from quantkit.kernels.attention_select import WsConfig
from quantkit.kernels.device_info import num_sms

HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)
_HALF_M = HALF_M.value
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


# STAGE_KS: the producer's 4 warps hold a K scale as HALF_M copies and store them to a plain shared row;
# each consumer reads the copies of its own rows (the S rows' layout)
KS_REG_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
KS_SMEM_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
# ROWSUM_MMA: N of the P @ ones wgmma (the smallest) and the layout the 4 pre-partition warps write ones from
ONES_N = gl.constexpr(8)
ONES_REG_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0]))


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
def _tile_coords(k, cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE,
                 GROUP: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """This program's k-th work tile -> (q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head, kv_head, n_tiles);
    n_tiles < 0: nothing to do (past the last tile, or a query block past its sequence's end).

    Order: groups of SWIZZLE (sequence, head) pairs, query block slowest inside a group, heaviest first. Round k
    hands tiles k * P .. k * P + P - 1 to the P programs, reversed on odd rounds (zigzag), which evens out the
    causal work per program. SWIZZLE = 1 keeps concurrent programs on a few K/V heads (L2); the launcher raises
    it to all pairs when one head's query blocks alone would fill the machine."""
    n_prog = gl.num_programs(0)
    pid = gl.program_id(0)
    t = k * n_prog + pid + (k % 2) * (n_prog - 1 - 2 * pid)
    valid = t < N_WORK
    t = gl.minimum(t, N_WORK - 1)
    n_pairs = N_WORK // NUM_M_BLOCKS
    grp = t // (SWIZZLE * NUM_M_BLOCKS)
    size = gl.minimum(n_pairs - grp * SWIZZLE, SWIZZLE)
    r = t - grp * SWIZZLE * NUM_M_BLOCKS
    pid_m = NUM_M_BLOCKS - 1 - r // size
    pair = grp * SWIZZLE + r % size
    seq = pair % N_SEQ
    head = pair // N_SEQ
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_start = gl.load(cu_seqlens_k_ptr + seq)
    seqlen_k = gl.load(cu_seqlens_k_ptr + seq + 1) - kv_start
    blk_m0 = pid_m * (2 * HALF_M)
    # key tiles of the whole 128-row block: the ping-pong needs both warpgroups to run the same rounds;
    # tiles a half does not see are masked by its softmax
    hi = seqlen_k
    if IS_CAUSAL:
        hi = gl.minimum(seqlen_k, blk_m0 + 2 * HALF_M + seqlen_k - seqlen_q)
    n_tiles = (gl.maximum(hi, 0) + BLOCK_N - 1) // BLOCK_N
    if blk_m0 >= seqlen_q or not valid:
        n_tiles = -1
    return q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head, head // GROUP, n_tiles


@gluon.jit
def _ws_producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, ks_smem, ks_ptr, stride_ksn, q_bars, q_empty,
                 k_ready, v_ready, k_empty, v_empty, cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK,
                 SWIZZLE, GROUP: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 IS_FP8: gl.constexpr, STAGE_KS: gl.constexpr):
    """TMA for every work tile of this program: the two Q halves (once their consumer has retired its last
    Q K^T of the previous tile), then K_j one step ahead of V_(j-1), each once both consumers released the
    stage (fresh mbarriers count as released: wait on phase 1). STAGE_KS: the K tile's scale goes to the
    stage's ks_smem row, then a second arrive on its k_ready (count 2)."""
    cnt = 0  # K/V tiles issued so far: ring stage and phase
    it = 0  # work tiles so far: Q buffer phase
    for k in range(gl.cdiv(N_WORK, gl.num_programs(0))):
        q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head, kv_head, n_tiles = _tile_coords(
            k, cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE, GROUP, BLOCK_N,
            IS_CAUSAL)
        kv_col = kv_head * HEAD_DIM
        if n_tiles >= 0:
            for h in gl.static_range(2):
                mbarrier.wait(q_empty.index(h), (it & 1) ^ 1)
                mbarrier.expect(q_bars.index(h), desc_q.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_q, [q_start + blk_m0 + h * HALF_M, head * HEAD_DIM],
                                                q_bars.index(h), q_smem.index(h))
            for j in range(n_tiles + 1):
                if j < n_tiles:
                    stage = (cnt + j) % NUM_BUF
                    if STAGE_KS:  # issued before the wait, which hides its latency
                        ks = gl.load(ks_ptr + (kv_start + j * BLOCK_N) * stride_ksn + kv_head
                                     + gl.zeros([HALF_M], gl.int32, layout=KS_REG_LAYOUT))
                    mbarrier.wait(k_empty.index(stage), (((cnt + j) // NUM_BUF) & 1) ^ 1)
                    mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
                    tma.async_copy_global_to_shared(desc_k, [kv_start + j * BLOCK_N, kv_col], k_ready.index(stage),
                                                    k_smem.index(stage))
                    if STAGE_KS:
                        ks_smem.index(stage).store(ks)
                        gl.thread_barrier()  # every producer thread's store before the (one-thread) arrive
                        mbarrier.arrive(k_ready.index(stage), count=1)
                if j > 0:
                    stage = (cnt + j - 1) % NUM_BUF
                    mbarrier.wait(v_empty.index(stage), (((cnt + j - 1) // NUM_BUF) & 1) ^ 1)
                    mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
                    row = kv_start + (j - 1) * BLOCK_N
                    if IS_FP8:  # V^T storage (Hkv * D, tokens): a [D, BLOCK_N] box
                        tma.async_copy_global_to_shared(desc_v, [kv_col, row], v_ready.index(stage),
                                                        v_smem.index(stage))
                    else:
                        tma.async_copy_global_to_shared(desc_v, [row, kv_col], v_ready.index(stage),
                                                        v_smem.index(stage))
            cnt += n_tiles
            it += 1


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


@gluon.jit
def _attn_fwd_ws(desc_q, desc_k, desc_v, desc_o, o_ptr, qs_ptr, ks_ptr, v_scale_ptr,
                 cu_seqlens_q_ptr, cu_seqlens_k_ptr, sm_scale,
                 stride_om, stride_oh, stride_qsm, stride_ksn, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, NUM_BUF: gl.constexpr,
                 PINGPONG: gl.constexpr, TMA_STORE: gl.constexpr, STAGE_KS: gl.constexpr,
                 ROWSUM_MMA: gl.constexpr, LAZY_RESCALE: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid: up to one program per SM looping over its work tiles (`_tile_coords`; N_WORK = query blocks x
    sequences x heads; a grid of N_WORK programs runs one tile each)."""
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], desc_k.layout)
    if IS_FP8:  # V^T tiles [D, BLOCK_N]: fp8 wgmma wants B K-major
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, HEAD_DIM, BLOCK_N], desc_v.layout)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], desc_v.layout)
    if TMA_STORE:  # one 64-row output buffer per consumer warpgroup
        o_smem = gl.allocate_shared_memory(desc_o.dtype, [2, HALF_M, HEAD_DIM], desc_o.layout)
    else:
        o_smem = q_smem  # placeholder, never used
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if STAGE_KS:  # fp8: the K tile's scale, written by the producer for each consumer row
        ks_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, HALF_M], KS_SMEM_LAYOUT)
    else:
        ks_smem = q_bars  # placeholder, never used
    if ROWSUM_MMA:  # fp8: the B operand of P @ ones, K-major [ONES_N, BLOCK_N] (viewed as [BLOCK_N, ONES_N])
        ones_smem = gl.allocate_shared_memory(dtype, [ONES_N, BLOCK_N],
                                              gl.NVMMASharedLayout.get_default_for([ONES_N, BLOCK_N], dtype))
        # e4m3 1.0 is the byte 0x38 (Gluon makes no fp8 constants), one byte a register: converting 4 values a
        # thread from fp32 made Triton 3.6 store wrong bytes (bench/archive/NOTES_attention.md)
        ones_smem.store(gl.full([ONES_N, BLOCK_N], 0x38, gl.int8, layout=ONES_REG_LAYOUT).to(dtype, bitcast=True))
    else:
        ones_smem = q_smem  # placeholder, never used
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # released by its own warpgroup
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(i), count=2 if STAGE_KS else 1)  # TMA bytes (+ the producer's K scale)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.arrive(turn_bars.index(0), count=1)  # warpgroup 0 has the first turn
    fence_async_shared()  # (also orders the ones tile's stores before the consumers' wgmmas read it)

    # the consumers' arguments are written out: a tuple concatenation would make the constexprs run-time values
    gl.warp_specialize([
        (_ws_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, ks_smem, ks_ptr, stride_ksn, q_bars, q_empty,
                        k_ready, v_ready, k_empty, v_empty, cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ,
                        N_WORK, SWIZZLE,
                        GROUP, HEAD_DIM, BLOCK_N, NUM_BUF, IS_CAUSAL, IS_FP8, STAGE_KS)),
        (_ws_consumer, (0, q_smem, k_smem, v_smem, ks_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                        turn_bars, desc_o, o_smem, o_ptr, qs_ptr, ks_ptr, v_scale_ptr, sm_scale, stride_om, stride_oh,
                        stride_qsm, stride_ksn,
                        cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE,
                        GROUP, HEAD_DIM, BLOCK_N, IS_CAUSAL, IS_FP8, NUM_BUF, PINGPONG, TMA_STORE, STAGE_KS,
                        ones_smem, ROWSUM_MMA, LAZY_RESCALE)),
        (_ws_consumer, (1, q_smem, k_smem, v_smem, ks_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                        turn_bars, desc_o, o_smem, o_ptr, qs_ptr, ks_ptr, v_scale_ptr, sm_scale, stride_om, stride_oh,
                        stride_qsm, stride_ksn,
                        cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE,
                        GROUP, HEAD_DIM, BLOCK_N, IS_CAUSAL, IS_FP8, NUM_BUF, PINGPONG, TMA_STORE, STAGE_KS,
                        ones_smem, ROWSUM_MMA, LAZY_RESCALE)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def _default_config(head_dim, fp8, max_seqlen_q):
    """The WsConfig measured fastest on the H200 (bench/archive/NOTES_attention.md): 128-key tiles, the ring as deep as
    shared memory allows; fp8 without ping-pong (its MMAs are half as long); TMA_STORE up to 8192 rows (bf16) and
    at fp8 hd128; STAGE_KS at fp8; ROWSUM_MMA at fp8 hd128; LAZY_RESCALE for bf16 hd128 up to 8192 rows."""
    if fp8:
        return WsConfig(128, 4, True, False, head_dim == 128, True, head_dim == 128, False)
    short = max_seqlen_q <= 8192
    return WsConfig(128, 2 if head_dim == 128 else 4, True, True, short, False, False, short and head_dim == 128)


def _full_config(config, head_dim, fp8, max_seqlen_q) -> WsConfig:
    """A WsConfig, or a tuple of its first 2-8 fields completed with its defaults; None: `_default_config`."""
    if not config:
        return _default_config(head_dim, fp8, max_seqlen_q)
    return WsConfig(*config)


# One CTA of 3 warpgroups per SM: maxnreg 168 caps it at 168 * 384 = 64512 registers; the consumers take
# CONSUMER_REGS each, the producer the rest (FA3: 240 / 240 / 24).
MAXNREG = 168
CONSUMER_REGS = 240


def attention_ws(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=False, sm_scale=None,
                        config=None, fp8_prepared=None, out=None):
    """`attention_gluon.attention_fa3_ordered`'s contract (the cases `gluon_attention_supports` accepts), plus
    fp8_prepared (`attention_fp8`). q: (total_q, Hq, D); k, v: (total_k, Hkv, D), bf16/fp16; cu_seqlens_*:
    (B + 1,) int32. config: `attention_select.WsConfig` or a shorter tuple (flags in the module docstring;
    STAGE_KS and ROWSUM_MMA apply to fp8 only); None: `_default_config`. Query tiles are 128 rows (2 x 64).
    out: optional (total_q, Hq, D) buffer to write (tests pass a NaN-poisoned one).
    Returns (total_q, Hq, D) in q's dtype."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv_heads = k.shape[1]
    assert n_heads % n_kv_heads == 0
    sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    fp8 = fp8_prepared is not None
    block_n, num_buf, persistent, pingpong, tma_store, stage_ks, rowsum_mma, lazy_rescale = _full_config(
        config, head_dim, fp8, max_seqlen_q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    desc_q, desc_k, desc_v, q_scale, k_scale, v_scale = make_descriptors(
        q, k, v, _HALF_M, block_n, fp8_prepared, out)
    desc_o = _output_descriptor(out) if tma_store else desc_q  # (a placeholder without the TMA store)
    n_m_blocks = triton.cdiv(max_seqlen_q, 2 * _HALF_M)
    n_work = n_m_blocks * (cu_seqlens_q.numel() - 1) * n_heads
    n_prog = n_work if not persistent else min(n_work, num_sms(q.device))
    # all (sequence, head) pairs in one group when one head's query blocks nearly fill the grid
    swizzle = n_work // n_m_blocks if causal and 2 * n_m_blocks > n_prog else 1
    _attn_fwd_ws[(n_prog, )](desc_q, desc_k, desc_v, desc_o, out, q_scale, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k,
                             sm_scale, out.stride(0), out.stride(1),
                             q_scale.stride(0) if fp8 else 0, k_scale.stride(0) if fp8 else 0, n_m_blocks,
                             cu_seqlens_q.numel() - 1, n_work, swizzle, GROUP=n_heads // n_kv_heads,
                             HEAD_DIM=head_dim,
                             BLOCK_N=block_n, IS_CAUSAL=causal, IS_FP8=fp8, NUM_BUF=num_buf, PINGPONG=pingpong,
                             TMA_STORE=bool(tma_store), STAGE_KS=bool(stage_ks and fp8),
                             ROWSUM_MMA=bool(rowsum_mma and fp8), LAZY_RESCALE=bool(lazy_rescale),
                             CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG)
    return out


def _output_descriptor(out):
    """TMA descriptor of out (total_q, Hq, D) as (total_q, Hq * D), boxes of 64 rows of one head."""
    head_dim = out.shape[2]
    o2d = out.view(out.shape[0], out.shape[1] * head_dim)
    layout = smem_layout(_HALF_M, head_dim, _GL_DTYPE[out.dtype])
    return TensorDescriptor(o2d, list(o2d.shape), [o2d.stride(0), 1], [_HALF_M, head_dim], layout)
