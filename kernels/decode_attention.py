"""
Decode attention in Triton: one new token per sequence against a KV cache, fused with what precedes it in a
decoder layer (RoPE on q and k, the cache write of k and v), as the serving runtime calls it.

    qkv:            (B, (Hq + 2 Hkv) D)     the fused projection's output row of each sequence
    k_cache, v_cache: (slots, S_max, Hkv, D) sequence b lives in cache row slots[b]
    positions:      (B,) int32              the new token's position p: it sees keys 0..p
    out:            (B, Hq D)

Decode is memory-bound: every K/V byte is used by only G = Hq / Hkv query rows. Two things matter:
 * read each K/V byte once: one program takes all G query heads of a K/V head as the rows of one tile, so GQA
   costs no extra traffic;
 * fill the chip for a small batch: the keys of a row are split across programs (split-K, flash-decoding); each
   writes a partial output normalised by its own softmax sum plus its log-sum-exp, and the last program of a row
   to finish combines them exactly.

``decode_attention_ref`` is the plain-PyTorch reference (several new tokens per sequence, sliding window,
soft-cap); the general two-launch split-K kernel that takes a separate q lives in
bench/archive/experimental/decode_split_k.py.
"""
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import num_sms, pdl_launch
from quantkit.kernels.fp8_quant import e4m3_codes, e4m3_scale


@triton.jit
def _online_softmax_step(q, k, v, keep, m_i, l_i, acc, sm_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """One key tile of the online softmax: the logits q k^T in log2 units (soft-capped: softcap * tanh(s / softcap)
    on the scaled logits s), masked to -inf where ``keep`` is false, the running max raised, the sum and the
    accumulator rescaled by exp2, acc += P V. Returns (m_i, l_i, acc)."""
    if HAS_SOFTCAP:
        s = tl.dot(q, k.T) * sm_scale / softcap
        qk = (2.0 / (1.0 + tl.exp(-2.0 * s)) - 1.0) * softcap * 1.4426950408889634
    else:
        qk = tl.dot(q, k.T) * (sm_scale * 1.4426950408889634)  # exp2 with log2(e) folded in
    qk = tl.where(keep, qk, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    # a row may have seen no key yet: keep exp2 arguments finite (-inf - -inf = NaN)
    m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_ij, l_i, acc


def decode_attention_ref(q, k_cache, v_cache, cache_seqlens, sm_scale=None, cache_slots=None, window_left=-1,
                         softcap=0.0):
    """Decode attention in plain PyTorch (float32 math). q (B, Sq, Hq, D): Sq new tokens per sequence, token t at
    position L_b - Sq + t seeing keys 0..L_b - Sq + t; k_cache, v_cache (B, S_max, Hkv, D), or (slots, S_max, Hkv, D)
    with ``cache_slots`` (B,) naming each row's cache row; cache_seqlens (B,) keys valid per sequence, the new tokens
    included. ``window_left >= 0``: a token at position p sees keys p - window_left .. p only; ``softcap > 0``:
    logits ``softcap * tanh(s / softcap)``. -> (B, Sq, Hq, D) float32."""
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


@triton.jit
def _rotated(base, cos_ptr, sin_ptr, d, HALF: tl.constexpr, ROPE: tl.constexpr, w_ptr, eps, offset,
             NORM: tl.constexpr, DTYPE: tl.constexpr):
    """The head vector(s) at ``base + d`` (d over the whole head) rotated by RoPE in the half-split layout (float32):
    x[d] * cos[d % HALF] -+ x[(d + HALF) % D] * sin[d % HALF]. NORM: first each head's RMSNorm (Qwen3's and Gemma
    3's q/k norm, weights ``[D]`` at ``w_ptr``), each normed value rounded to DTYPE, as the separate q/k norm
    kernel stores them."""
    x = tl.load(base + d).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) / (2 * HALF) + eps)
        x = (x * rstd * (tl.load(w_ptr + d).to(tl.float32) + offset)).to(DTYPE).to(tl.float32)
    if ROPE:
        p = (d + HALF) % (2 * HALF)
        partner = tl.load(base + p).to(tl.float32)
        if NORM:
            partner = (partner * rstd * (tl.load(w_ptr + p).to(tl.float32) + offset)).to(DTYPE).to(tl.float32)
        c = tl.load(cos_ptr + d % HALF)
        s = tl.load(sin_ptr + d % HALF)
        x = x * c + tl.where(d < HALF, -partner, partner) * s
    return x


