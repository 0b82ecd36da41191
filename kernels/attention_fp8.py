"""FP8 (e4m3) preparation of q, k and v for the attention kernels, in plain PyTorch: per-token q scales, per-block
k scales, a per-head v scale, an optional Hadamard rotation of q and k, and V^T stored in the key order the kernels'
shuffle-free P @ V reads (``attention._perm_keys``). Shared by :mod:`quantkit.kernels.attention` and the Gluon
kernels, which import it from here (not from each other)."""

import math

import torch


def _cdiv(a, b):
    return -(-a // b)


def hadamard_matrix(n, device=None, dtype=torch.float32):
    """Normalised Sylvester Hadamard matrix (n, n), n a power of two; H @ H.T = I."""
    assert n & (n - 1) == 0, "Hadamard rotation needs a power-of-two head dim"
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


KV_SCALE_BLOCK = 128  # keys per K scale (per KV head), counted from each sequence's start
# scale = amax x fp32(1 / 448), e4m3's largest normal: a multiply, which torch computes alike on the CPU and on
# CUDA (where `amax / 448.0` is a multiply by the reciprocal, but a true division on the CPU) and the fused
# kernels compute the same way
INV_E4M3_MAX = 1.0 / 448.0


def quantize_fp8_per_token(x):
    """x: (tokens, H, D) -> (e4m3 tensor (tokens, H, D), float32 scales (tokens, H))."""
    amax = x.abs().amax(dim=-1).float().clamp(min=1e-12)
    scale = amax * INV_E4M3_MAX
    return _codes(x, scale[..., None]), scale


def _codes(x, scale):
    """x / scale rounded to e4m3, computed as x times the float32 reciprocal of the scale (as the fused kernels
    compute it: one multiply a value instead of a division, and the same codes)."""
    return (x.float() * (1.0 / scale)).to(torch.float8_e4m3fn)


def quantize_fp8_per_block(x, cu_seqlens, block=KV_SCALE_BLOCK):
    """x: (tokens, H, D) packed sequences -> (e4m3 (tokens, H, D), float32 scales (tokens, H)).

    One scale per head and per `block` consecutive tokens of a sequence (blocks start at each
    sequence's start, the last one may be short); the scale is written for every token of its
    block, so a kernel tile of keys start..start + BLOCK_N (BLOCK_N dividing `block`) reads one
    scalar at its first key."""
    tokens = x.shape[0]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=x.device), lens.long(),
                                  output_size=tokens)
    local = torch.arange(tokens, device=x.device) - cu_seqlens[:-1].long()[seq]
    first_block = torch.cumsum(torch.cat([lens.new_zeros(1), (lens + block - 1) // block]), 0)[:-1]
    blk = (first_block.long()[seq] + local // block)  # (tokens,) global block id
    amax_tok = x.abs().amax(dim=-1).float()  # (tokens, H)
    # each sequence ends at most one partial block: a bound on the block count known on the host
    # (blk.max() would cost a device sync on every call)
    n_blocks = _cdiv(tokens, block) + lens.numel()
    amax_blk = torch.zeros(n_blocks, x.shape[1], device=x.device)
    # (scatter_reduce_, not index_reduce_: the same result without index_reduce_'s beta warning on every call)
    amax_blk.scatter_reduce_(0, blk[:, None].expand(-1, x.shape[1]), amax_tok, reduce="amax")
    scale = amax_blk[blk].clamp(min=1e-12) * INV_E4M3_MAX  # (tokens, H)
    return _codes(x, scale[..., None]), scale


def _key_perm_positions(n, device=None):
    """Storage position of each token of V^T for the fp8 P @ V (see _perm_keys): inside each
    32-token chunk token c = (jh, jl, t, b) (bits 1, 1, 2, 1) is stored at a = (jh, t, jl, b)."""
    c = torch.arange(n, device=device)
    return (c & -15) | ((c & 8) >> 2) | ((c & 6) << 1)


def prepare_fp8(q, k, v, hadamard=False, fp8_pv=True, cu_seqlens_k=None):
    """Quantize for the FP8 path. q: (total_q, Hq, D); k, v: (total_k, Hkv, D), 16-bit;
    cu_seqlens_k: (B + 1,) offsets of the key sequences (None: one sequence).

    Returns (q8, q_scale (total_q, Hq), k8, k_scale (total_k, Hkv), v8, v_scale (Hkv,)): e4m3
    tensors. q: per-token scales (they fold into the per-row exp2 scale: free). k: one scale
    per KV head and KV_SCALE_BLOCK keys of a sequence (stored per token, constant over the
    block), so each kernel tile of keys has one scalar scale and no per-logit multiply. v: a
    per-head scale. v8 is a (total_k, Hkv, D) view of (Hkv, D, total_k + >= 256 zeros)
    storage, so P @ V reads V K-major as fp8 wgmma requires, with the tokens of each 32-token
    chunk stored in the order of `_perm_keys` (v8[i] is not token i: only the kernel reads it).
    hadamard=True rotates q and k by one orthogonal matrix first (QK^T unchanged, outlier
    channels spread over all channels before rounding to 3 mantissa bits).
    fp8_pv=False keeps v (and so P @ V) in 16 bits: only Q K^T runs in fp8; v_scale is None."""
    total_k, n_kv_heads, head_dim = k.shape
    if cu_seqlens_k is None:
        cu_seqlens_k = torch.tensor([0, total_k], dtype=torch.int32, device=k.device)
    if hadamard:
        h = hadamard_matrix(q.shape[-1], q.device)
        q, k = q.float() @ h, k.float() @ h
    q8, q_scale = quantize_fp8_per_token(q)
    k8, k_scale = quantize_fp8_per_block(k, cu_seqlens_k)
    if not fp8_pv:
        return q8, q_scale, k8, k_scale, v, None
    v_scale = v.abs().amax(dim=(0, 2)).float().clamp(min=1e-12) * INV_E4M3_MAX
    # Token dim padded by one 256-wide tile of zeros, so no TMA box of V^T crosses the end.
    n_pad = _cdiv(total_k + 256, 32) * 32
    v8 = torch.zeros(n_kv_heads, head_dim, n_pad, dtype=torch.float8_e4m3fn, device=v.device)
    pos = _key_perm_positions(n_pad, v.device)[:total_k]
    v8[:, :, pos] = _codes(v, v_scale[None, :, None]).permute(1, 2, 0)
    return q8, q_scale, k8, k_scale, v8[:, :, :total_k].permute(2, 0, 1), v_scale


def kv_starts_aligned(cu_seqlens_k, known=None) -> bool:
    """Whether every key sequence starts on a multiple of 32 tokens (``known``, if the caller knows;
    else read from the device: one host sync)."""
    return bool((cu_seqlens_k % 32 == 0).all()) if known is None else bool(known)
