"""
Decode attention (flash-decoding) in Triton: a few new query tokens against a KV cache.

    q:            (B, Sq, Hq, D)      Sq new tokens per sequence (1 for plain decoding, a few for
                                      speculative decoding); Hq a multiple of Hkv
    k_cache:      (B, S_max, Hkv, D)
    v_cache:      (B, S_max, Hkv, D)
    cache_seqlens:(B,) int32          valid keys per sequence, the Sq new tokens included
    out:          (B, Sq, Hq, D)

New token t of sequence b sits at absolute position L_b - Sq + t and sees keys 0..L_b - Sq + t
(causal among the new tokens, all of the cache before them).

Decode is memory-bound: every K/V byte is used by only G * Sq query rows. Two things matter:
 * read each K/V byte once: one program handles *all* G = Hq / Hkv query heads of a K/V head
   and all Sq new tokens, packed as the rows of one tile (row r -> head g = r // Sq, token
   t = r % Sq), so GQA costs no extra traffic;
 * fill the chip even for a small batch: the keys of a sequence are split across NUM_SPLITS
   programs (split-K); each writes a partial output normalised by its own softmax sum plus its
   log-sum-exp, and a second small kernel combines the splits exactly.
"""
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, seqlens_ptr, slots_ptr, o_part_ptr, lse_part_ptr,
                         sm_scale, chunk, window_left, softcap,
                         stride_qb, stride_qs, stride_qh, stride_qd,
                         stride_kb, stride_kn, stride_kh, stride_kd,
                         stride_vb, stride_vn, stride_vh, stride_vd,
                         stride_ob, stride_oh, stride_os, stride_osp, stride_od,
                         stride_lb, stride_lh, stride_ls, stride_lsp,
                         SQ: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SLOTS: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    seqlen = tl.load(seqlens_ptr + b)
    # the cache row this query row reads (a slot of a cache shared by the batch, or row b itself)
    if HAS_SLOTS:
        cache_b = tl.load(slots_ptr + b).to(tl.int64)
    else:
        cache_b = b.to(tl.int64)

    # rows of the tile: (query head within the group, new token)
    offs_r = tl.arange(0, BLOCK_M)
    g = offs_r // SQ
    t = offs_r % SQ
    row_ok = offs_r < GROUP * SQ
    head = kv_head * GROUP + g
    pos = seqlen - SQ + t  # absolute position of each row's token: sees keys <= pos
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = (q_ptr + b.to(tl.int64) * stride_qb + t[:, None] * stride_qs + head[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 with log2(e) folded in

    k_base = k_ptr + cache_b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + cache_b * stride_vb + kv_head * stride_vh
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    if HAS_WINDOW:
        # keys before the earliest row's window are never visible: skip whole tiles of them
        lo = tl.maximum(lo, (tl.maximum(seqlen - SQ - window_left, 0) // BLOCK_N) * BLOCK_N)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None], other=0.0)
        if HAS_SOFTCAP:
            # softcap * tanh(s / softcap) on the scaled logits s, then into log2 units
            s = tl.dot(q, k.T) * sm_scale / softcap
            qk = (2.0 / (1.0 + tl.exp(-2.0 * s)) - 1.0) * softcap * 1.4426950408889634
        else:
            qk = tl.dot(q, k.T) * qk_scale
        # masking is cheap here (memory-bound), so every tile is masked: ragged end + causal
        keep = col_ok[None, :] & (cols[None, :] <= pos[:, None])
        if HAS_WINDOW:
            keep = keep & (cols[None, :] >= pos[:, None] - window_left)
        qk = tl.where(keep, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_ij

    # partial result normalised by its own sum; lse (log2 units) = -inf marks an empty split
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    o_ptrs = (o_part_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_os
              + split * stride_osp + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, acc, mask=row_ok[:, None])
    tl.store(lse_part_ptr + b * stride_lb + head * stride_lh + t * stride_ls + split * stride_lsp, lse,
             mask=row_ok)


@triton.jit
def _decode_reduce_kernel(o_part_ptr, lse_part_ptr, out_ptr, num_splits,
                          stride_ob, stride_oh, stride_os, stride_osp, stride_od,
                          stride_lb, stride_lh, stride_ls, stride_lsp,
                          stride_outb, stride_outs, stride_outh, stride_outd,
                          HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr):
    # one program per (batch, query head, new token): weight each split by exp2(lse - max)
    b = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.program_id(2)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(lse_part_ptr + b * stride_lb + head * stride_lh + t * stride_ls + offs_s * stride_lsp,
                  mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # empty splits weigh 0
    o = tl.load(o_part_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + t * stride_os
                + offs_s[:, None] * stride_osp + offs_d[None, :] * stride_od, mask=s_ok[:, None], other=0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + b.to(tl.int64) * stride_outb + t * stride_outs + head * stride_outh
             + offs_d * stride_outd,
             o.to(out_ptr.dtype.element_ty))


def _num_splits(batch, n_kv_heads, max_len, block_n, n_sms):
    # enough programs for ~2 waves, but each split keeps at least 4 key tiles of work
    want = triton.cdiv(2 * n_sms, batch * n_kv_heads)
    return max(1, min(want, triton.cdiv(max_len, 4 * block_n), 128))


def decode_attention(q, k_cache, v_cache, cache_seqlens, sm_scale=None, num_splits=None, block_n=None,
                     num_warps=4, cache_slots=None, window_left=-1, softcap=0.0):
    """Flash-decoding. q (B, Sq, Hq, D); k_cache, v_cache (B, S_max, Hkv, D), or (slots, S_max, Hkv, D)
    with ``cache_slots`` (B,) int32 naming the cache row of each query row (continuous batching);
    cache_seqlens (B,) int32 (keys valid per sequence, new tokens included). ``window_left >= 0``: a
    token at position p sees keys p - window_left .. p only (sliding window); ``softcap > 0``: logits
    ``softcap * tanh(s / softcap)``. -> (B, Sq, Hq, D). No host sync: safe inside a CUDA graph."""
    b, sq, n_heads, head_dim = q.shape
    _, s_max, n_kv_heads, _ = k_cache.shape
    assert n_heads % n_kv_heads == 0
    group = n_heads // n_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    on_gpu = q.is_cuda
    if block_n is None:
        block_n = 64 if on_gpu else 16
    if num_splits is None:
        n_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if on_gpu else 4
        num_splits = _num_splits(b, n_kv_heads, s_max, block_n, n_sms)
    # split length rounded to the tile, so splits never share a tile
    chunk = triton.cdiv(triton.cdiv(s_max, num_splits), block_n) * block_n
    block_m = max(16, triton.next_power_of_2(group * sq))
    o_part = torch.empty(b, n_heads, sq, num_splits, head_dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b, n_heads, sq, num_splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    _decode_split_kernel[(num_splits, b, n_kv_heads)](
        q, k_cache, v_cache, cache_seqlens, cache_slots if cache_slots is not None else cache_seqlens,
        o_part, lse_part, sm_scale, chunk, int(window_left), float(softcap),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *o_part.stride(), *lse_part.stride(),
        SQ=sq, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SLOTS=cache_slots is not None, HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0,
        num_warps=num_warps)
    _decode_reduce_kernel[(b, n_heads, sq)](
        o_part, lse_part, out, num_splits, *o_part.stride(), *lse_part.stride(), *out.stride(),
        HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(num_splits))
    return out


def decode_attention_ref(q, k_cache, v_cache, cache_seqlens, sm_scale=None, cache_slots=None, window_left=-1,
                         softcap=0.0):
    """Plain-PyTorch reference (float32 math), same shapes, arguments and masking as `decode_attention`."""
    b, sq, n_heads, head_dim = q.shape
    group = n_heads // k_cache.shape[2]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    rows = range(b) if cache_slots is None else cache_slots.tolist()
    for i, (length, row) in enumerate(zip(cache_seqlens.tolist(), rows)):
        qb = q[i].float().transpose(0, 1)  # (Hq, Sq, D)
        kb = k_cache[row, :length].float().repeat_interleave(group, 1).transpose(0, 1)
        vb = v_cache[row, :length].float().repeat_interleave(group, 1).transpose(0, 1)
        s = qb @ kb.transpose(1, 2) * sm_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(sq, device=q.device)[:, None] + length - sq
        cols = torch.arange(length, device=q.device)[None, :]
        hidden = cols > pos
        if window_left >= 0:
            hidden |= cols < pos - window_left
        s = s.masked_fill(hidden, float("-inf"))
        out[i] = (torch.softmax(s, -1).nan_to_num(0.0) @ vb).transpose(0, 1)
    return out