@triton.jit
def _fp8_store(dst, x, scale_dst):
    """A head vector ``x`` (the model's dtype) as e4m3 codes of its own absmax scale at ``dst``, the scale at
    ``scale_dst`` (``fp8_quant_ref.quantize_kv_ref``'s rounding)."""
    xf = x.to(tl.float32)
    scale = e4m3_scale(tl.max(tl.abs(xf), axis=0))
    tl.store(dst, e4m3_codes(xf, scale))
    tl.store(scale_dst, scale)


@triton.jit
def _combine_splits(o_part_ptr, lse_part_ptr, out_ptr, head0, n_splits, d, GROUP: tl.constexpr,
                    GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Combine the ``n_splits`` partial outputs of heads head0 .. head0 + GROUP - 1 (global head rows of the
    partials) into ``out_ptr`` rows 0 .. GROUP - 1: the weights exp2(lse - max) from one load of every log-sum-exp,
    then the partial outputs SPLIT_BLOCK splits at a time, one load a block (a split at a time chains n_splits
    round trips to L2, which cost more than the attention itself for one short row)."""
    g = tl.arange(0, GROUP_P2)
    g_ok = g < GROUP
    part = (head0 + tl.where(g_ok, g, 0)) * NUM_SPLITS
    sp = tl.arange(0, SPLITS_P2)
    lse = tl.load(lse_part_ptr + part[:, None] + sp[None, :], mask=g_ok[:, None] & (sp[None, :] < n_splits),
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, output 0
    den = tl.sum(tl.math.exp2(lse - m[:, None]), 1)
    o = tl.zeros([GROUP_P2, HEAD_DIM], dtype=tl.float32)
    for s0 in tl.range(0, n_splits, SPLIT_BLOCK):
        sb = s0 + tl.arange(0, SPLIT_BLOCK)
        ok = g_ok[:, None] & (sb[None, :] < n_splits)
        w = tl.math.exp2(tl.load(lse_part_ptr + part[:, None] + sb[None, :], mask=ok, other=float("-inf"),
                                 cache_modifier=".cg") - m[:, None])
        o_sp = tl.load(o_part_ptr + (part[:, None, None] + sb[None, :, None]) * HEAD_DIM + d[None, None, :],
                       mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        o += tl.sum(o_sp * w[:, :, None], 1)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + g[:, None] * HEAD_DIM + d[None, :], (o / den[:, None]).to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None])


@triton.jit
def _decode_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, k_ptr, v_ptr, o_part_ptr, lse_part_ptr,
                        out_ptr, counter_ptr, qw_ptr, kw_ptr, sm_scale, window_left, softcap, norm_eps, norm_offset,
                        stride_qkv, stride_cos, stride_kb, stride_kn, stride_kh, stride_out,
                        N_HEADS: tl.constexpr, N_KV: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, ROPE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        PDL: tl.constexpr, GROUP_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
                        SPLIT_BLOCK: tl.constexpr, QK_NORM: tl.constexpr = False, ks_ptr=None, vs_ptr=None,
                        stride_sb=0, stride_sn=0, FP8_KV: tl.constexpr = False):
    # program (split, row b, KV head): the GROUP query heads of the KV head against this split's share of the
    # keys already cached (0 .. pos - 1); the last busy split also takes the new token's own key, from registers.
    # A row uses as many of the NUM_SPLITS programs as its length needs (MIN_SPLIT_KEYS keys each at least); the
    # others stay idle, and a row that needs one split writes its output at once (no combine). FP8_KV: the cache
    # holds e4m3 codes and a float32 scale a (slot, position, kv head) at ks_ptr / vs_ptr; keys and values are read
    # as codes x scale rounded to the model's dtype, the new token's attended as the projection gave them
    split = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    if PDL:
        # let the next kernel (the o projection) start fetching its weights now; wait for the qkv projection
        gdc_launch_dependents()
        gdc_wait()
    HEAD_DIM: tl.constexpr = 2 * HALF
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_cos
    offs_r = tl.arange(0, BLOCK_M)
    row_ok = offs_r < GROUP
    head = kv_head * GROUP + tl.where(row_ok, offs_r, 0)
    d = tl.arange(0, HEAD_DIM)
    row_base = qkv_ptr + b * stride_qkv
    # QK_NORM: the per-head q/k norm here rather than in a launch of its own (qkv is left as it is)
    q = _rotated(row_base + head[:, None] * HEAD_DIM, cos_row, sin_row, d[None, :], HALF, ROPE, qw_ptr, norm_eps,
                 norm_offset, QK_NORM, qkv_ptr.dtype.element_ty)
    q = q.to(qkv_ptr.dtype.element_ty)  # the model rounds the rotated q, as the unfused path stores it
    k_base = k_ptr + slot * stride_kb + kv_head * stride_kh
    v_base = v_ptr + slot * stride_kb + kv_head * stride_kh
    qk_scale = sm_scale * 1.4426950408889634

    # this split's keys: the cached ones spread evenly (whole tiles) over the busy splits
    n_old = pos
    n_splits = tl.minimum(tl.maximum(tl.cdiv(n_old, MIN_SPLIT_KEYS), 1), NUM_SPLITS)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(n_old, 1), n_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_old)
    if HAS_WINDOW:
        lo = tl.maximum(lo, (tl.maximum(pos - window_left, 0) // BLOCK_N) * BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kn + d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_kn + d[None, :], mask=col_ok[:, None], other=0.0)
        if FP8_KV:
            at_s = slot * stride_sb + kv_head + cols.to(tl.int64) * stride_sn  # the entries' scales
            k = (k.to(tl.float32) * tl.load(ks_ptr + at_s, mask=col_ok, other=0.0)[:, None]).to(
                qkv_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * tl.load(vs_ptr + at_s, mask=col_ok, other=0.0)[:, None]).to(
                qkv_ptr.dtype.element_ty)
        keep = col_ok[None, :]
        if HAS_WINDOW:
            keep = keep & (cols[None, :] >= pos - window_left)
        m_i, l_i, acc = _online_softmax_step(q, k, v, keep, m_i, l_i, acc, sm_scale, softcap, HAS_SOFTCAP)

    if split == n_splits - 1:
        # the new token: its key and value from the projection, written to the cache here (no program reads
        # position pos from the cache) and attended from registers
        k_new = _rotated(row_base + (N_HEADS + kv_head) * HEAD_DIM, cos_row, sin_row, d, HALF, ROPE, kw_ptr, norm_eps,
                         norm_offset, QK_NORM, qkv_ptr.dtype.element_ty)
        if FP8_KV:  # attended as the model's dtype, stored as codes
            k_new = k_new.to(qkv_ptr.dtype.element_ty)
            v_new = tl.load(row_base + (N_HEADS + N_KV + kv_head) * HEAD_DIM + d)
            at_s = slot * stride_sb + kv_head + pos * stride_sn
            _fp8_store(k_base + pos * stride_kn + d, k_new, ks_ptr + at_s)
            _fp8_store(v_base + pos * stride_kn + d, v_new, vs_ptr + at_s)
        else:
            k_new = k_new.to(k_ptr.dtype.element_ty)
            v_new = tl.load(row_base + (N_HEADS + N_KV + kv_head) * HEAD_DIM + d).to(v_ptr.dtype.element_ty)
            tl.store(k_base + pos * stride_kn + d, k_new)
            tl.store(v_base + pos * stride_kn + d, v_new)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1)
        if HAS_SOFTCAP:
            s_new = s_new * sm_scale / softcap
            s_new = (2.0 / (1.0 + tl.exp(-2.0 * s_new)) - 1.0) * softcap * 1.4426950408889634
        else:
            s_new = s_new * qk_scale
        m_ij = tl.maximum(m_i, s_new)
        p_new = tl.math.exp2(s_new - m_ij)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + p_new
        p_new = p_new.to(v_new.dtype).to(tl.float32)  # rounded as the tiles' p before their dot
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_ij

    out_ptrs = out_ptr + b * stride_out + head[:, None] * HEAD_DIM + d[None, :]
    if n_splits == 1:
        if split == 0:
            tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    elif split < n_splits:
        # partial result normalised by its own sum and its log-sum-exp (log2; -inf: an empty split)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part = (b * N_HEADS + head) * NUM_SPLITS
        tl.store(o_part_ptr + (part + split)[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None],
                 mask=row_ok[:, None])
        tl.store(lse_part_ptr + part + split, lse, mask=row_ok)
        # every thread's stores issued (barrier) before one thread's release of the count: the program that
        # completes it combines the splits and leaves the counter zeroed for the next call
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + b * N_KV + kv_head, 1, sem="acq_rel") + 1
        if done == n_splits:
            _combine_splits(o_part_ptr, lse_part_ptr, out_ptr + b * stride_out + kv_head * GROUP * HEAD_DIM,
                            b * N_HEADS + kv_head * GROUP, n_splits, d, GROUP, GROUP_P2, HEAD_DIM, NUM_SPLITS,
                            SPLITS_P2, SPLIT_BLOCK)
            tl.store(counter_ptr + b * N_KV + kv_head, 0)


def _rope_decode_splits(batch: int, n_kv_heads: int, max_len: int, min_split_keys: int, n_sms: int) -> int:
    """Most splits of a row (``batch * n_kv_heads`` programs a split): whole waves of programs only, since a few
    programs past a wave double its tail; one wave when that gives each row 8 splits or more, else two programs a
    SM (fewer splits leave each program too long a chain of key tiles). ``min_split_keys`` keys a split at least."""
    units = batch * n_kv_heads
    want = n_sms // units if n_sms // units >= 8 else 2 * n_sms // units
    return max(1, min(want, triton.cdiv(max_len, min_split_keys), 64))


def decode_attention_rope(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, n_heads, counters,
                          sm_scale=None, window_left=-1, softcap=0.0, rope=True, num_splits=None, block_n=None,
                          min_split_keys=None, pdl=False, qk_norm=None, k_scale=None, v_scale=None):
    """One new token per sequence, straight from the fused projection: rotate its q and k (RoPE, half-split
    layout, ``cos_table / sin_table [positions, D / 2]`` float32), write its k and v into the cache at
    ``(slots[b], positions[b])``, and attend to the cache's keys 0..positions[b] -> ``[B, Hq * D]``.

    ``qkv [B, (Hq + 2 Hkv) * D]`` (rows contiguous; left unchanged); ``k_cache, v_cache [slots, S_max, Hkv, D]``
    (one layout, head dim contiguous); ``positions, slots [B]`` int32; ``counters``: an int32 buffer of at least
    ``B * Hkv`` zeros that the kernel leaves zeroed (calls sharing it must run one after another, as a stream
    runs them). ``rope=False``: no rotation (models without RoPE). ``num_splits``: the most programs one row's
    keys are split over; a row of L cached keys uses ceil(L / ``min_split_keys``) of them (default 4 key tiles
    each), and one alone stores its output without a combine. ``pdl``: launch with programmatic dependent
    launch (sm_90; the previous kernel's tail and the next kernel's start overlap this one). ``qk_norm``:
    ``(q_weight [D], k_weight [D], eps, offset)``, the per-head RMSNorm of q and k (Qwen3, Gemma 3) applied here
    before the rotation, each normed value rounded to the model's dtype as ``decoder_ops.qk_norm`` stores it,
    instead of that kernel's launch before this one (``qkv`` stays unchanged either way). ``k_scale, v_scale``
    (float32 ``[slots, S_max, Hkv]``): an FP8 cache, whose e4m3 codes attention reads as codes x scale rounded
    to the model's dtype; the new token is stored that way (``fp8_quant_ref.quantize_kv_ref``) and attended as
    the projection gave it. One launch, no host sync: safe inside a CUDA graph. Reference:
    :func:`decode_attention_rope_ref`."""
    b = qkv.shape[0]
    _, s_max, n_kv_heads, head_dim = k_cache.shape
    assert n_heads % n_kv_heads == 0 and qkv.shape[1] == (n_heads + 2 * n_kv_heads) * head_dim
    assert qkv.stride(1) == 1 and cos_table.stride(1) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and counters.dtype == torch.int32 and counters.numel() >= b * n_kv_heads
    q_w, k_w, eps, offset = qk_norm if qk_norm is not None else (qkv, qkv, 0.0, 0.0)
    assert qk_norm is None or (q_w.numel() == k_w.numel() == head_dim and q_w.is_contiguous() and k_w.is_contiguous())
    fp8_kv = k_scale is not None
    assert not fp8_kv or (k_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
                          and k_scale.stride(2) == 1 and k_scale.dtype == v_scale.dtype == torch.float32)
    group = n_heads // n_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    on_gpu = qkv.is_cuda
    block_n = block_n or (64 if on_gpu else 16)
    min_split_keys = min_split_keys or 4 * block_n
    if num_splits is None:
        num_splits = _rope_decode_splits(b, n_kv_heads, s_max, min_split_keys, num_sms(qkv.device))
    o_part = torch.empty(b, n_heads, num_splits, head_dim, device=qkv.device, dtype=torch.float32)
    lse_part = torch.empty(b, n_heads, num_splits, device=qkv.device, dtype=torch.float32)
    out = torch.empty(b, n_heads * head_dim, device=qkv.device, dtype=qkv.dtype)
    group_p2, splits_p2 = triton.next_power_of_2(group), triton.next_power_of_2(num_splits)
    # the combine holds GROUP_P2 x SPLIT_BLOCK x D partial outputs: at most 64 floats a thread of 4 warps
    split_block = max(1, min(splits_p2, 8192 // (group_p2 * head_dim)))
    _decode_rope_kernel[(num_splits, b, n_kv_heads)](
        qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, o_part, lse_part, out, counters, q_w, k_w,
        sm_scale, int(window_left), float(softcap), float(eps), float(offset),
        qkv.stride(0), cos_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        N_HEADS=n_heads, N_KV=n_kv_heads, GROUP=group, HALF=head_dim // 2, NUM_SPLITS=num_splits,
        MIN_SPLIT_KEYS=min_split_keys, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, ROPE=rope,
        HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, PDL=pdl, GROUP_P2=group_p2, SPLITS_P2=splits_p2,
        SPLIT_BLOCK=split_block, QK_NORM=qk_norm is not None, num_warps=4, **pdl_launch(pdl),
        **(dict(ks_ptr=k_scale, vs_ptr=v_scale, stride_sb=k_scale.stride(0), stride_sn=k_scale.stride(1),
                FP8_KV=True) if fp8_kv else {}))
    return out


def decode_attention_rope_ref(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, n_heads,
                              sm_scale=None, window_left=-1, softcap=0.0, rope=True, qk_norm=None, k_scale=None,
                              v_scale=None):
    """Plain-PyTorch reference of :func:`decode_attention_rope` (same arguments but ``counters``; the same cache
    write), float32 math with q and k rounded to the model's dtype after rotation (and after the q/k norm)."""
    b = qkv.shape[0]
    n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if qk_norm is not None:
        from quantkit.kernels.decoder_ops_ref import qk_norm_ref

        qkv = qkv.clone()  # as the kernel, leave the caller's rows as they are
        qk_norm_ref(qkv, qk_norm[0], qk_norm[1], n_heads, n_kv_heads, head_dim, qk_norm[2], qk_norm[3])
    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    q = qkv[:, :q_size].view(b, n_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(b, n_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(b, n_kv_heads, head_dim)
    pos = positions.long()
    if rope:
        half = head_dim // 2
        c, s = cos_table[pos][:, None, :], sin_table[pos][:, None, :]

        def rotate(x):
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

        q, k = rotate(q), rotate(k)
    from quantkit.kernels.decoder_ops_ref import kv_write_ref

    kv_write_ref(k_cache, v_cache, k_scale, v_scale, slots.long(), pos, k, v)
    if k_scale is None:
        out = decode_attention_ref(q[:, None], k_cache, v_cache, positions + 1, sm_scale=sm_scale,
                                   cache_slots=slots, window_left=window_left, softcap=softcap)
    else:  # the rows' cached entries as attention reads them, the new token's as the projection gave it
        from quantkit.kernels.fp8_quant_ref import dequantize_kv_ref

        rows, new = slots.long(), torch.arange(b, device=qkv.device)
        kc = dequantize_kv_ref(k_cache[rows], k_scale[rows], qkv.dtype)
        vc = dequantize_kv_ref(v_cache[rows], v_scale[rows], qkv.dtype)
        kc[new, pos], vc[new, pos] = k, v
        out = decode_attention_ref(q[:, None], kc, vc, positions + 1, sm_scale=sm_scale, window_left=window_left,
                                   softcap=softcap)
    return out.reshape(b, q_size).to(qkv.dtype)
