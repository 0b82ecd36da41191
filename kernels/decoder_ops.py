"""Fused Triton kernels for the small operations of a decoder step (RMSNorm with the residual add, rope with
the KV-cache write, the gated activation); their plain-PyTorch references are beside them in
:mod:`.decoder_ops_ref`. The runtime (:mod:`quantkit.runtime.model`) picks one or the other per backend.

At batch 1 a decode step of an 8B model has ~0.4 ms for everything but the linears: each of these
replaces 5-15 PyTorch launches per layer with one. Each kernel handles one token row per program
(rows are independent), computes in float32 and stores in the output's dtype.

On Hopper the norm, q/k norm and activation kernels launch with programmatic dependent launch (PDL): each lets
the next kernel launch at once (``griddepcontrol.launch_dependents``) and waits for the previous one
(``griddepcontrol.wait``) before it touches its input, so the GEMM behind it requests its first weights while this
kernel runs, and this kernel's own launch overlaps the tail of the one before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import pdl_launch, programmatic_launch
from quantkit.kernels.fp8_quant import WHOLE_ROW_MAX, e4m3_codes, e4m3_scale, quantize_per_token


@triton.jit
def _fp8_row_out(y, out_ptr, s_ptr, static_ptr, row, cols, ok, DTYPE: tl.constexpr, QUANT: tl.constexpr,
                 STATIC: tl.constexpr):
    """Store a finished float32 row ``y``: rounded to the model's DTYPE, or (QUANT) rounded to DTYPE as the
    16-bit output would be, then to e4m3 codes with the row's absmax scale (or the static one at ``static_ptr``)
    and that scale: bitwise what ``fp8_quant.quantize_per_token`` gives on the 16-bit output."""
    if QUANT:
        y = y.to(DTYPE).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = e4m3_scale(tl.max(tl.where(ok, tl.abs(y), 0.0), axis=0))
        tl.store(out_ptr + cols, e4m3_codes(y, scale), mask=ok)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(out_ptr + cols, y.to(DTYPE), mask=ok)


@dataclass(frozen=True)
class RowParts:
    """Token rows left as parts for the norm after them to add up: row ``t`` is the float32 sum of
    ``parts[t, 0], parts[t, 1], ...`` in that order, rounded once to ``dtype``, bitwise what a launch of its own
    (``moe_gemv._sum_parts_kernel``) would store. A MoE block's expert outputs end in this sum; done by the next
    add + RMSNorm, which reads the rows anyway, it costs no launch and no round trip (``parts`` [T, P, H], contiguous
    along H, float32 or the activations' dtype)."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.parts.shape[0], self.parts.shape[2])


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, static_ptr, H, eps, offset,
                         stride_x, stride_r, stride_o, stride_ro,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr = False,
                         STATIC: tl.constexpr = False, PARTS: tl.constexpr = False, n_parts=1, stride_xp=0):
    """``PARTS``: x is a :class:`RowParts` (``n_parts`` rows of ``stride_xp`` a token row), summed here first."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    if PARTS:  # in order, float32, rounded once: as the sum's own launch stores it (RowParts)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.range(0, n_parts, loop_unroll_factor=4):
            acc += tl.load(x_ptr + row * stride_x + i * stride_xp + cols, mask=ok, other=0.0).to(tl.float32)
        x = acc.to(res_out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # the model's add rounds
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    elif PARTS:  # the summed rows are the residual stream's next value
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    _fp8_row_out(xf * rstd * (w + offset), out_ptr + row * stride_o, s_ptr, static_ptr, row, cols, ok,
                 res_out_ptr.dtype.element_ty, QUANT, STATIC)


def add_rms_norm(x: torch.Tensor | RowParts, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`.decoder_ops_ref.add_rms_norm_ref`: ``x, residual [M, H]`` -> ``(normed, x + residual)``; ``x``
    may be a :class:`RowParts`, summed first."""
    m, h = x.shape
    out = torch.empty((m, h), device=weight.device, dtype=x.dtype)
    return out, _launch_add_rms_norm(x, residual, weight, eps, offset, out, None, None)


