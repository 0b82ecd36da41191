"""Which kernels a checkpoint will run: ``explain`` for each quantized linear at a few batch sizes, and
``explain_attention`` for the runtime's attention at a few prompt lengths and at decode.

The answers come from the same pure selections the layers and the runtime use
(:func:`quantkit.kernels.w4a16_select.select_w4a16`, :func:`quantkit.kernels.attention_select.select_attention`),
so they need no GPU: name the GPU generation (default ``"sm90"``, the H200 the shipped tables were measured on).
Act-order layers are assumed to have contiguous groups after the kernels' repack (true for GPTQ's ``desc_act``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from torch import nn

DEFAULT_MS = (1, 16, 2048)
DEFAULT_PROMPTS = (256, 2048)


@dataclasses.dataclass(frozen=True)
class KernelPlanRow:
    """One (layer, M): the layer's shape and what serves it."""

    name: str
    out_features: int
    in_features: int
    bits: int
    group_size: int
    m: int
    kernel: str
    config: str
    reason: str


def explain(source: str | Path | nn.Module | Iterable, ms: Iterable[int] = DEFAULT_MS,
            arch: str = "sm90", card: str | None = None) -> list[KernelPlanRow]:
    """Kernel and config per quantized linear of ``source`` at each of ``ms`` activation rows on ``arch`` (and the
    GPU named ``card``: the table's entries measured on one card).

    ``source``: a quantized checkpoint folder, a model holding ``QuantLinear`` layers, or an iterable of
    ``(name, out_features, in_features, bits, group_size, sym, act_order)`` tuples."""
    from quantkit.kernels.w4a16_configs import config_label
    from quantkit.kernels.w4a16_select import facts_of, select_w4a16

    rows = []
    for name, n, k, bits, group_size, sym, act_order in _layers(source):
        facts = facts_of(n, k, bits, group_size, sym, act_order)
        for m in ms:
            choice = select_w4a16(m, facts, arch, card)
            label = "" if choice.config is None else config_label(choice.config)
            rows.append(KernelPlanRow(name, n, k, bits, group_size, m, choice.kernel, label, choice.reason))
    return rows


@dataclasses.dataclass(frozen=True)
class AttentionPlanRow:
    """One (phase, query tokens, kind of layer): the kernel the runtime's kernels backend runs and why."""

    phase: str  # "prefill" or "decode"
    tokens: int  # query tokens per sequence (the longest prompt of a prefill batch)
    layers: str  # "all", or "sliding" / "full" when the model mixes window and full layers
    kernel: str
    reason: str


def explain_attention(source, prompts: Iterable[int] = DEFAULT_PROMPTS, arch: str = "sm90",
                      dtype: str = "torch.bfloat16") -> list[AttentionPlanRow]:
    """Attention kernel per phase of the runtime: causal prefill of each prompt length in ``prompts`` (the
    selection reads the longest prompt of a batch) and one-token decode, for each kind of layer of ``source``
    (a checkpoint folder, a transformers config object, or a runtime ``ModelSpec``) on ``arch``."""
    from quantkit.kernels.attention_select import AttentionCall, select_attention

    spec = _model_spec(source)
    kinds = sorted({(spec.window_left(i), spec.attn_softcap) for i in range(spec.num_layers)}, reverse=True)
    rows = []
    for window_left, softcap in kinds:
        layers = "all" if len(kinds) == 1 else ("full" if window_left < 0 else "sliding")
        for n in prompts:
            call = AttentionCall(arch, dtype, dtype, spec.head_dim, causal=True, window_left=window_left,
                                 softcap=softcap, max_seqlen_q=n)
            rows.append(AttentionPlanRow("prefill", n, layers, *select_attention(call)))
        # the runtime decodes through one kernel whatever the layer: RoPE, the cache write and split-K attention
        rows.append(AttentionPlanRow("decode", 1, layers, "decode_rope",
                                     "one launch: RoPE, KV-cache write, split-K attention and the split combine"))
    return rows


def _model_spec(source):
    from quantkit.runtime.spec import ModelSpec, hf_config, spec_from_config

    if isinstance(source, ModelSpec):
        return source
    if isinstance(source, (str, Path)):
        import json

        with open(Path(source) / "config.json") as f:
            source = hf_config(json.load(f))
    return spec_from_config(source)


def _layers(source) -> list[tuple]:
    if isinstance(source, (str, Path)):
        from quantkit.checkpoint.save import inspect_checkpoint

        info = inspect_checkpoint(source)
        return [(name, out_f, in_f, info.bits, info.group_size, info.sym, info.desc_act)
                for name, in_f, out_f, _ in info.quantized]
    if isinstance(source, nn.Module):
        from quantkit.qlinear import QuantLinear

        return [(name, m.out_features, m.in_features, m.bits, m.group_size, m.sym, _act_order(m))
                for name, m in source.named_modules() if isinstance(m, QuantLinear)]
    return [tuple(layer) for layer in source]


def _act_order(layer) -> bool:
    g_idx = layer.g_idx
    return g_idx.device.type != "meta" and g_idx.numel() > 1 and bool((g_idx[1:] < g_idx[:-1]).any())
