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

Modules: this one holds the producer partition, the kernel and its launcher (`attention_ws`); the consumer
warpgroups are in `attention_gluon_ws_consumer.py`, what both partitions share (HALF_M, the K-scale and ones
layouts, the work-tile order) in `attention_gluon_ws_tiles.py`.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantkit.kernels.attention_gluon_common import make_descriptors, smem_layout
from quantkit.kernels.attention_gluon_ws_consumer import _ws_consumer
from quantkit.kernels.attention_gluon_ws_tiles import (
    HALF_M,
    KS_REG_LAYOUT,
    KS_SMEM_LAYOUT,
    ONES_N,
    ONES_REG_LAYOUT,
    _tile_coords,
)
from quantkit.kernels.attention_select import WsConfig
from quantkit.kernels.device_info import num_sms

_HALF_M = HALF_M.value
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


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
