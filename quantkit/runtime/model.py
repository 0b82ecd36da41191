"""The runtime's decoder: one forward for the Llama and Gemma families over a preallocated KV cache.

Three entry points share :meth:`RuntimeModel._hidden`: ``forward_logits`` (a full causal pass, no
cache: verification), ``prefill`` (packed prompts of several sequences, written into their cache
slots) and ``decode`` (one token per sequence; no host sync and no data-dependent Python control
flow, so a CUDA graph can capture it). The backend decides which implementation each operation
takes: "kernels" (quantkit's Triton kernels, CUDA) or "reference" (plain PyTorch, any device).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from quantkit.kernels import decoder_ops_ref as ops
from quantkit.kernels.device_info import ab_switch
from quantkit.runtime.kv_budget import check_kv_dtype
from quantkit.runtime.spec import ModelSpec, layer_rope_key, rope_tables
from quantkit.runtime.weights import ModelWeights

BACKENDS = ("kernels", "reference")


@dataclass
class KVCache:
    """Per layer ``k[i], v[i] [slots, max_seq_len, Hkv, D]``; the last slot is scratch (padding rows).
    ``counters``: int32 zeros, ``slots * Hkv``, that the fused decode kernel borrows (and leaves zeroed) to
    combine its splits. An FP8 cache (``kv_dtype="fp8"``) holds e4m3 codes in ``k``/``v`` and a float32 scale a
    token and KV head in ``k_scale[i], v_scale[i] [slots, max_seq_len, Hkv]``: 1 + 4 / D bytes a value instead of
    2; attention reads each entry as codes x scale in the model's dtype (``fp8_quant_ref.dequantize_kv_ref``)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    counters: torch.Tensor | None = None
    k_scale: list[torch.Tensor] | None = None
    v_scale: list[torch.Tensor] | None = None

    @classmethod
    def allocate(cls, spec: ModelSpec, slots: int, max_seq_len: int, dtype, device, kv_dtype: str = "auto"
                 ) -> KVCache:
        """``kv_dtype``: "auto" (the model's ``dtype``) or "fp8" (see the class)."""
        fp8 = check_kv_dtype(kv_dtype) == "fp8"
        shape = (slots, max_seq_len, spec.num_kv_heads, spec.head_dim)
        codes = torch.float8_e4m3fn if fp8 else dtype

        def per_layer(shape, dtype):
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]

        return cls(
            per_layer(shape, codes),
            per_layer(shape, codes),
            torch.zeros(slots * spec.num_kv_heads, dtype=torch.int32, device=device),
            per_layer(shape[:3], torch.float32) if fp8 else None,
            per_layer(shape[:3], torch.float32) if fp8 else None,
        )

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[1]

    def scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``i``'s ``(k_scale, v_scale)``, or ``(None, None)`` for a 16-bit cache."""
        return (self.k_scale[i], self.v_scale[i]) if self.fp8 else (None, None)

    def entries(self, i: int, slot: int, end: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values ``[end, Hkv, D]`` of ``slot``, as attention reads them (in ``dtype``)."""
        k, v = self.k[i][slot, :end], self.v[i][slot, :end]
        if not self.fp8:
            return k, v
        from quantkit.kernels.fp8_quant_ref import dequantize_kv_ref

        return (dequantize_kv_ref(k, self.k_scale[i][slot, :end], dtype),
                dequantize_kv_ref(v, self.v_scale[i][slot, :end], dtype))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + (self.k_scale or []) + (self.v_scale or []))


class _Reference:
    """Plain PyTorch for every small operation and attention."""

    add_rms_norm = staticmethod(ops.add_rms_norm_ref)
    qk_norm = staticmethod(ops.qk_norm_ref)
    rope_cache = staticmethod(ops.rope_cache_ref)
    act_mul = staticmethod(ops.act_mul_ref)
    add_rms_norm_fp8 = staticmethod(ops.add_rms_norm_fp8_ref)
    act_mul_fp8 = staticmethod(ops.act_mul_fp8_ref)

    @staticmethod
    def prefill_attention(q, k, v, cu_seqlens, max_len, scale, window_left, softcap, cu_k=None, max_k=None, fp8=False,
                          kv_aligned=None):
        """Causal attention of packed query rows; keys ``cu_k`` (default: the queries' own) end where the
        queries end (a chunk attends to the prompt before it). ``fp8``: the kernels backend's choice; the reference
        stays 16-bit (kernels/attention_fp8.py has FP8's reference)."""
        from quantkit.kernels.attention import attention_ref

        return attention_ref(
            q, k, v, cu_seqlens, cu_seqlens if cu_k is None else cu_k, causal=True, sm_scale=scale,
            window_left=window_left, softcap=softcap,
        ).to(q.dtype)

    @staticmethod
    def decode_attention_rope(qkv, cos, sin, positions, slots, k_cache, v_cache, n_heads, counters, scale,
                              window_left, softcap, qk_norm=None, k_scale=None, v_scale=None):
        from quantkit.kernels.decode_attention import decode_attention_rope_ref

        return decode_attention_rope_ref(
            qkv, cos, sin, positions, slots, k_cache, v_cache, n_heads, sm_scale=scale, window_left=window_left,
            softcap=softcap, qk_norm=qk_norm, k_scale=k_scale, v_scale=v_scale,
        )


class _Kernels:
    """quantkit's Triton kernels (the W4A16 GEMM is chosen per linear by :class:`.weights.Linear`)."""

    def __init__(self) -> None:
        from quantkit.kernels import decoder_ops as fused_kernels

        self.add_rms_norm = fused_kernels.add_rms_norm
        self.qk_norm = fused_kernels.qk_norm
        self.rope_cache = fused_kernels.rope_cache
        self.act_mul = fused_kernels.act_mul
        self.add_rms_norm_fp8 = fused_kernels.add_rms_norm_fp8  # the FP8 linears' fused producers
        self.act_mul_fp8 = fused_kernels.act_mul_fp8

    @staticmethod
    def prefill_attention(q, k, v, cu_seqlens, max_len, scale, window_left, softcap, cu_k=None, max_k=None, fp8=False,
                          kv_aligned=None):
        from quantkit.kernels.attention import attention_varlen

        return attention_varlen(
            q,  # views into the QKV output: the fp8 quantization reads them in place, other paths copy
            k,
            v,
            cu_seqlens,
            cu_seqlens if cu_k is None else cu_k,
            max_len,
            causal=True,
            sm_scale=scale,
            window_left=window_left,
            softcap=softcap,
            max_seqlen_k=max_k,
            fp8=fp8,
            kv_aligned=kv_aligned,
        )

    @staticmethod
    def decode_attention_rope(qkv, cos, sin, positions, slots, k_cache, v_cache, n_heads, counters, scale,
                              window_left, softcap, qk_norm=None, k_scale=None, v_scale=None):
        from quantkit.kernels.decode_attention import decode_attention_rope
        from quantkit.kernels.device_info import programmatic_launch

        return decode_attention_rope(
            qkv, cos, sin, positions, slots, k_cache, v_cache, n_heads, counters, sm_scale=scale,
            window_left=window_left, softcap=softcap, pdl=programmatic_launch(qkv.device), qk_norm=qk_norm,
            k_scale=k_scale, v_scale=v_scale,
        )


class RuntimeModel:
    """A decoder's weights, its rope tables and the backend that runs it. ``config``: the HF config."""

    def __init__(
        self,
        spec: ModelSpec,
        config,
        weights: ModelWeights,
        *,
        backend: str,
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int | None = None,
        name: str = "model",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.spec, self.config, self.weights = spec, config, weights
        self.backend, self.dtype, self.device, self.name = backend, dtype, torch.device(device), name
        self.ops = _Kernels() if backend == "kernels" else _Reference()
        for linear in weights.linears():  # the reference backend's 16-bit linears stay on plain PyTorch
            linear.gemv = backend == "kernels"
        for layer in weights.layers:  # MoE experts: the fused Triton kernel, or its PyTorch reference
            if layer.moe is not None:
                layer.moe.use_kernel = backend == "kernels"
        # An FP8 model's prefill attention stays 16-bit by default: inside the 8B and 30B-A3B prefills the FP8
        # call that fp8="auto" picks (kernels/attention_select.select_fp8) took ~2x the 16-bit one, and the whole
        # 30B-A3B FP8 prefill ran 9-15 % faster without it (one H100, 2026-12-06, docs/fp8.md).
        # QUANTKIT_PREFILL_FP8_ATTENTION=auto puts it back (the A/B switch for the benches); the KV cache and
        # decode attention are 16-bit either way.
        fp8_attention = ab_switch("QUANTKIT_PREFILL_FP8_ATTENTION", ("off", "auto")) == "auto"
        self.prefill_fp8 = "auto" if fp8_attention and any(lin.fp8 is not None for lin in weights.linears()) else False
        # Qwen3's / Gemma 3's per-head q/k norm inside the decode attention instead of a launch of its own
        # (QUANTKIT_DECODE_QK_NORM=attention; opt-in until a whole decode step measures it faster). Not with
        # clip_qkv, which clips between the norm and the attention.
        switch = ab_switch("QUANTKIT_DECODE_QK_NORM", ("separate", "attention"))
        self.qk_norm_in_decode = switch == "attention" and spec.qk_norm == "head" and not spec.clip_qkv
        # A MoE block's routed rows summed by the next layer's add + RMSNorm (the default: one launch a layer fewer,
        # the same bits on the decode GEMV's float32 parts) or by a launch of their own (QUANTKIT_MOE_SUM=apart).
        # Qwen3-30B-A3B shape, batch-1 graph step, two alternating rounds (one H100, 2026-12-07, docs/moe.md):
        # int4 2.349 / 2.356 ms against 2.406 / 2.411 apart, bf16 3.684 / 3.676 against 3.878 / 3.857.
        self.moe_sum_in_norm = (backend == "kernels" and not spec.sandwich_norms
                                and ab_switch("QUANTKIT_MOE_SUM", ("norm", "apart")) == "norm")
        self.max_positions = max_positions or spec.max_position_embeddings
        self.rope = rope_tables(config, spec, self.device, self.max_positions)
        self.layer_rope = [self.rope[layer_rope_key(config, i, self.rope)] for i in range(spec.num_layers)]
        self.embed_scale = torch.tensor(spec.embed_scale, dtype=dtype).item() if spec.embed_scale != 1.0 else 1.0

    # -- the decoder ----------------------------------------------------------------------------------

    def qk_norm(self, qkv: torch.Tensor, layer) -> None:
        """RMSNorm of q and k in place on a ``layer``'s ``qkv`` (Qwen3, Gemma 3, OLMoE). Public for the bench's
        decode split."""
        s = self.spec
        self.ops.qk_norm(qkv, layer.q_norm, layer.k_norm, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_eps,
                         s.norm_offset, per_head=s.qk_norm == "head")

    def _hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, attend, cache: KVCache | None, slots: torch.Tensor | None,
        rope_in_attention: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[M, H]`` of token rows ``ids [M]`` at ``positions [M]``.

        ``attend(layer, qkv) -> [M, Hq * D]`` runs attention on the rotated ``qkv`` (the cache, if any,
        already holds this step's keys and values); with ``rope_in_attention`` on the projection's output
        as it is, rotating and writing the cache itself.
        """
        s, o = self.spec, self.ops
        h = self.weights.embed[ids]
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        delta, residual = h, None
        for i, lw in enumerate(self.weights.layers):
            qkv, residual = self._normed_linear(lw.qkv, delta, residual, lw.input_norm)
            if s.qk_norm and not (rope_in_attention and self.qk_norm_in_decode):
                self.qk_norm(qkv, lw)
            if s.clip_qkv:
                qkv.clamp_(-s.clip_qkv, s.clip_qkv)
            if not rope_in_attention:
                cos, sin = self.layer_rope[i]
                o.rope_cache(
                    qkv,
                    cos,
                    sin,
                    positions,
                    s.num_heads,
                    s.num_kv_heads,
                    s.head_dim,
                    None if cache is None else cache.k[i],
                    None if cache is None else cache.v[i],
                    slots,
                    *((None, None) if cache is None else cache.scales(i)),
                )
            delta = lw.o(attend(i, qkv))
            ff_norm = lw.post_attn_norm
            if s.sandwich_norms:
                delta, _ = o.add_rms_norm(delta, None, lw.post_attn_norm, s.rms_eps, s.norm_offset)
                ff_norm = lw.pre_ff_norm
            if lw.moe is not None:
                delta, residual = lw.moe.normed(delta, residual, ff_norm, s.rms_eps, s.norm_offset, o.add_rms_norm,
                                                o.act_mul, parts=self.moe_sum_in_norm)
            else:
                gate_up, residual = self._normed_linear(lw.gate_up, delta, residual, ff_norm)
                delta = self._activated_linear(lw.down, gate_up)
            if s.sandwich_norms:
                delta, _ = o.add_rms_norm(delta, None, lw.post_ff_norm, s.rms_eps, s.norm_offset)
        x, _ = o.add_rms_norm(delta, residual, self.weights.final_norm, s.rms_eps, s.norm_offset)
        return x

    def _normed_linear(self, linear, delta, residual, norm):
        """``(linear(rms_norm(delta + residual)), delta + residual)``; an FP8 linear that takes codes gets them
        from the norm kernel itself (one launch fewer, the same codes: ``decoder_ops.add_rms_norm_fp8``)."""
        s, o = self.spec, self.ops
        if linear.takes_fp8_codes:
            qx, sx, residual = o.add_rms_norm_fp8(delta, residual, norm, s.rms_eps, s.norm_offset,
                                                  linear.fp8.input_scale)
            return linear.from_codes(qx, sx, delta.dtype), residual
        x, residual = o.add_rms_norm(delta, residual, norm, s.rms_eps, s.norm_offset)
        return linear(x), residual

    def _activated_linear(self, linear, gate_up):
        """``linear(act(gate) * up)``, the codes from the activation kernel where the FP8 linear takes them."""
        s, o = self.spec, self.ops
        if linear.takes_fp8_codes:
            qx, sx = o.act_mul_fp8(gate_up, s.activation, linear.fp8.input_scale)
            return linear.from_codes(qx, sx, gate_up.dtype)
        return linear(o.act_mul(gate_up, s.activation))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[M, V]`` of final hidden states (with Gemma's final soft-cap)."""
        return ops.softcap(self.weights.lm_head(hidden).float(), self.spec.final_softcap)

    def prefill_attend(self, cu_seqlens: torch.Tensor, max_len: int, kv_aligned: bool | None = None):
        """``attend(layer, qkv [M, q+2kv]) -> [M, q]``: causal attention of whole prompts packed at ``cu_seqlens``
        (no cache read), in FP8 where ``prefill_fp8`` picks it. Public for the bench's prefill split."""
        s = self.spec

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            m = qkv.shape[0]
            q = qkv[:, : s.q_size].view(m, s.num_heads, s.head_dim)
            k = qkv[:, s.q_size : s.q_size + s.kv_size].view(m, s.num_kv_heads, s.head_dim)
            v = qkv[:, s.q_size + s.kv_size :].view(m, s.num_kv_heads, s.head_dim)
            out = self.ops.prefill_attention(
                q, k, v, cu_seqlens, max_len, s.softmax_scale, s.window_left(i), s.attn_softcap,
                fp8=self.prefill_fp8, kv_aligned=kv_aligned if self.prefill_fp8 else None,
            )
            return out.reshape(m, s.q_size)

        return attend

    def _chunk_attend(self, cu_q: torch.Tensor, max_q: int, slots: list[int], ends: list[int], cache: KVCache):
        """Attention of prompt chunks over everything their slots hold up to each chunk's end (the chunk's
        own keys were written there just before, by the rope step)."""
        s, dev = self.spec, self.device
        cu_k = torch.tensor([0, *itertools.accumulate(ends)], dtype=torch.int32, device=dev)

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            m = qkv.shape[0]
            q = qkv[:, : s.q_size].view(m, s.num_heads, s.head_dim)
            entries = [cache.entries(i, slot, end, qkv.dtype) for slot, end in zip(slots, ends)]
            k = torch.cat([e[0] for e in entries])  # [sum(ends), Hkv, D]
            v = torch.cat([e[1] for e in entries])
            out = self.ops.prefill_attention(
                q, k, v, cu_q, max_q, s.softmax_scale, s.window_left(i), s.attn_softcap, cu_k=cu_k, max_k=max(ends)
            )
            return out.reshape(m, s.q_size)

        return attend

    # -- entry points ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One causal pass without a cache: ``input_ids [B, T]`` -> float32 logits ``[B, T, V]``."""
        b, t = input_ids.shape
        ids = input_ids.to(self.device).reshape(-1)
        positions = torch.arange(t, device=self.device, dtype=torch.int32).repeat(b)
        cu = torch.arange(0, (b + 1) * t, t, device=self.device, dtype=torch.int32)
        hidden = self._hidden(ids, positions, self.prefill_attend(cu, t, kv_aligned=t % 32 == 0), None, None)
        return self.logits(hidden).view(b, t, -1)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int], cache: KVCache,
                starts: list[int] | None = None) -> torch.Tensor:
        """Run prompts, or chunks of them, into their cache ``slots``: chunk b holds the prompt's tokens from
        position ``starts[b]`` on (default 0: whole prompts), and attends to what the slot holds before it.
        float32 logits ``[B, V]`` of each chunk's last token."""
        lengths = [len(p) for p in prompts]
        starts = starts or [0] * len(prompts)
        dev = self.device
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        positions = torch.tensor([a + i for a, n in zip(starts, lengths) for i in range(n)], dtype=torch.int32,
                                 device=dev)
        token_slots = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], dtype=torch.int32, device=dev)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int32, device=dev)
        if any(starts):
            attend = self._chunk_attend(cu, max(lengths), slots, [a + n for a, n in zip(starts, lengths)], cache)
        else:
            aligned = all(o % 32 == 0 for o in offsets)  # known on the host: no device check in the FP8 attention
            attend = self.prefill_attend(cu, max(lengths), aligned)
        hidden = self._hidden(ids, positions, attend, cache, token_slots)
        last = torch.tensor(offsets[1:], dtype=torch.long, device=dev) - 1
        return self.logits(hidden[last])

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """One token per row: ``tokens [B]`` long at ``positions [B]`` int32 in cache ``slots [B]`` int32 ->
        float32 logits ``[B, V]``. Graph-safe: fixed shapes, no host sync on the kernels backend."""
        s = self.spec
        counters = cache.counters

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            # RoPE, the cache write, attention and the split combine (and the q/k norm where qk_norm_in_decode):
            # one launch on the kernels backend
            cos, sin = self.layer_rope[i]
            lw = self.weights.layers[i]
            norm = (lw.q_norm, lw.k_norm, s.rms_eps, s.norm_offset) if self.qk_norm_in_decode else None
            k_scale, v_scale = cache.scales(i)
            return self.ops.decode_attention_rope(
                qkv, cos, sin, positions, slots, cache.k[i], cache.v[i], s.num_heads, counters, s.softmax_scale,
                s.window_left(i), s.attn_softcap, qk_norm=norm, k_scale=k_scale, v_scale=v_scale,
            )

        with torch.inference_mode():
            return self.logits(self._hidden(tokens, positions, attend, cache, slots, rope_in_attention=True))
