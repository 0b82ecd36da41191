"""The building blocks both Gluon attention kernels use (:mod:`quantkit.kernels.attention_gluon`, FA3-ordered,
and :mod:`quantkit.kernels.attention_gluon_ws`, warp-specialized): the online-softmax tile, the P operand and
P @ V wgmma, the per-row softmax state, and the TMA descriptors with their shared layouts. Public within the
package: the backends import them by these names. Layout and masks as in :mod:`quantkit.kernels.attention`.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quantkit.kernels.attention_fp8 import KV_SCALE_BLOCK


@gluon.jit
def softmax_tile(s, m_i, l_i, qk_scale, start_n, offs_m, offs_n, seqlen_k, delta, full_hi,
                  IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, ROW_SUM: gl.constexpr, P_LOG2: gl.constexpr,
                  TAU: gl.constexpr):
    """Online softmax of one logit tile s [BLOCK_M, BLOCK_N] (fp32, unscaled; qk_scale per row, log2(e)
    included): returns (p = exp2(scaled logits - new row max), new m, new l, alpha). ROW_SUM False: l_i is
    returned as given (the caller sums p). P_LOG2: p scaled by 2**P_LOG2 (every tile alike: cancels in O / l).
    TAU > 0 (log2 units): m is a stale bound, raised only when the tile's max exceeds it by more than TAU (or
    it is -inf); so p <= 2**(P_LOG2 + TAU) and alpha is exactly 1 for rows not raised, whose O rescale the
    caller may skip (LAZY_RESCALE). O and l use the same m: the same softmax."""
    if start_n + BLOCK_N > full_hi:  # the causal diagonal or the ragged end: mask
        # key start_n + c is visible iff c < lim (per row if causal): one compare a logit
        lim = seqlen_k - start_n
        if IS_CAUSAL:
            keep = gl.expand_dims(offs_n, 0) < gl.expand_dims(gl.minimum(offs_m + (delta + 1 - start_n), lim), 1)
        else:
            keep = gl.expand_dims(offs_n, 0) < lim
        s = gl.where(keep, s * gl.expand_dims(qk_scale, 1), float("-inf"))
        if TAU > 0:
            m_tile = gl.max(s, 1)
            m_new = gl.where(m_tile > m_i + TAU, m_tile, m_i)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = gl.exp2(s - gl.expand_dims(m_safe - P_LOG2, 1))
    else:
        if TAU > 0:
            m_tile = gl.max(s, 1) * qk_scale
            m_new = gl.where(m_tile > m_i + TAU, m_tile, m_i)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_safe = m_new
        p = gl.exp2(s * gl.expand_dims(qk_scale, 1) - gl.expand_dims(m_new - P_LOG2, 1))
    alpha = gl.exp2(m_i - m_safe)
    if ROW_SUM:
        l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def p_operand(p, p_layout: gl.constexpr, out_dtype: gl.constexpr, IS_FP8: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """P (fp32, accumulator layout) -> the A operand of a P @ V wgmma, in out_dtype. fp8: key columns renamed
    as `attention_triton._perm_keys` (then the two layouts are the same registers; V^T is stored in that order).
    fp8 out_dtype: e4m3 where P is used in the same iteration, fp16 where it crosses the loop's back edge (an
    8-bit loop value is carried a byte a register and repacked; `pv` converts it just before the wgmma)."""
    if IS_FP8:
        p = gl.reshape(gl.permute(gl.reshape(p, [BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2]), [0, 1, 2, 4, 3, 5]),
                       [BLOCK_M, BLOCK_N])
        return gl.convert_layout(p, p_layout, assert_trivial=True).to(out_dtype)
    else:
        return gl.convert_layout(p.to(out_dtype), p_layout)


@gluon.jit
def pv(p_op, v_tile, acc, dtype: gl.constexpr, IS_FP8: gl.constexpr):
    """Issue acc += P V (async); fp8: P to e4m3 if it is not yet, the V^T tile viewed as V."""
    if IS_FP8:
        return warpgroup_mma(p_op.to(dtype), v_tile.permute((1, 0)), acc, is_async=True)
    else:
        return warpgroup_mma(p_op, v_tile, acc, is_async=True)


@gluon.jit
def row_state(qs_ptr, sm_scale, q_start, offs_m, seqlen_q, stride_qsm, head, HEAD_DIM: gl.constexpr,
               BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, o_layout: gl.constexpr, s_layout: gl.constexpr):
    """Start of the online softmax for rows ``offs_m``: the per-row exp2 scale (sm_scale * log2(e), fp8: times
    the q scale; the loop adds the k scale), running max and sum, O accumulator and a zero S accumulator."""
    rows: gl.constexpr = offs_m.shape[0]
    row_layout: gl.constexpr = offs_m.type.layout
    qk_scale = gl.full([rows], sm_scale * 1.4426950408889634, gl.float32, layout=row_layout)
    if IS_FP8:
        qk_scale = qk_scale * gl.load(qs_ptr + (q_start + offs_m) * stride_qsm + head, mask=offs_m < seqlen_q,
                                      other=0.0)
    m_i = gl.full([rows], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([rows], gl.float32, layout=row_layout)
    acc = gl.zeros([rows, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([rows, BLOCK_N], gl.float32, layout=s_layout)
    return qk_scale, m_i, l_i, acc, s_zero


@functools.cache
def smem_layout(rows: int, cols: int, dtype) -> gl.NVMMASharedLayout:
    """The wgmma/TMA shared layout of a [rows, cols] tile of Gluon ``dtype``, cached: building one validates
    and costs host time on every launch (bench/archive/NOTES_attention.md)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


