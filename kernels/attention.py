"""Attention's front door: packed variable-length prefill attention, whatever kernel runs it.

Callers (the runtime, the custom op, benchmarks) import only this module. It checks the call, decides FP8
(``fp8="auto"``) and the backend (``backend="auto"``: `attention_select.select_attention`) and hands the call
to one of the backends behind it, each with the same contract:

* ``triton`` (:mod:`quantkit.kernels.attention_triton`): every case, sm_80 on and the CPU interpreter;
* ``gluon`` (:mod:`quantkit.kernels.attention_gluon`): Hopper, FA3's softmax / tensor-core overlap, 16-bit;
* ``gluon_ws`` (:mod:`quantkit.kernels.attention_gluon_ws`): Hopper, warp-specialized, 16-bit and FP8.

The Gluon backends share their building blocks through :mod:`quantkit.kernels.attention_gluon_common`.
:func:`attention_ref` is the plain-PyTorch reference.

Layout: packed (varlen), as servers batch requests. Sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v; a fixed-length batch is cu_seqlens = arange(B+1) * S
(`attention`).

    q: (total_q, Hq, D)      k, v: (total_k, Hkv, D)      out: (total_q, Hq, D)
    cu_seqlens_q: (B + 1,) int32, cu_seqlens_k: (B + 1,) int32

Masks use FlashAttention's bottom-right convention, so prefill-with-cache works: with
delta = seqlen_k - seqlen_q, query i may see key j iff
    j <= i + delta                       (causal)
    j >= i + delta - window_left         (sliding window, window_left >= 0)
Logit soft-capping (Gemma 2): s = cap * tanh(s / cap) on the scaled logits.
"""
import dataclasses
import math

import torch

from quantkit.kernels.attention_fp8 import (
    fp8_operands,
    fused_quantization_applies,
    kv_starts_aligned,
    quantize_qkv_fp8,
)
from quantkit.kernels.attention_select import (
    BACKENDS,
    AttentionCall,
    gluon_attention_supports,
    select_attention,
    select_fp8,
)
from quantkit.kernels.attention_triton import triton_forward
from quantkit.kernels.device_info import capability, gpu_arch


def _call_facts(q, k, causal, window_left, softcap, fp8, fp8_pv, cu_seqlens_k, kv_aligned, max_seqlen_q,
                max_seqlen_k=None):
    """The :class:`AttentionCall` of a call; the key alignment is read (one host sync) only where it matters.
    Without max_seqlen_k the keys' mean length stands in (no sync)."""
    arch = gpu_arch(q.device)
    aligned = True
    if fp8 and fp8_pv and arch == "sm90":
        aligned = cu_seqlens_k is not None and kv_starts_aligned(cu_seqlens_k, kv_aligned)
    if max_seqlen_k is None:
        max_seqlen_k = k.shape[0] // max(cu_seqlens_k.numel() - 1, 1) if cu_seqlens_k is not None else max_seqlen_q
    return AttentionCall(arch, str(q.dtype), str(k.dtype), q.shape[-1], causal, window_left, softcap, fp8, fp8_pv,
                         aligned, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=False, sm_scale=None,
                     window_left=-1, softcap=0.0, fp8=False, hadamard=False, fp8_pv=True, config=None,
                     fp8_prepared=None, backend="auto", kv_aligned=None, max_seqlen_k=None,
                     q_descale=None, k_descale=None, v_descale=None, out_dtype=torch.bfloat16):
    """Packed variable-length attention forward.

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D), fp16 or bf16 (fp32 too, for the CPU tests); any strides (views
    into a fused QKV output are read in place by the fp8 quantization, copied contiguous for the other paths);
    cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 cumulative offsets; max_seqlen_q: int.
    Hq must be a multiple of Hkv (GQA/MQA). window_left < 0: no window. softcap <= 0: none.
    fp8=True quantizes q, k, v (and P) to e4m3 with `attention_fp8.quantize_qkv_fp8` (hadamard, fp8_pv: see
    `attention_fp8.prepare_fp8`); max_seqlen_k sizes its grid (None: max_seqlen_q when cu_seqlens_k is
    cu_seqlens_q, else total_k). fp8="auto" does so only where the H200 measurements say FP8 is faster after
    paying for that quantization (`attention_select.select_fp8`), else runs 16-bit; fp8=True always quantizes.
    fp8_prepared passes that tuple in (q, k, v then give only shapes).
    e4m3 q, k, v come with q_descale, k_descale, v_descale (`attention_fp8.fp8_operands`); the output is then
    out_dtype.
    config: optional `attention_select.AttentionTiles` (BLOCK_M, BLOCK_N, num_warps, num_stages).
    backend: "triton" (`attention_triton`), "gluon" (`attention_gluon`: Hopper, head dim 64/128, no window / soft-cap,
    16-bit; config AttentionTiles with NUM_BUF as num_stages), "gluon_ws" (`attention_gluon_ws`, same cases
    plus fp8; config a `attention_select.WsConfig`), or "auto" (`attention_select.select_attention`).
    kv_aligned: whether every cu_seqlens_k entry is a multiple of 32, if the caller knows (`attention` does);
    the fp8 V^T descriptor needs it, and None checks on the device (one host sync per call).
    Returns out: (total_q, Hq, D) in q's dtype.
    """
    if max_seqlen_k is None and cu_seqlens_k is cu_seqlens_q:
        max_seqlen_k = max_seqlen_q
    if q.dtype == torch.float8_e4m3fn:  # the caller quantized: descale factors, and q, k, v for their shapes
        fp8_prepared = fp8_operands(q, k, v, q_descale, k_descale, v_descale)
        q, k, v = (_shape_of(x, out_dtype) for x in (q, k, v))
    if fp8 not in (False, True, "auto"):
        raise ValueError(f"fp8 must be False, True or 'auto', got {fp8!r}")
    call = None  # the facts the selections read; built once (the key alignment may cost a host sync)
    if fp8 == "auto" and fp8_prepared is not None:
        fp8 = True
    elif fp8 == "auto":
        call = _call_facts(q, k, causal, window_left, softcap, True, fp8_pv, cu_seqlens_k, kv_aligned, max_seqlen_q,
                           max_seqlen_k)
        fp8 = select_fp8(call)[0]
        call = dataclasses.replace(call, fp8=fp8)  # without fp8 the selection does not read kv_aligned
    quantize = fp8 and fp8_prepared is None
    fp8 = fp8 or fp8_prepared is not None
    if fp8_prepared is not None:
        fp8_pv = fp8_prepared[4].dtype == torch.float8_e4m3fn
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if backend != "triton":
        call = call or _call_facts(q, k, causal, window_left, softcap, fp8, fp8_pv, cu_seqlens_k, kv_aligned,
                                   max_seqlen_q, max_seqlen_k)
        if backend == "auto":
            # an explicit config is a Triton config
            backend = select_attention(call)[0] if config is None else "triton"
        else:
            ok, reason = gluon_attention_supports(call)
            if not ok:
                raise ValueError(f"the {backend} kernel does not handle this call: {reason}")
            if backend == "gluon" and fp8:
                raise ValueError("the FA3-ordered gluon kernel runs 16-bit attention only; fp8 runs in gluon_ws")
    if quantize and fused_quantization_applies(q, k, v, hadamard, fp8_pv):
        # read in place (views into a fused QKV output need no copy); the kernels then take q, k, v for shapes
        fp8_prepared = quantize_qkv_fp8(q, k, v, cu_seqlens_k, max_seqlen_k, hadamard, fp8_pv)
        q, k, v = (_shape_of(x, x.dtype) for x in (q, k, v))
    elif fp8_prepared is None:  # (prepared operands come with q, k, v as shapes only: nothing to copy)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if quantize:
            fp8_prepared = quantize_qkv_fp8(q, k, v, cu_seqlens_k, max_seqlen_k, hadamard, fp8_pv)
    if backend == "gluon":
        from quantkit.kernels.attention_gluon import attention_fa3_ordered

        return attention_fa3_ordered(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=causal,
                                      sm_scale=sm_scale, config=config)
    if backend == "gluon_ws":
        from quantkit.kernels.attention_gluon_ws import attention_ws

        return attention_ws(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=causal,
                                   sm_scale=sm_scale, config=config, fp8_prepared=fp8_prepared)
    # K / V tiles through tensor descriptors (TMA) on Hopper and newer; float32 inputs are reference runs
    use_tma = q.is_cuda and capability(q.device)[0] >= 9 and q.element_size() <= 2
    return triton_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, sm_scale, window_left,
                           softcap, fp8_prepared if fp8 else None, config, use_tma, kv_aligned)


