"""FP8 (e4m3) operands of the attention kernels: per-token q scales, per-128-key-block k scales, a per-head v scale,
and V^T stored in the key order the kernels' shuffle-free P @ V reads (``attention_triton._perm_keys``).

* :func:`prepare_fp8`: the plain-PyTorch reference, and the path of the Hadamard rotation and of 16-bit P @ V.
* :func:`quantize_qkv_fp8`: the same tuple, bit for bit, from two Triton launches, no host sync. The first
  writes e4m3 Q and K with their scales and each V block's absolute maximum; the second takes the per-head V
  scale and writes e4m3 V^T, zero-padded for the TMA boxes that read past the end. Two launches because no V
  value can be rounded before all of its head has been read, and a grid-wide barrier would need every program
  resident; the cost is a second read of v.
* :func:`fp8_operands`: the same tuple from e4m3 q, k, v and FA3-style descales; only V is moved.
"""

import math

import torch
import triton
import triton.language as tl

from quantkit.kernels.device_info import interpreting

KV_SCALE_BLOCK = 128  # keys per K scale (per KV head), counted from each sequence's start
V_PAD = 256  # zero tokens after the end of V^T: no 256-wide TMA box crosses the end of the storage
# scale = amax x fp32(1 / 448), e4m3's largest normal: a multiply, identical on CPU, CUDA and in the fused kernels
# (`amax / 448.0` is a reciprocal multiply on CUDA but a true division on the CPU)
INV_E4M3_MAX = 1.0 / 448.0
AMAX_FLOOR = 1e-12  # the amax of an all-zero row / block / head: its codes are 0 either way


