"""``explain``: which W4A16 kernel and config each quantized linear will run, at a few batch sizes.

The answer comes from the same pure selection the layers use at load time
(:func:`quantkit.kernels.w4a16_select.select_w4a16`), so it needs no GPU: name the GPU generation (default
``"sm90"``, the H200 the shipped table was measured on). Act-order layers are assumed to have contiguous groups
after the kernels' repack (true for GPTQ's ``desc_act``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from torch import nn

DEFAULT_MS = (1, 16, 2048)


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
            arch: str = "sm90") -> list[KernelPlanRow]:
    """Kernel and config per quantized linear of ``source`` at each of ``ms`` activation rows on ``arch``.

    ``source``: a quantized checkpoint folder, a model holding ``QuantLinear`` layers, or an iterable of
    ``(name, out_features, in_features, bits, group_size, sym, act_order)`` tuples."""
    from quantkit.kernels.w4a16_configs import config_label
    from quantkit.kernels.w4a16_select import facts_of, select_w4a16

    rows = []
    for name, n, k, bits, group_size, sym, act_order in _layers(source):
        facts = facts_of(n, k, bits, group_size, sym, act_order)
        for m in ms:
            choice = select_w4a16(m, facts, arch)
            label = "" if choice.config is None else config_label(choice.config)
            rows.append(KernelPlanRow(name, n, k, bits, group_size, m, choice.kernel, label, choice.reason))
    return rows


def _layers(source) -> list[tuple]:
    if isinstance(source, (str, Path)):
        from quantkit.checkpoint import inspect_checkpoint

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