def make_descriptors(q, k, v, block_q, block_n, fp8_prepared, placeholder):
    """TMA descriptors shared by the Gluon kernels: (desc_q, desc_k, desc_v, q_scale, k_scale, v_scale).

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D) 16-bit. 2-D views (tokens, H * D), so one descriptor serves
    every head and sequence; boxes [block_q, D] (Q), [block_n, D] (K, V). fp8_prepared: the fp8 operands
    (`attention_fp8`), V^T boxes [D, block_n]; None: 16-bit, the scales are `placeholder` (never read)."""

    total_q, n_heads, head_dim = q.shape
    total_k, n_kv_heads, _ = k.shape
    q_scale = k_scale = v_scale = placeholder
    fp8 = fp8_prepared is not None
    if fp8:
        q, q_scale, k, k_scale, v, v_scale = fp8_prepared
        assert v.dtype == torch.float8_e4m3fn, "the gluon kernels run P @ V in fp8 too"
        assert KV_SCALE_BLOCK % block_n == 0 and block_n % 32 == 0
        gdt = gl.float8e4nv
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = smem_layout(block_q, head_dim, gdt)
    kv_layout = smem_layout(block_n, head_dim, gdt)
    desc_q = TensorDescriptor(q, [total_q, n_heads * head_dim], [n_heads * head_dim, 1], [block_q, head_dim],
                              q_layout)
    desc_k = TensorDescriptor(k, [total_k, n_kv_heads * head_dim], [n_kv_heads * head_dim, 1],
                              [block_n, head_dim], kv_layout)
    if fp8:
        vt_layout = smem_layout(head_dim, block_n, gdt)
        desc_v = TensorDescriptor(v, [n_kv_heads * head_dim, v.stride(2)], [v.stride(2), 1], [head_dim, block_n],
                                  vt_layout)
    else:
        desc_v = TensorDescriptor(v, [total_k, n_kv_heads * head_dim], [n_kv_heads * head_dim, 1],
                                  [block_n, head_dim], kv_layout)
    return desc_q, desc_k, desc_v, q_scale, k_scale, v_scale
