"""The small operations of a decoder step, in plain PyTorch: the references the fused Triton kernels
(:mod:`quantkit.kernels.decoder_ops`) are tested against, and the CPU path.

Shapes: ``x [M, H]`` token rows; ``qkv [M, (Hq + 2 Hkv) * D]`` the fused projection's output; the KV
cache ``[slots, S_max, Hkv, D]`` per layer; ``positions`` / ``slots`` ``[M]`` int (where each token sits).
Every function computes in float32 and rounds once to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x / rms(x) * (offset + weight)`` over the last dimension."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (rounded to x's dtype, as a model adds in its dtype), then the norm of it.

    Returns ``(normed, new_residual)``; ``residual=None`` starts a stream (the new residual is x).
    """
    summed = x if residual is None else (residual.float() + x.float()).to(x.dtype)
    return rms_norm_ref(summed, weight, eps, offset), summed


def add_rms_norm_fp8_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         offset: float = 0.0, input_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_ref`, the normed rows then quantized to e4m3 per token (or with the static scale):
    ``(codes, scales [M, 1], new_residual)``, what ``decoder_ops.add_rms_norm_fp8`` computes in one launch."""
    from quantkit.kernels.fp8_quant_ref import quantize_per_token_ref

    normed, summed = add_rms_norm_ref(x, residual, weight, eps, offset)
    return (*quantize_per_token_ref(normed, input_scale), summed)


def qk_norm_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_heads: int, n_kv_heads: int,
                head_dim: int, eps: float, offset: float = 0.0, per_head: bool = True) -> None:
    """RMSNorm of q and k in place on ``qkv``: each head with the ``[D]`` weights (``per_head``: Qwen3, Gemma 3),
    or the whole q and the whole k projections with ``[Hq*D]`` / ``[Hkv*D]`` weights (OLMoE)."""
    m = qkv.shape[0]
    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
    if per_head:
        q, k = q.view(m, n_heads, head_dim), k.view(m, n_kv_heads, head_dim)
    q.copy_(rms_norm_ref(q, q_weight, eps, offset))
    k.copy_(rms_norm_ref(k, k_weight, eps, offset))


def add_sigmoid_gated_ref(y: torch.Tensor, s: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``y + sigmoid(x . gate) * s`` for rows ``[M, H]`` and ``gate [1, H]`` (Qwen2-MoE's shared expert ``s`` scaled
    by its gate and added to the routed experts' ``y``), each step rounded to the activations' dtype as the
    model's own ops round them."""
    return y + torch.sigmoid(F.linear(x, gate).float()).to(s.dtype) * s


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout: ``x [M, heads, D]``, ``cos, sin [M, D/2]`` float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_cache_ref(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                   n_heads: int, n_kv_heads: int, head_dim: int, k_cache: torch.Tensor | None = None,
                   v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Rotate q and k of ``qkv`` in place and, with a cache, write k and v at ``[slots, positions]``; with
    ``k_scale, v_scale [slots, S, Hkv]`` the cache holds e4m3 codes (``fp8_quant_ref.quantize_kv_ref``)."""
    m = qkv.shape[0]
    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    pos = positions.long()
    cos, sin = cos_table[pos], sin_table[pos]
    q = qkv[:, :q_size].view(m, n_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(m, n_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(m, n_kv_heads, head_dim)
    q.copy_(rotate_ref(q, cos, sin))
    k.copy_(rotate_ref(k, cos, sin))
    if k_cache is not None:
        kv_write_ref(k_cache, v_cache, k_scale, v_scale, slots.long(), pos, k, v)


def kv_write_ref(k_cache, v_cache, k_scale, v_scale, slots, pos, k, v) -> None:
    """Keys and values ``[M, Hkv, D]`` into the cache at ``[slots, pos]``: as they are, or (with scales) as e4m3
    codes and their scales."""
    if k_scale is None:
        k_cache[slots, pos] = k.to(k_cache.dtype)
        v_cache[slots, pos] = v.to(v_cache.dtype)
        return
    from quantkit.kernels.fp8_quant_ref import quantize_kv_ref

    k_cache[slots, pos], k_scale[slots, pos] = quantize_kv_ref(k)
    v_cache[slots, pos], v_scale[slots, pos] = quantize_kv_ref(v)


def act_mul_ref(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up [M, 2 I]`` (gate first) -> ``[M, I]``."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return (act * up).to(gate_up.dtype)


def act_mul_fp8_ref(gate_up: torch.Tensor, activation: str = "silu", input_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`act_mul_ref` quantized to e4m3 per token (or with the static scale): ``(codes, scales [M, 1])``."""
    from quantkit.kernels.fp8_quant_ref import quantize_per_token_ref

    return quantize_per_token_ref(act_mul_ref(gate_up, activation), input_scale)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (identity when cap is 0)."""
    return x if not cap else torch.tanh(x / cap) * cap
