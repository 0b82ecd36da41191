"""
Hopper attention forward in Gluon (`triton.experimental.gluon`): FlashAttention-3's overlap of softmax and
tensor cores, which Triton 3.6 does not produce (it waits for every wgmma right after issuing it). With
Gluon's asynchronous wgmma and explicit wait, each key tile j is ordered as FA3's intra-warpgroup pipelining:

    issue S_j = Q K_j^T        (async)
    issue O  += P_{j-1} V_{j-1} (async, P_{j-1} from registers)
    wait until S_j is done     (P V may still run)
    softmax(S_j) -> P_j         <- runs under the P V wgmma
    wait for P V; O *= alpha_j

K/V tiles stream through NUM_BUF shared-memory stages filled by TMA (an mbarrier per tile and operand); a stage
is refilled once every warpgroup has retired the P V that read it (a CTA barrier per tile). `attention_select`
runs it for short causal rows.

Scope: bf16/fp16, head dim 64/128, causal or not, packed varlen, GQA, layout as in `attention.py` (the front
door, which calls :func:`attention_fa3_ordered`); no window or soft-cap (the Triton kernel) and no fp8 (the
warp-specialized kernel). The building blocks it shares with that kernel are in `attention_gluon_common.py`.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from quantkit.kernels.attention_gluon_common import make_descriptors, p_operand, pv, row_state, softmax_tile
from quantkit.kernels.attention_select import AttentionTiles


@gluon.jit
def _load_kv(desc_k, desc_v, k_smem, v_smem, k_bars, v_bars, tile, n_tiles, kv_start, kv_col,
             BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr):
    """TMA of key tile `tile` (K and V, each on its own barrier) into stage tile % NUM_BUF."""
    stage = tile % NUM_BUF
    pred = tile < n_tiles
    row = kv_start + tile * BLOCK_N
    mbarrier.expect(k_bars.index(stage), desc_k.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_k, [row, kv_col], k_bars.index(stage), k_smem.index(stage), pred=pred)
    mbarrier.expect(v_bars.index(stage), desc_v.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_v, [row, kv_col], v_bars.index(stage), v_smem.index(stage), pred=pred)


@gluon.jit
def _attn_fwd_gluon(desc_q, desc_k, desc_v, o_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, sm_scale,
                    stride_om, stride_oh, NUM_M_BLOCKS,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = desc_q.dtype
    MMA_K: gl.constexpr = 16  # wgmma k: 32 bytes of each 16-bit operand
    # one warp per 16 rows; S = Q K^T [BLOCK_M, BLOCK_N] and O [BLOCK_M, HEAD_DIM] accumulators
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, MMA_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    pid_m = gl.program_id(0)
    if IS_CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m  # heaviest query blocks first
    seq = gl.program_id(1)
    head = gl.program_id(2)
    kv_head = head // GROUP
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_start = gl.load(cu_seqlens_k_ptr + seq)
    seqlen_k = gl.load(cu_seqlens_k_ptr + seq + 1) - kv_start
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    delta = seqlen_k - seqlen_q
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N  # tiles below are visible to every row
    if IS_CAUSAL:
        hi = gl.minimum(seqlen_k, m0 + BLOCK_M + delta)
        full_hi = gl.minimum(full_hi, gl.maximum(m0 + delta + 1, 0) // BLOCK_N * BLOCK_N)
    hi = gl.maximum(hi, 0)
    n_tiles = (hi + BLOCK_N - 1) // BLOCK_N
    kv_col = kv_head * HEAD_DIM

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], desc_v.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    # Q rows past this sequence belong to the next one: harmless, their outputs are not stored
    mbarrier.expect(q_bar, desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)
    for t in gl.static_range(NUM_BUF):
        _load_kv(desc_k, desc_v, k_smem, v_smem, k_bars, v_bars, t, n_tiles, kv_start, kv_col, BLOCK_N, NUM_BUF)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    qk_scale, m_i, l_i, acc, s_zero = row_state(o_ptr, sm_scale, q_start, offs_m, seqlen_q, 0, head,
                                                 HEAD_DIM, BLOCK_N, False, o_layout, s_layout)
    mbarrier.wait(q_bar, 0)

    if n_tiles > 0:
        # tile 0: S_0 and its softmax (nothing to overlap with yet)
        mbarrier.wait(k_bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, qk_scale, 0, offs_m, offs_n, seqlen_k, delta,
                                           full_hi, IS_CAUSAL, BLOCK_N, True, 0, 0)
        p_op = p_operand(p, p_layout, dtype, False, BLOCK_M, BLOCK_N)
        for j in range(1, n_tiles):
            stage = j % NUM_BUF
            prev = (j - 1) % NUM_BUF
            mbarrier.wait(k_bars.index(stage), (j // NUM_BUF) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            mbarrier.wait(v_bars.index(prev), ((j - 1) // NUM_BUF) & 1)
            acc = pv(p_op, v_smem.index(prev), acc, dtype, False)
            s = warpgroup_mma_wait(1, deps=[s])  # S_j done; P_{j-1} V_{j-1} may still run
            p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, qk_scale, j * BLOCK_N, offs_m, offs_n,
                                               seqlen_k, delta, full_hi, IS_CAUSAL, BLOCK_N, True, 0, 0)
            acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = p_operand(p, p_layout, dtype, False, BLOCK_M, BLOCK_N)
            # both warpgroups have retired the wgmmas that read stage `prev`: refill it
            gl.thread_barrier()
            _load_kv(desc_k, desc_v, k_smem, v_smem, k_bars, v_bars, j - 1 + NUM_BUF, n_tiles, kv_start,
                     kv_col, BLOCK_N, NUM_BUF)
        last = n_tiles - 1
        mbarrier.wait(v_bars.index(last % NUM_BUF), (last // NUM_BUF) & 1)
        acc = pv(p_op, v_smem.index(last % NUM_BUF), acc, dtype, False)
        acc = warpgroup_mma_wait(0, deps=[acc])

    # deferred normalisation; rows that saw no key output 0
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    offs_mo = m0 + gl.arange(0, BLOCK_M, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    o_ptrs = (o_ptr + gl.expand_dims((q_start + offs_mo).to(gl.int64) * stride_om, 1) + head * stride_oh
              + gl.expand_dims(offs_d, 0))
    gl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(offs_mo < seqlen_q, 1))


def _default_config(head_dim) -> AttentionTiles:
    """(BLOCK_M, BLOCK_N, num_warps, NUM_BUF), from the H200 sweep: at head dim 128, 64-row tiles with one
    warpgroup run two programs per SM, whose phases interleave."""
    return AttentionTiles(64, 64, 4, 3) if head_dim == 128 else AttentionTiles(128, 128, 8, 5)


def attention_fa3_ordered(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=False, sm_scale=None,
                           config=None):
    """`attention.attention_varlen`'s contract for the 16-bit cases `attention_select.gluon_attention_supports`
    accepts: q: (total_q, Hq, D); k, v: (total_k, Hkv, D), bf16/fp16; cu_seqlens_*: (B + 1,) int32. config:
    `AttentionTiles` (BLOCK_M, BLOCK_N, num_warps, NUM_BUF). Returns (total_q, Hq, D) in q's dtype."""
    head_dim = q.shape[-1]
    sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    block_m, block_n, num_warps, num_buf = AttentionTiles(*config) if config else _default_config(head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    desc_q, desc_k, desc_v, *_ = make_descriptors(q, k, v, block_m, block_n, None, out)
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    assert n_heads % n_kv_heads == 0
    n_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    grid = (n_m_blocks, cu_seqlens_q.numel() - 1, n_heads)
    _attn_fwd_gluon[grid](desc_q, desc_k, desc_v, out, cu_seqlens_q, cu_seqlens_k, sm_scale, out.stride(0),
                          out.stride(1), n_m_blocks, GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim,
                          BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=causal, NUM_BUF=num_buf,
                          num_warps=num_warps)
    return out