def _cdiv(a, b):
    return -(-a // b)


def _hadamard(n, device=None, dtype=torch.float32):
    """Normalised Sylvester Hadamard matrix (n, n), n a power of two; H @ H.T = I."""
    assert n & (n - 1) == 0, "Hadamard rotation needs a power-of-two head dim"
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def quantize_fp8_per_token(x):
    """x: (tokens, H, D) -> (e4m3 tensor (tokens, H, D), float32 scales (tokens, H))."""
    amax = x.abs().amax(dim=-1).float().clamp(min=AMAX_FLOOR)
    scale = amax * INV_E4M3_MAX
    return _codes(x, scale[..., None]), scale


def _codes(x, scale):
    """x / scale rounded to e4m3, as x times the float32 reciprocal of the scale (as the fused kernels do)."""
    return (x.float() * (1.0 / scale)).to(torch.float8_e4m3fn)


def _quantize_per_block(x, cu_seqlens, block=KV_SCALE_BLOCK):
    """x: (tokens, H, D) packed sequences -> (e4m3 (tokens, H, D), float32 scales (tokens, H)).

    One scale per head and `block` tokens from each sequence's start (the last block may be short), written
    for every token, so a key tile (BLOCK_N dividing `block`) reads one scalar at its first key."""
    tokens = x.shape[0]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=x.device), lens.long(),
                                  output_size=tokens)
    local = torch.arange(tokens, device=x.device) - cu_seqlens[:-1].long()[seq]
    first_block = torch.cumsum(torch.cat([lens.new_zeros(1), (lens + block - 1) // block]), 0)[:-1]
    blk = (first_block.long()[seq] + local // block)  # (tokens,) global block id
    amax_tok = x.abs().amax(dim=-1).float()  # (tokens, H)
    # at most one partial block per sequence: a host-side bound (blk.max() would sync the device)
    n_blocks = _cdiv(tokens, block) + lens.numel()
    amax_blk = torch.zeros(n_blocks, x.shape[1], device=x.device)
    # scatter_reduce_: index_reduce_ warns (beta) on every call
    amax_blk.scatter_reduce_(0, blk[:, None].expand(-1, x.shape[1]), amax_tok, reduce="amax")
    scale = amax_blk[blk].clamp(min=AMAX_FLOOR) * INV_E4M3_MAX  # (tokens, H)
    return _codes(x, scale[..., None]), scale


def _key_perm_positions(n, device=None):
    """Storage position of each V^T token (attention_triton._perm_keys): in each 32-token chunk token
    c = (jh, jl, t, b) (bits 1, 1, 2, 1) is stored at a = (jh, t, jl, b)."""
    c = torch.arange(n, device=device)
    return (c & -15) | ((c & 8) >> 2) | ((c & 6) << 1)


def prepare_fp8(q, k, v, hadamard=False, fp8_pv=True, cu_seqlens_k=None):
    """Quantize for the FP8 path. q: (total_q, Hq, D); k, v: (total_k, Hkv, D), 16-bit;
    cu_seqlens_k: (B + 1,) offsets of the key sequences (None: one sequence).

    Returns (q8, q_scale (total_q, Hq), k8, k_scale (total_k, Hkv), v8, v_scale (Hkv,)), e4m3 tensors and
    float32 scales: per token for q, per KV head and KV_SCALE_BLOCK keys for k (stored per token), per head
    for v. v8 is a (total_k, Hkv, D) view of (Hkv, D, total_k + >= V_PAD zeros) storage, K-major as fp8 wgmma
    requires, each 32-token chunk in `_perm_keys` order (v8[i] is not token i: only the kernel reads it).
    hadamard=True rotates q and k by one orthogonal matrix first (QK^T unchanged, outlier channels spread
    before rounding to 3 mantissa bits). fp8_pv=False keeps v (and P @ V) in 16 bits; v_scale is None."""
    total_k, n_kv_heads, head_dim = k.shape
    if cu_seqlens_k is None:
        cu_seqlens_k = torch.tensor([0, total_k], dtype=torch.int32, device=k.device)
    if hadamard:
        h = _hadamard(q.shape[-1], q.device)
        q, k = q.float() @ h, k.float() @ h
    q8, q_scale = quantize_fp8_per_token(q)
    k8, k_scale = _quantize_per_block(k, cu_seqlens_k)
    if not fp8_pv:
        return q8, q_scale, k8, k_scale, v, None
    v_scale = v.abs().amax(dim=(0, 2)).float().clamp(min=AMAX_FLOOR) * INV_E4M3_MAX
    n_pad = _cdiv(total_k + V_PAD, 32) * 32
    v8 = torch.zeros(n_kv_heads, head_dim, n_pad, dtype=torch.float8_e4m3fn, device=v.device)
    pos = _key_perm_positions(n_pad, v.device)[:total_k]
    v8[:, :, pos] = _codes(v, v_scale[None, :, None]).permute(1, 2, 0)
    return q8, q_scale, k8, k_scale, v8[:, :, :total_k].permute(2, 0, 1), v_scale


# --- The fused quantization (Triton) -----------------------------------------------------------------------
Q_ROWS = 64  # (token, head) rows of Q per program of the first launch
_INV_E4M3_MAX_JIT = tl.constexpr(INV_E4M3_MAX)  # (a jit function reads module globals only as constexpr)
_AMAX_FLOOR_JIT = tl.constexpr(AMAX_FLOOR)


@triton.jit
def _token_at(pos):
    """The token at V^T position `pos`, inverse of ``_key_perm_positions``: in each aligned 16-token group,
    position (t, jl, b) holds token (jl, t, b) (bits 2, 1, 1 and 1, 2, 1)."""
    return (pos & -15) | ((pos & 2) << 2) | ((pos & 12) >> 1)


@triton.jit
def _round_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest e4m3 value (ties to even), in fp32: add and subtract
    1.5 x 2^(e + 20), e the exponent of y's e4m3 spacing (2^-9 below the normal range)."""
    e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    magic = (((e + 20) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + magic) - magic
    return tl.where(y < 0, -r, r)


@triton.jit
def _to_e4m3(y, ROUND_IN_F32: tl.constexpr):
    """fp32 -> e4m3, round-to-nearest-even. ROUND_IN_F32 (interpreter only): round in fp32 first, because
    Triton 3.6's interpreter drops the exponent carry when rounding up crosses a power of two (126.8 -> 64)."""
    if ROUND_IN_F32:
        y = _round_e4m3(y)
    return y.to(tl.float8e4nv)


@triton.jit
def _div_rn(x, s):
    """x / s with IEEE rounding, as torch divides (tl.math.div_rn does not broadcast: s is brought to x's shape)."""
    return tl.math.div_rn(x, tl.zeros_like(x) + s)


@triton.jit
def _codes_jit(x, scale):
    """x (fp32) times the IEEE reciprocal of scale, as ``_codes``: one multiply a value, not a dozen-instruction
    div.rn."""
    return x * _div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _scale_of(amax):
    """The e4m3 scale of an absolute maximum: amax (floored) times fp32(1 / 448), as ``prepare_fp8`` computes it."""
    return tl.maximum(amax, _AMAX_FLOOR_JIT) * _INV_E4M3_MAX_JIT


@triton.jit
def _quantize_q_rows(q_ptr, q8_ptr, qs_ptr, row0, n_rows, stride_q, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     ROWS: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    """Rows row0.. of q viewed as (tokens * Hq, D): one scale a row (a token of one head). q's tokens are
    stride_q apart (heads packed within a token), so a view into the fused QKV projection is read in place;
    q8 is written contiguous."""
    rows = row0 + tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    src = ((rows64 // N_HEADS) * stride_q + (rows64 % N_HEADS) * HEAD_DIM)[:, None] + offs_d[None, :]
    x = tl.load(q_ptr + src, mask=ok[:, None], other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(x), axis=1))
    dst = rows64[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(q8_ptr + dst, _to_e4m3(_codes_jit(x, scale[:, None]), ROUND_IN_F32), mask=ok[:, None])
    tl.store(qs_ptr + rows, scale, mask=ok)


@triton.jit
def _quantize_k_block(k_ptr, v_ptr, k8_ptr, ks_ptr, vmax_ptr, cu_seqlens_k_ptr, slot, n_blocks, n_slots,
                      stride_k, stride_v, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                      ROUND_IN_F32: tl.constexpr):
    """Key block `slot` = (sequence, block, head): one K scale for its keys (written for each of them), e4m3 K
    (contiguous), and the block's V maximum (0 for a block past the end of its sequence). K's and V's tokens are
    stride_k and stride_v apart."""
    head = slot % N_KV_HEADS
    blk = (slot // N_KV_HEADS) % n_blocks
    seq = slot // (N_KV_HEADS * n_blocks)
    kv_start = tl.load(cu_seqlens_k_ptr + seq)
    seqlen = tl.load(cu_seqlens_k_ptr + seq + 1) - kv_start
    local = blk * BLOCK + tl.arange(0, BLOCK)
    ok = local < seqlen
    offs_d = tl.arange(0, HEAD_DIM)
    tok = (kv_start + local).to(tl.int64)
    in_head = head * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + tok[:, None] * stride_k + in_head, mask=ok[:, None], other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.max(tl.abs(k), axis=1), axis=0))
    dst = (tok[:, None] * N_KV_HEADS + head) * HEAD_DIM + offs_d[None, :]
    tl.store(k8_ptr + dst, _to_e4m3(_codes_jit(k, scale), ROUND_IN_F32), mask=ok[:, None])
    tl.store(ks_ptr + tok * N_KV_HEADS + head, tl.zeros([BLOCK], tl.float32) + scale, mask=ok)
    v = tl.load(v_ptr + tok[:, None] * stride_v + in_head, mask=ok[:, None], other=0.0).to(tl.float32)
    # head-major, so that the second launch reads one head's maxima as one contiguous run
    tl.store(vmax_ptr + head * (n_slots // N_KV_HEADS) + slot // N_KV_HEADS, tl.max(tl.max(tl.abs(v), axis=1), axis=0))


@triton.jit
def _quantize_qk_amax_v_kernel(q_ptr, k_ptr, v_ptr, q8_ptr, qs_ptr, k8_ptr, ks_ptr, vmax_ptr, cu_seqlens_k_ptr,
                        n_q_rows, n_blocks, n_kv_programs, stride_q, stride_k, stride_v,
                        N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    """First launch: programs 0..n_kv_programs - 1 take a key block each, the rest ROWS rows of Q each."""
    pid = tl.program_id(0)
    if pid < n_kv_programs:
        _quantize_k_block(k_ptr, v_ptr, k8_ptr, ks_ptr, vmax_ptr, cu_seqlens_k_ptr, pid, n_blocks, n_kv_programs,
                          stride_k, stride_v, N_KV_HEADS, HEAD_DIM, BLOCK, ROUND_IN_F32)
    else:
        _quantize_q_rows(q_ptr, q8_ptr, qs_ptr, (pid - n_kv_programs) * ROWS, n_q_rows, stride_q, N_HEADS,
                         HEAD_DIM, ROWS, ROUND_IN_F32)


@triton.jit
def _quantize_v_t_kernel(v_ptr, vt_ptr, vmax_ptr, v_scale_ptr, n_per_head, total_k, n_pad, stride_v,
                         N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                         SCAN: tl.constexpr, SCALED: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    """Second launch, program (i, head): positions i * BLOCK .. of the head's e4m3 V^T [D, n_pad]. The key
    permutation is inside aligned 16-token groups of the whole storage, sequences regardless, so a tile row is
    one token's V row and a transposed row a contiguous run; positions past total_k get zeros. SCALED: v is
    16-bit, scaled by the max of the head's n_per_head block maxima (program 0 writes it to v_scale_ptr);
    else v is e4m3 and only moved. v's tokens are stride_v apart."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = pid * BLOCK + tl.arange(0, BLOCK)
    tok = _token_at(pos)
    ok = tok < total_k
    v = tl.load(v_ptr + (tok.to(tl.int64) * stride_v + head * HEAD_DIM)[:, None] + offs_d[None, :],
                mask=ok[:, None], other=0.0)
    if SCALED:
        amax = tl.zeros([SCAN], tl.float32)
        for s0 in range(0, n_per_head, SCAN):
            idx = s0 + tl.arange(0, SCAN)
            amax = tl.maximum(amax, tl.load(vmax_ptr + head * n_per_head + idx, mask=idx < n_per_head, other=0.0))
        scale = _scale_of(tl.max(amax, axis=0))
        if pid == 0:
            tl.store(v_scale_ptr + head, scale)
        v8 = _to_e4m3(_codes_jit(v.to(tl.float32), scale), ROUND_IN_F32)
    else:
        v8 = v
    ptrs = (head * HEAD_DIM + offs_d).to(tl.int64)[:, None] * n_pad + pos[None, :]
    tl.store(vt_ptr + ptrs, tl.trans(v8), mask=(pos < n_pad)[None, :])


def _v_t_storage(total_k, n_kv_heads, head_dim, device):
    """(Hkv, D, n_pad) e4m3 storage of V^T: n_pad >= total_k + V_PAD, a multiple of 32 (prepare_fp8's)."""
    n_pad = _cdiv(total_k + V_PAD, 32) * 32
    return torch.empty(n_kv_heads, head_dim, n_pad, dtype=torch.float8_e4m3fn, device=device), n_pad


def _launch_v_t(v, vt, n_pad, vmax, v_scale, n_per_head, scaled):
    total_k, n_kv_heads, head_dim = v.shape
    scan = min(1024, triton.next_power_of_2(max(n_per_head, 16)))
    _quantize_v_t_kernel[(_cdiv(n_pad, KV_SCALE_BLOCK), n_kv_heads)](
        v, vt, vmax, v_scale, n_per_head, total_k, n_pad, v.stride(0),
        N_KV_HEADS=n_kv_heads, HEAD_DIM=head_dim, BLOCK=KV_SCALE_BLOCK, SCAN=scan, SCALED=scaled,
        ROUND_IN_F32=interpreting(), num_warps=8)


def fused_quantization_applies(q, k, v, hadamard=False, fp8_pv=True) -> bool:
    """Whether :func:`quantize_qkv_fp8` runs the Triton kernels (else it falls back to ``prepare_fp8``)."""
    d = q.shape[-1]
    return (not hadamard and fp8_pv and d & (d - 1) == 0 and 16 <= d <= 256
            and all(heads_packed(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) for x in (q, k, v)))


def heads_packed(x) -> bool:
    """Whether x (tokens, heads, D) has its heads packed within each token (D apart, each row contiguous), as a
    contiguous tensor or a view into a fused QKV projection's output has: the quantization kernels then read it
    in place, tokens x.stride(0) apart."""
    return x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def quantize_qkv_fp8(q, k, v, cu_seqlens_k=None, max_seqlen_k=None, hadamard=False, fp8_pv=True):
    """The fp8 operands of the attention kernels, ``prepare_fp8``'s tuple (q8, q_scale, k8, k_scale, v8, v_scale).

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D), 16-bit (fp32 for the CPU tests) with heads packed within each
    token (contiguous, or views into a fused QKV output: read in place, no copy), D a power of two;
    cu_seqlens_k: (B + 1,) int32 (None: one sequence); max_seqlen_k: longest key sequence (None: total_k, which
    only adds idle programs). Hadamard, fp8_pv=False and any other layout fall back to ``prepare_fp8``."""
    if not fused_quantization_applies(q, k, v, hadamard, fp8_pv):
        return prepare_fp8(q, k, v, hadamard, fp8_pv, cu_seqlens_k)
    total_q, n_heads, head_dim = q.shape
    total_k, n_kv_heads, _ = k.shape
    dev = q.device
    if cu_seqlens_k is None:
        cu_seqlens_k = torch.tensor([0, total_k], dtype=torch.int32, device=dev)
    n_blocks = _cdiv(max(max_seqlen_k if max_seqlen_k is not None else total_k, 1), KV_SCALE_BLOCK)
    n_kv_programs = (cu_seqlens_k.numel() - 1) * n_blocks * n_kv_heads
    q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=dev)
    k8 = torch.empty(k.shape, dtype=torch.float8_e4m3fn, device=dev)
    q_scale = torch.empty(total_q, n_heads, dtype=torch.float32, device=dev)
    k_scale = torch.empty(total_k, n_kv_heads, dtype=torch.float32, device=dev)
    vmax = torch.empty(n_kv_programs, dtype=torch.float32, device=dev)
    n_q_rows = total_q * n_heads
    _quantize_qk_amax_v_kernel[(n_kv_programs + _cdiv(n_q_rows, Q_ROWS),)](
        q, k, v, q8, q_scale, k8, k_scale, vmax, cu_seqlens_k, n_q_rows, n_blocks, n_kv_programs,
        q.stride(0), k.stride(0), v.stride(0), N_HEADS=n_heads, N_KV_HEADS=n_kv_heads, HEAD_DIM=head_dim,
        BLOCK=KV_SCALE_BLOCK, ROWS=Q_ROWS, ROUND_IN_F32=interpreting(),
        num_warps=8)
    vt, n_pad = _v_t_storage(total_k, n_kv_heads, head_dim, dev)
    v_scale = torch.empty(n_kv_heads, dtype=torch.float32, device=dev)
    _launch_v_t(v, vt, n_pad, vmax, v_scale, n_kv_programs // n_kv_heads, True)
    return q8, q_scale, k8, k_scale, vt[:, :, :total_k].permute(2, 0, 1), v_scale


def _descale(x, rows, heads, name, per_token_ok):
    """A descale factor as the kernels read it: float32 (rows, heads), head stride 1 (row stride 0 when given
    per head). x: a number, a 0-d or (heads,) tensor, or (rows, heads) when per_token_ok."""
    t = torch.as_tensor(x, dtype=torch.float32).to(x.device if torch.is_tensor(x) else "cpu")
    if t.dim() == 0 or t.shape == (1,):
        t = t.reshape(1).expand(heads)
    if t.shape == (heads,):
        return t.contiguous().expand(rows, heads)
    if per_token_ok and t.shape == (rows, heads):
        return t.contiguous()
    shapes = f"a number, ({heads},)" + (f" or ({rows}, {heads})" if per_token_ok else "")
    raise ValueError(f"{name} must be {shapes}: got shape {tuple(t.shape)}")


def fp8_operands(q8, k8, v8, q_descale, k_descale, v_descale):
    """The kernels' fp8 operands from e4m3 q8 (total_q, Hq, D), k8 and v8 (total_k, Hkv, D) in the plain layout
    and descale factors (value = code x descale, as FA3's descale_q/k/v): q_descale a number, (Hq,) or
    (total_q, Hq); k_descale and v_descale a number or (Hkv,). Only V is moved (to the transposed, key-permuted
    storage); q8 and k8 are used as they are."""
    for name, x in (("q", q8), ("k", k8), ("v", v8)):
        if x.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} must be torch.float8_e4m3fn for the pre-quantized fp8 call, got {x.dtype}")
    if any(d is None for d in (q_descale, k_descale, v_descale)):
        raise ValueError("pre-quantized fp8 q, k, v need q_descale, k_descale and v_descale")
    if k8.shape != v8.shape or q8.shape[-1] != k8.shape[-1] or q8.shape[1] % k8.shape[1]:
        raise ValueError(f"shapes q {tuple(q8.shape)}, k {tuple(k8.shape)}, v {tuple(v8.shape)} do not match")
    total_q, n_heads, head_dim = q8.shape
    total_k, n_kv_heads, _ = k8.shape
    dev = q8.device
    q_scale = _descale(q_descale, total_q, n_heads, "q_descale", True).to(dev)
    k_scale = _descale(k_descale, total_k, n_kv_heads, "k_descale", False).to(dev)
    v_scale = _descale(v_descale, 1, n_kv_heads, "v_descale", False)[0].contiguous().to(dev)
    q8, k8, v8 = q8.contiguous(), k8.contiguous(), v8.contiguous()
    vt, n_pad = _v_t_storage(total_k, n_kv_heads, head_dim, dev)
    _launch_v_t(v8, vt, n_pad, v_scale, v_scale, 1, False)
    return q8, q_scale, k8, k_scale, vt[:, :, :total_k].permute(2, 0, 1), v_scale


def kv_starts_aligned(cu_seqlens_k, known=None) -> bool:
    """Whether every key sequence starts on a multiple of 32 tokens (``known``, if the caller knows; else read
    from the device: one host sync)."""
    return bool((cu_seqlens_k % 32 == 0).all()) if known is None else bool(known)
