"""
The Triton backend of attention (FlashAttention-2/3 style forward, tuned for Hopper), behind the front door
:mod:`quantkit.kernels.attention`, whose docstring gives the layout and the masks.
* FA2: one program per (query block, sequence, query head); Q in registers, K/V tiles through shared memory
  (TMA descriptors on Hopper, USE_TMA), the loop software-pipelined (num_stages); online softmax with the
  division deferred and log2(e) folded into the exp2 scale. Fully masked key blocks are never visited; the
  rest splits into a masked prologue (window edge), an unmasked middle and a masked epilogue (causal diagonal,
  ragged end): one loop body with a constexpr MASK.
* FP8 e4m3 (q, k, v and P): per-token q and per-block K scales folded into the per-row exp2 scale, a per-head
  v scale, optional Hadamard rotation of q and k to spread outliers.
* FP8 P @ V without a shuffle: per 32 keys a thread holds accumulator columns {8j + 2t + b} of S (hence P)
  but wgmma's register A operand needs columns {16h + 4t + e} (t = lane % 4; j < 4, b < 2, h < 2, e < 4).
  The sum over keys ignores their order, so `_perm_keys` renames P's columns in registers and V is read in
  the same permuted key order (`prepare_fp8` stores V^T that way).

Triton 3.6 waits for each wgmma right after issuing it (no softmax / tensor-core overlap), so on Hopper
`backend="auto"` runs the Gluon kernels where they apply (`attention_select`). Entry: :func:`triton_forward`.
"""
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from quantkit.kernels.attention_fp8 import KV_SCALE_BLOCK, kv_starts_aligned
from quantkit.kernels.attention_select import AttentionTiles