def _shape_of(x, dtype):
    """x's shape and device in ``dtype``, no data (stride 0): with prepared fp8 operands the launchers read
    only the shape and dtype of q, k, v."""
    return torch.empty((), dtype=dtype, device=x.device).expand(x.shape)


def attention(q, k, v, causal=False, **kwargs):
    """Fixed-length batch: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) -> out (B, Sq, Hq, D). Keyword arguments as
    `attention_varlen` (fp8=True or "auto" on 16-bit inputs; e4m3 inputs with q_descale (a number, (Hq,) or
    (B * Sq, Hq)), k_descale and v_descale (a number or (Hkv,)))."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    dev = q.device
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=dev)
    # one tensor for both when the lengths match: each arange costs a launch and host time
    cu_k = cu_q if sk == sq else torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=dev)
    kwargs.setdefault("kv_aligned", sk % 32 == 0)  # the key starts are multiples of sk
    kwargs.setdefault("max_seqlen_k", sk)
    out = attention_varlen(q.reshape(b * sq, hq, d), k.reshape(b * sk, -1, d), v.reshape(b * sk, -1, d),
                           cu_q, cu_k, sq, causal=causal, **kwargs)
    return out.view(b, sq, hq, d)


def attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, sm_scale=None, window_left=-1,
                  softcap=0.0):
    """Plain-PyTorch reference, same packed layout and masks as `attention_varlen`; float32 math.

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D). Returns (total_q, Hq, D) float32.
    """
    d = q.shape[-1]
    group = q.shape[1] // k.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].float().transpose(0, 1)  # (Hq, Sq, D)
        kb = k[ck[b]:ck[b + 1]].float().repeat_interleave(group, 1).transpose(0, 1)
        vb = v[ck[b]:ck[b + 1]].float().repeat_interleave(group, 1).transpose(0, 1)
        s = qb @ kb.transpose(1, 2) * sm_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        sq, sk = qb.shape[1], kb.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if causal:
            keep &= j <= i + (sk - sq)
        if window_left >= 0:
            keep &= j >= i + (sk - sq) - window_left
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
        out[cq[b]:cq[b + 1]] = (p @ vb).transpose(0, 1)
    return out