def add_rms_norm_fp8(x: torch.Tensor | RowParts, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     offset: float = 0.0, input_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` whose normed rows go straight to an FP8 linear: ``(codes float8_e4m3fn [M, H],
    scales float32 [M, 1], x + residual)``, the codes and scales bitwise ``quantize_per_token(normed,
    input_scale)``'s (the normed row is rounded to x's dtype first, as the 16-bit output would be). One launch
    instead of two, and the 16-bit normed rows are never written."""
    m, h = x.shape
    q = torch.empty((m, h), device=weight.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=weight.device, dtype=torch.float32)
    return q, s, _launch_add_rms_norm(x, residual, weight, eps, offset, q, s, input_scale)


def _launch_add_rms_norm(x, residual, weight, eps, offset, out, scales, input_scale) -> torch.Tensor:
    m, h = x.shape
    parts = isinstance(x, RowParts)
    if parts:
        rows = x.parts
        if rows.stride(2) != 1:
            raise ValueError("RowParts rows must be contiguous along H")
        res_out = torch.empty((m, h), device=rows.device, dtype=x.dtype)
        stride_x, n_parts, stride_xp = rows.stride(0), rows.shape[1], rows.stride(1)
        x = rows
    else:
        res_out = x if residual is None else torch.empty_like(x)
        stride_x, n_parts, stride_xp = x.stride(0), 1, 0
    res = x if residual is None else residual
    quant, static = scales is not None, input_scale is not None
    pdl = programmatic_launch(x.device)
    # the parts' sum reads P rows a token: 8 warps take the 2 programs x 4 warps the sum's own launch had
    warps = 8 if parts or h > 4096 else 4
    _add_rms_norm_kernel[(m,)](x, res, weight, out, res_out, scales if quant else out,
                               input_scale if static else out, h, eps, offset,
                               stride_x, res.stride(0), out.stride(0), res_out.stride(0),
                               HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h), PDL=pdl,
                               QUANT=quant, STATIC=static, PARTS=parts, n_parts=n_parts, stride_xp=stride_xp,
                               num_warps=warps, **pdl_launch(pdl))
    return res_out


@triton.jit
def _qk_norm_kernel(qkv_ptr, qw_ptr, kw_ptr, stride_t, eps, offset, N_Q: tl.constexpr, SEG_Q: tl.constexpr,
                    SEG_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # program (token, segment): segments 0..N_Q-1 are q's (heads, or the whole q), the rest k's; q and k lie side
    # by side at the start of the row, so segment j > N_Q starts at N_Q * SEG_Q + (j - N_Q) * SEG_K
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    if j < N_Q:
        start = j * SEG_Q
        seg = SEG_Q
        w = tl.load(qw_ptr + cols, mask=cols < SEG_Q, other=0.0).to(tl.float32)
    else:
        start = N_Q * SEG_Q + (j - N_Q) * SEG_K
        seg = SEG_K
        w = tl.load(kw_ptr + cols, mask=cols < SEG_K, other=0.0).to(tl.float32)
    ok = cols < seg
    base = qkv_ptr + t * stride_t + start
    if PDL:  # the norm weights (constants) are requested; q and k are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / seg + eps)
    tl.store(base + cols, (x * rstd * (w + offset)).to(qkv_ptr.dtype.element_ty), mask=ok)


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_heads: int, n_kv_heads: int,
            head_dim: int, eps: float, offset: float = 0.0, per_head: bool = True) -> None:
    """As :func:`.decoder_ops_ref.qk_norm_ref`, in one launch (the reference is ~10 PyTorch launches each for q
    and k: on the Qwen3-30B-A3B shape, 48 layers, about a third of a batch-1 decode step)."""
    m = qkv.shape[0]
    assert qkv.stride(1) == 1 and q_weight.is_contiguous() and k_weight.is_contiguous()
    seg_q, seg_k = (head_dim, head_dim) if per_head else (n_heads * head_dim, n_kv_heads * head_dim)
    n_q, n_k = (n_heads, n_kv_heads) if per_head else (1, 1)
    block = triton.next_power_of_2(max(seg_q, seg_k))
    pdl = programmatic_launch(qkv.device)
    _qk_norm_kernel[(m, n_q + n_k)](qkv, q_weight, k_weight, qkv.stride(0), eps, offset, N_Q=n_q, SEG_Q=seg_q,
                                    SEG_K=seg_k, BLOCK=block, PDL=pdl, num_warps=1 if block <= 256 else 4,
                                    **pdl_launch(pdl))


@triton.jit
def _add_sigmoid_gated_kernel(y_ptr, s_ptr, x_ptr, g_ptr, out_ptr, H, stride_y, stride_s, stride_x, stride_o,
                              BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    # program (row, block of columns); every program forms the row's gate itself (H values, from L2), so the whole
    # expression is one launch
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    hs = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + row * stride_x + hs, mask=hs < H, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + hs, mask=hs < H, other=0.0).to(tl.float32)
    z = tl.sum(x * g, 0).to(dtype).to(tl.float32)  # the linear's 16-bit output
    gate = (1.0 / (1.0 + tl.exp(-z))).to(dtype).to(tl.float32)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    s = tl.load(s_ptr + row * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y + (gate * s).to(dtype).to(tl.float32)).to(dtype), mask=ok)


def add_sigmoid_gated(y: torch.Tensor, s: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """As :func:`.decoder_ops_ref.add_sigmoid_gated_ref`, in one launch (the reference is six: the gate's linear,
    float, sigmoid, cast, product, sum)."""
    m, h = y.shape
    assert s.shape == x.shape == (m, h) and gate.numel() == h and y.stride(1) == s.stride(1) == x.stride(1) == 1
    out = torch.empty_like(y)
    block = min(1024, triton.next_power_of_2(h))
    _add_sigmoid_gated_kernel[(m, triton.cdiv(h, block))](y, s, x, gate.contiguous(), out, h, y.stride(0), s.stride(0),
                                                          x.stride(0), out.stride(0), BLOCK_H=triton.next_power_of_2(h),
                                                          BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                       stride_t, stride_cos, stride_cs, stride_cn, stride_ch,
                       N_HEADS: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr,
                       WRITE_CACHE: tl.constexpr, ks_ptr=None, vs_ptr=None, stride_ss=0, stride_sn=0,
                       FP8_KV: tl.constexpr = False):
    # program (token, head) over the Hq + Hkv rotated heads, and the Hkv value heads copied to the cache.
    # FP8_KV: the cache holds e4m3 codes, and a float32 scale a (slot, position, kv head) at ks_ptr / vs_ptr
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    base = qkv_ptr + t * stride_t + head * (2 * HALF)
    if head < N_HEADS + N_KV:
        x1 = tl.load(base + d).to(tl.float32)
        x2 = tl.load(base + HALF + d).to(tl.float32)
        c = tl.load(cos_ptr + pos * stride_cos + d)
        s = tl.load(sin_ptr + pos * stride_cos + d)
        y1 = (x1 * c - x2 * s).to(qkv_ptr.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(qkv_ptr.dtype.element_ty)
        tl.store(base + d, y1)
        tl.store(base + HALF + d, y2)
        if WRITE_CACHE:
            if head >= N_HEADS:
                slot = tl.load(slot_ptr + t).to(tl.int64)
                dst = k_cache_ptr + slot * stride_cs + pos * stride_cn + (head - N_HEADS) * stride_ch
                _cache_store(dst, y1, y2, d, HALF, k_cache_ptr, ks_ptr, slot, pos, head - N_HEADS, stride_ss,
                             stride_sn, FP8_KV)
    else:
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = v_cache_ptr + slot * stride_cs + pos * stride_cn + (head - N_HEADS - N_KV) * stride_ch
            _cache_store(dst, tl.load(base + d), tl.load(base + HALF + d), d, HALF, v_cache_ptr, vs_ptr, slot, pos,
                         head - N_HEADS - N_KV, stride_ss, stride_sn, FP8_KV)


@triton.jit
def _cache_store(dst, y1, y2, d, HALF: tl.constexpr, cache_ptr, scale_ptr, slot, pos, kv_head, stride_ss, stride_sn,
                 FP8_KV: tl.constexpr):
    """One head vector (its two halves, in the model's dtype) into the cache at ``dst``: as it is, or (FP8_KV) as
    e4m3 codes of its own absmax scale, the scale stored at (slot, pos, kv_head) of ``scale_ptr``
    (``fp8_quant_ref.quantize_kv_ref``'s rounding)."""
    if FP8_KV:
        a = y1.to(tl.float32)
        b = y2.to(tl.float32)
        scale = e4m3_scale(tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(b), axis=0)))
        tl.store(dst + d, e4m3_codes(a, scale))
        tl.store(dst + HALF + d, e4m3_codes(b, scale))
        tl.store(scale_ptr + slot * stride_ss + pos * stride_sn + kv_head, scale)
    else:
        tl.store(dst + d, y1.to(cache_ptr.dtype.element_ty))
        tl.store(dst + HALF + d, y2.to(cache_ptr.dtype.element_ty))


def rope_cache(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
               n_heads: int, n_kv_heads: int, head_dim: int, k_cache: torch.Tensor | None = None,
               v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """As :func:`.decoder_ops_ref.rope_cache_ref` (in place on ``qkv [M, (Hq + 2 Hkv) * D]``, rows contiguous)."""
    m = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos_table.stride(1) == 1
    write = k_cache is not None
    fp8 = write and k_scale is not None
    if write:
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    if fp8:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1 and k_scale.dtype == torch.float32
    kc = k_cache if write else qkv
    vc = v_cache if write else qkv
    strides = k_cache.stride()[:3] if write else (0, 0, 0)
    scales = dict(ks_ptr=k_scale, vs_ptr=v_scale, stride_ss=k_scale.stride(0), stride_sn=k_scale.stride(1),
                  FP8_KV=True) if fp8 else {}
    _rope_cache_kernel[(m, n_heads + 2 * n_kv_heads)](
        qkv, cos_table, sin_table, positions, slots if write else positions, kc, vc,
        qkv.stride(0), cos_table.stride(0), *strides,
        N_HEADS=n_heads, N_KV=n_kv_heads, HALF=head_dim // 2, WRITE_CACHE=write, num_warps=1, **scales)


@triton.jit
def gated_act(g, GELU: tl.constexpr):
    """The gate's activation in float32: silu, or (GELU) gelu with the tanh approximation."""
    if GELU:
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, s_ptr, static_ptr, inter, stride_x, stride_o, GELU: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr = False, STATIC: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # QUANT: one program holds the whole row
    ok = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    _fp8_row_out(gated_act(g, GELU) * u, out_ptr + row * stride_o, s_ptr, static_ptr, row, cols, ok,
                 x_ptr.dtype.element_ty, QUANT, STATIC)


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """As :func:`.decoder_ops_ref.act_mul_ref`: ``gate_up [M, 2 I]`` -> ``act(gate) * up [M, I]``."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((m, inter), device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, triton.next_power_of_2(inter))
    pdl = programmatic_launch(gate_up.device)
    _act_mul_kernel[(m, triton.cdiv(inter, block))](gate_up, out, out, out, inter, gate_up.stride(0), out.stride(0),
                                                   GELU=activation == "gelu_tanh", BLOCK=block, PDL=pdl, num_warps=4,
                                                   **pdl_launch(pdl))
    return out


def act_mul_fp8(gate_up: torch.Tensor, activation: str = "silu", input_scale: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`act_mul` whose rows go straight to an FP8 linear: ``(codes float8_e4m3fn [M, I], scales float32
    [M, 1])``, bitwise ``quantize_per_token(act_mul(gate_up), input_scale)``. One program a row holds the whole
    row (for its absmax); rows longer than ``WHOLE_ROW_MAX`` take those two launches."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    if inter > WHOLE_ROW_MAX:
        return quantize_per_token(act_mul(gate_up, activation), input_scale)
    q = torch.empty((m, inter), device=gate_up.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=gate_up.device, dtype=torch.float32)
    block = max(16, triton.next_power_of_2(inter))
    static = input_scale is not None
    pdl = programmatic_launch(gate_up.device)
    _act_mul_kernel[(m, 1)](gate_up, q, s, input_scale if static else s, inter, gate_up.stride(0), q.stride(0),
                            GELU=activation == "gelu_tanh", BLOCK=block, PDL=pdl, QUANT=True, STATIC=static,
                            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **pdl_launch(pdl))
    return q, s