@triton.jit
def _perm_keys(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rename P's key columns (module docstring): in each 32-key chunk, column c = (jh, jl, t, b) (bits, high
    to low: 1, 1, 2, 1) moves to a = (jh, t, jl, b)."""
    p = tl.reshape(p, [BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2])
    p = tl.permute(p, [0, 1, 2, 4, 3, 5])
    return tl.reshape(p, [BLOCK_M, BLOCK_N])


@triton.jit
def _load_rows(desc, ptr, kv_start, start_n, offs_n, offs_d, kv_col, seqlen_k, stride_n, stride_d,
               MASK: tl.constexpr, USE_TMA: tl.constexpr):
    """K or V tile [BLOCK_N, HEAD_DIM] of keys start_n.. of this sequence, token-major storage."""
    if USE_TMA:
        # Rows past this sequence (the next one's, or TMA's zero fill) are harmless: the MASK path
        # sets their logits to -inf (K) and P to 0 (V).
        tile = desc.load([kv_start + start_n, kv_col])
    else:
        cols = start_n + offs_n
        ptrs = ptr + (kv_start + cols)[:, None] * stride_n + offs_d[None, :] * stride_d
        if MASK:
            tile = tl.load(ptrs, mask=(cols < seqlen_k)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _load_v(desc_v, v_ptr, kv_start, start_n, offs_n, offs_d, kv_col, seqlen_k, stride_vn, stride_vd,
            MASK: tl.constexpr, V_TRANS: tl.constexpr, V_TMA: tl.constexpr):
    """V tile [BLOCK_N, HEAD_DIM]; for fp8 (V_TRANS) its rows in the key order of _perm_keys."""
    if V_TRANS:
        # FP8 wgmma wants both operands K-major: V is stored (D, tokens), permuted inside each 32-token
        # chunk (prepare_fp8), so a tile starting on a multiple of 32 holds keys in _perm_keys order.
        if V_TMA:
            v = desc_v.load([kv_col, kv_start + start_n]).T
        else:
            # column a of the tile needs key c(a) of the sequence, stored at position pos(token)
            c = (offs_n & -15) | ((offs_n & 2) << 2) | ((offs_n & 12) >> 1)
            tok = kv_start + start_n + c
            pos = (tok & -15) | ((tok & 8) >> 2) | ((tok & 6) << 1)
            v_ptrs = v_ptr + pos[None, :] * stride_vn + offs_d[:, None] * stride_vd
            if MASK:
                v = tl.load(v_ptrs, mask=(start_n + c < seqlen_k)[None, :], other=0.0).T
            else:
                v = tl.load(v_ptrs).T
    else:
        v = _load_rows(desc_v, v_ptr, kv_start, start_n, offs_n, offs_d, kv_col, seqlen_k, stride_vn, stride_vd,
                       MASK, V_TMA)
    return v


@triton.jit
def _update(acc, l_i, m_i, qk, qk_scale, softcap_log2, inv_softcap,
            v_ptr, desc_v, ks_ptr, kv_start, start_n, seqlen_k, delta, window_left,
            offs_m, offs_n, offs_d, kv_col, stride_vn, stride_vd, stride_ksn,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, IS_FP8: tl.constexpr, V_TRANS: tl.constexpr, V_TMA: tl.constexpr):
    """Online softmax of one logit tile qk [BLOCK_M, BLOCK_N] (keys start_n..), acc += P V."""
    cols = start_n + offs_n
    if IS_FP8:
        # one K scale per KV_SCALE_BLOCK keys, so one scalar per tile, folded into the per-row scale
        ks = tl.load(ks_ptr + (kv_start + start_n) * stride_ksn)
        qk_scale = qk_scale * ks
        inv_softcap = inv_softcap * ks
    if HAS_SOFTCAP:
        # cap * tanh(s / cap) in log2 units; tanh through exp2 so the interpreter runs it too
        x = qk * inv_softcap[:, None]
        qk = softcap_log2 * (1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0))
    if MASK:
        if not HAS_SOFTCAP:
            qk = qk * qk_scale[:, None]
        keep = cols[None, :] < seqlen_k
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + delta)
        if HAS_WINDOW:
            keep = keep & (cols[None, :] >= offs_m[:, None] + delta - window_left)
        qk = tl.where(keep, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        # a row may have seen no key yet: keep exp2 arguments finite (-inf - -inf = NaN)
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk - m_safe[:, None])
    elif HAS_SOFTCAP:
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = m_ij
        p = tl.math.exp2(qk - m_ij[:, None])
    else:
        # unmasked blocks: the scale is folded into a single FMA per logit
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = m_ij
        p = tl.math.exp2(qk * qk_scale[:, None] - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _load_v(desc_v, v_ptr, kv_start, start_n, offs_n, offs_d, kv_col, seqlen_k, stride_vn, stride_vd,
                MASK, V_TRANS, V_TMA)
    p = p.to(v.dtype)
    if V_TRANS:
        p = _perm_keys(p, BLOCK_M, BLOCK_N)
    acc = tl.dot(p, v, acc)
    return acc, l_i, m_ij


@triton.jit
def _attn_inner(acc, l_i, m_i, q, qk_scale, softcap_log2, inv_softcap,
                k_ptr, v_ptr, desc_k, desc_v, ks_ptr,
                kv_start, seqlen_k, delta, window_left, offs_m, offs_n, offs_d, kv_col,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_ksn,
                lo, hi,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, IS_FP8: tl.constexpr,
                V_TRANS: tl.constexpr, V_TMA: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Key tiles lo..hi, one after the other: Q K^T, softmax, P V."""
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_rows(desc_k, k_ptr, kv_start, start_n, offs_n, offs_d, kv_col, seqlen_k, stride_kn, stride_kd,
                    MASK, USE_TMA)
        qk = tl.dot(q, k.T)
        acc, l_i, m_i = _update(acc, l_i, m_i, qk, qk_scale, softcap_log2, inv_softcap,
                                v_ptr, desc_v, ks_ptr, kv_start, start_n, seqlen_k, delta, window_left,
                                offs_m, offs_n, offs_d, kv_col, stride_vn, stride_vd, stride_ksn,
                                BLOCK_M, BLOCK_N, MASK, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, IS_FP8,
                                V_TRANS, V_TMA)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, desc_k, desc_v,
              qs_ptr, ks_ptr, v_scale_ptr,
              cu_seqlens_q_ptr, cu_seqlens_k_ptr,
              sm_scale, softcap, window_left,
              stride_qm, stride_qh, stride_qd,
              stride_kn, stride_kh, stride_kd,
              stride_vn, stride_vh, stride_vd,
              stride_om, stride_oh, stride_od,
              stride_qsm, stride_qsh, stride_ksn, stride_ksh,
              NUM_M_BLOCKS, GROUP: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              USE_TMA: tl.constexpr, IS_FP8: tl.constexpr, V_TRANS: tl.constexpr, V_TMA: tl.constexpr,
              NUM_STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        # heaviest (last) query blocks first, so the tail of the grid is made of short programs
        pid_m = NUM_M_BLOCKS - 1 - pid_m
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP  # GQA/MQA: GROUP query heads share one K/V head

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_start = tl.load(cu_seqlens_k_ptr + seq)
    seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - kv_start
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:  # the grid is sized for the longest sequence of the batch
        return
    delta = seqlen_k - seqlen_q

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen_q
    q_ptrs = (q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qm + head * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    # exp(x) = exp2(x * log2(e)): log2(e) folded into a per-row scale
    qk_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + sm_scale * 1.4426950408889634
    if IS_FP8:
        # per-token Q scale folded into the per-row logit scale: free
        qs = tl.load(qs_ptr + (q_start + offs_m) * stride_qsm + head * stride_qsh, mask=row_ok, other=0.0)
        qk_scale = qk_scale * qs
    inv_softcap = qk_scale
    softcap_log2 = 0.0
    if HAS_SOFTCAP:
        inv_softcap = qk_scale / (softcap * 1.4426950408889634)  # plain sm_scale [* q scale] / cap
        softcap_log2 = softcap * 1.4426950408889634

    k_ptr += kv_head * stride_kh
    v_ptr += kv_head * stride_vh
    ks_ptr += kv_head * stride_ksh
    kv_col = kv_head * HEAD_DIM  # column of this head in the (tokens, Hkv * D) descriptor views

    # ---- key range visited by this query block ----
    hi = seqlen_k
    if IS_CAUSAL:
        hi = tl.minimum(seqlen_k, m0 + BLOCK_M + delta)
    hi = tl.maximum(hi, 0)
    # blocks below full_hi are visible to every row (first row sees keys <= m0 + delta)
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_hi = tl.minimum(full_hi, tl.maximum(m0 + delta + 1, 0) // BLOCK_N * BLOCK_N)
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(m0 + delta - window_left, 0) // BLOCK_N * BLOCK_N
        # the last row needs keys >= m0 + BLOCK_M - 1 + delta - window_left
        full_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + delta - window_left, 0), BLOCK_N) * BLOCK_N
    lo = tl.minimum(lo, hi)
    end_pro = tl.maximum(lo, tl.minimum(full_lo, hi))
    end_mid = tl.maximum(end_pro, tl.minimum(full_hi, hi))

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if HAS_WINDOW:  # masked prologue: the left edge of the window
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, qk_scale, softcap_log2, inv_softcap,
                                    k_ptr, v_ptr, desc_k, desc_v, ks_ptr,
                                    kv_start, seqlen_k, delta, window_left, offs_m, offs_n, offs_d, kv_col,
                                    stride_kn, stride_kd, stride_vn, stride_vd, stride_ksn, lo, end_pro,
                                    BLOCK_M, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                    USE_TMA, IS_FP8, V_TRANS, V_TMA, NUM_STAGES)
    # unmasked middle: the bulk of the work, no index arithmetic on the logits
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, qk_scale, softcap_log2, inv_softcap,
                                k_ptr, v_ptr, desc_k, desc_v, ks_ptr,
                                kv_start, seqlen_k, delta, window_left, offs_m, offs_n, offs_d, kv_col,
                                stride_kn, stride_kd, stride_vn, stride_vd, stride_ksn, end_pro, end_mid,
                                BLOCK_M, BLOCK_N, False, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                USE_TMA, IS_FP8, V_TRANS, V_TMA, NUM_STAGES)
    # masked epilogue: causal diagonal and the ragged end of the keys
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, qk_scale, softcap_log2, inv_softcap,
                                k_ptr, v_ptr, desc_k, desc_v, ks_ptr,
                                kv_start, seqlen_k, delta, window_left, offs_m, offs_n, offs_d, kv_col,
                                stride_kn, stride_kd, stride_vn, stride_vd, stride_ksn, end_mid, hi,
                                BLOCK_M, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                USE_TMA, IS_FP8, V_TRANS, V_TMA, NUM_STAGES)

    # deferred normalisation; rows that saw no key output 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if V_TRANS:  # V was fp8 too: its per-head scale
        acc = acc * tl.load(v_scale_ptr + kv_head)
    o_ptrs = (o_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_om + head * stride_oh
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def _default_config(head_dim, is_fp8, on_gpu, elem_bytes=2) -> AttentionTiles:
    """The tiles chosen for the H200; small blocks on the CPU."""
    if not on_gpu:
        return AttentionTiles(16, 32 if is_fp8 else 16, 4, 1)  # fp8: _perm_keys works on 32 keys
    if elem_bytes == 4:  # float32 inputs (references): keep the tiles inside shared memory
        return AttentionTiles(64, 32, 4, 2)
    if is_fp8:
        # 64 x 128, one warpgroup, 104 KB: two programs per SM interleave softmax and MMA (NOTES_attention)
        return AttentionTiles(64, 128, 4, 3) if head_dim == 128 else AttentionTiles(128, 128, 8, 3)
    if head_dim <= 128:
        return AttentionTiles(128, 128, 8, 3)
    return AttentionTiles(128, 64, 8, 2)


def triton_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, sm_scale, window_left, softcap,
                    fp8_prepared, config, use_tma, kv_aligned):
    """The Triton kernel's launch, `attention.attention_varlen`'s contract (``fp8_prepared`` None: 16-bit).
    ``use_tma`` False: pointer loads, as before Hopper; the tests run both ways."""
    fp8 = fp8_prepared is not None
    total_q, n_heads, head_dim = q.shape
    total_k, n_kv_heads, _ = k.shape
    assert n_heads % n_kv_heads == 0 and head_dim in (16, 32, 64, 128, 256)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tiles = AttentionTiles(*config) if config else _default_config(head_dim, fp8, q.is_cuda, q.element_size())
    block_m, block_n, num_warps, num_stages = tiles
    q_scale = k_scale = v_scale = out  # placeholders, never read unless fp8
    if fp8:
        q, q_scale, k, k_scale, v, v_scale = fp8_prepared
        assert KV_SCALE_BLOCK % block_n == 0, "a K tile must lie inside one K scale block"
        assert block_n % 32 == 0, "fp8 tiles hold whole 32-key chunks (_perm_keys)"
    v_trans = v.dtype == torch.float8_e4m3fn
    v_tma = use_tma
    if v_trans and use_tma:
        # A V^T box starts at token kv_start + n along its contiguous dim, which TMA needs 16-byte aligned
        # (fp8: sequence starts multiples of 16); the key permutation also needs tiles on 32-token chunks.
        v_tma = kv_starts_aligned(cu_seqlens_k, kv_aligned)
    if v_scale is None:
        v_scale = out
    if k.stride(-1) != 1:
        k = k.contiguous()
    desc_k = desc_v = None
    if use_tma:
        # 2-D views (tokens, Hkv * D) so one descriptor serves every head and sequence
        k = k.contiguous()
        desc_k = TensorDescriptor(k, [total_k, n_kv_heads * head_dim], [n_kv_heads * head_dim, 1],
                                  [block_n, head_dim])
    if v_tma:
        if v_trans:  # storage (Hkv * D, padded tokens), see prepare_fp8
            desc_v = TensorDescriptor(v, [n_kv_heads * head_dim, v.stride(2)], [v.stride(2), 1],
                                      [head_dim, block_n])
        else:
            v = v.contiguous()
            desc_v = TensorDescriptor(v, [total_k, n_kv_heads * head_dim], [n_kv_heads * head_dim, 1],
                                      [block_n, head_dim])
    batch = cu_seqlens_q.numel() - 1
    n_m_blocks = triton.cdiv(max_seqlen_q, block_m)
    grid = (n_m_blocks, batch, n_heads)
    _attn_fwd[grid](
        q, k, v, out, desc_k, desc_v, q_scale, k_scale, v_scale,
        cu_seqlens_q, cu_seqlens_k, sm_scale, float(softcap), int(window_left),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *(q_scale.stride()[:2] if fp8 else (0, 0)), *(k_scale.stride()[:2] if fp8 else (0, 0)),
        n_m_blocks, GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        IS_CAUSAL=causal, HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0,
        USE_TMA=bool(use_tma), IS_FP8=fp8, V_TRANS=v_trans, V_TMA=bool(v_tma),
        NUM_STAGES=num_stages, num_warps=num_warps, num_stages=num_stages)
    return out
