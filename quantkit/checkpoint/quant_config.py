"""``quantization_config`` for config.json: the keys each GPTQ reader honours, and where they come from.

Written by :func:`build_quantization_config` for :func:`quantkit.checkpoint.save_quantized`. The
reader-by-reader notes are in that function's docstring; the rules were checked against the loaders'
sources (transformers 5.24 ``GPTQConfig``, optimum ``GPTQQuantizer.convert_model``, vLLM
``gptq_utils`` and ``GPTQMarlinConfig.from_config``, GPTQModel 7.6 ``QuantizeConfig.from_quant_config``
and its loader), and against GPTQModel itself by ``bench/verify_independent_reader.py``.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from quantkit.arch import arch_for, find_decoder_layers, find_linear_like, sequential_groups
from quantkit.checkpoint.format import LAYOUT
from quantkit.config import QuantkitError, QuantScheme
from quantkit.qtensor import QuantizedWeight

# Fields GPTQ readers know that a method may report through ``extra`` (lifted to the top level).
_METHOD_FIELDS = ("damp_percent", "true_sequential", "static_groups")


def build_quantization_config(
    model: nn.Module, weights: dict[str, QuantizedWeight], *, scheme: QuantScheme, method: str, extra: dict
) -> dict[str, Any]:
    """``quantization_config`` for config.json. Which reader honours which key:

    * ``quant_method``, ``bits``, ``group_size``, ``sym``, ``desc_act``: every GPTQ reader
      (transformers' ``GPTQConfig``, optimum's ``GPTQQuantizer``, vLLM's ``gptq``/``gptq_marlin``,
      GPTQModel's ``QuantizeConfig``).
    * ``checkpoint_format: "gptq"`` (v1 zero points): transformers (legacy spelling of ``format``),
      optimum and GPTQModel; vLLM's gptq path assumes v1.
    * ``lm_head``: vLLM and GPTQModel (whether ``lm_head`` is packed; default false).
    * ``block_name_to_quantize`` + ``modules_in_block_to_quantize`` (list of lists, in quantization
      order): optimum/transformers convert only the block linears whose name ends with an entry;
      vLLM (``is_layer_gptq_quantized``) treats a linear as packed when an entry is a substring of its
      name, and otherwise infers the packed layers from the safetensors dtypes.
    * ``dynamic`` with ``-:`` regexes: GPTQModel and vLLM leave matching modules unquantized
      (transformers/optimum ignore it, hence ``modules_in_block_to_quantize`` as well).
    * ``meta.quantizer``: GPTQModel's producer record (``"tool:version"``).
    * ``quantkit``: ours (producing method, version, layout, calibration info from ``extra``).
    """
    acts = [qw for qw in weights.values() if qw.act_order]
    block_modules, dynamic, unquantized = _module_lists(model, weights)
    lm_head_name = _lm_head_name(model)
    from quantkit.version import __version__

    config: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "sym": scheme.sym,
        "desc_act": bool(acts),
        "static_groups": bool(extra.get("static_groups", False)),
        "true_sequential": bool(extra.get("true_sequential", True)),
        "checkpoint_format": "gptq",
        "lm_head": lm_head_name is not None and lm_head_name in weights,
        "meta": {"quantizer": [f"quantkit:{__version__}"]},
    }
    if "damp_percent" in extra:
        config["damp_percent"] = float(extra["damp_percent"])
    config.update(block_modules)
    if dynamic:
        config["dynamic"] = dynamic
    config["quantkit"] = {
        "method": method,
        "version": __version__,
        "layout": LAYOUT,
        "unquantized_linears": unquantized,
        **{k: v for k, v in extra.items() if k not in _METHOD_FIELDS},
    }
    _check_scheme(weights, scheme)
    return config


def _check_scheme(weights: dict[str, QuantizedWeight], scheme: QuantScheme) -> None:
    for name, qw in weights.items():
        if (qw.bits, qw.group_size, qw.sym) != (scheme.bits, scheme.group_size, scheme.sym):
            raise QuantkitError(
                f"{name} was quantized with bits={qw.bits} group_size={qw.group_size} sym={qw.sym}, but the "
                f"checkpoint scheme is bits={scheme.bits} group_size={scheme.group_size} sym={scheme.sym}; "
                "one checkpoint holds one scheme"
            )


def _module_lists(model: nn.Module, weights: dict[str, QuantizedWeight]) -> tuple[dict, dict, list[str]]:
    """(``block_name_to_quantize``/``modules_in_block_to_quantize`` entries, ``dynamic``, unquantized linears).

    When every decoder layer packs the same linears, the lists use names relative to a layer
    (``self_attn.q_proj``) grouped in true-sequential order; otherwise full module names.
    """
    prefix, layers = find_decoder_layers(model)
    spec = arch_for(getattr(getattr(model, "config", None), "model_type", ""))
    per_layer: list[tuple[list[str], list[str]]] = []  # (packed, plain) relative names per layer
    for i, layer in enumerate(layers):
        linears = find_linear_like(layer)
        packed = [rel for rel in linears if f"{prefix}.{i}.{rel}" in weights]
        per_layer.append((packed, [rel for rel in linears if rel not in packed]))
    in_blocks = {f"{prefix}.{i}.{rel}" for i, (packed, _) in enumerate(per_layer) for rel in packed}
    lm_head_name = _lm_head_name(model)
    outside = sorted(set(weights) - in_blocks - {lm_head_name})
    if outside:
        raise QuantkitError(
            f"{outside[0]} is quantized but sits outside the decoder layers ({prefix}); GPTQ readers only "
            "load packed linears inside the decoder layers and lm_head"
        )
    same_everywhere = all(set(p) == set(per_layer[0][0]) for p, _ in per_layer)
    if same_everywhere:
        linears = find_linear_like(layers[0])
        groups = sequential_groups(spec, {rel: linears[rel] for rel in per_layer[0][0]})
    else:
        groups = [
            [f"{prefix}.{i}.{rel}" for rel in group]
            for i, (packed, _) in enumerate(per_layer)
            for group in sequential_groups(spec, {rel: None for rel in packed})
        ]
    dynamic = _negative_patterns(prefix, per_layer)
    unquantized = [f"{prefix}.{i}.{rel}" for i, (_, plain) in enumerate(per_layer) for rel in plain]
    if lm_head_name is not None and lm_head_name not in weights:
        unquantized.append(lm_head_name)
    block_modules = {"block_name_to_quantize": prefix, "modules_in_block_to_quantize": groups}
    return block_modules, dynamic, unquantized


def _negative_patterns(prefix: str, per_layer: list[tuple[list[str], list[str]]]) -> dict[str, dict]:
    """``dynamic`` entries ``-:<regex>`` (matched from the start of a module name) for unpacked linears."""
    plain_sets = [set(plain) for _, plain in per_layer]
    everywhere = set.intersection(*plain_sets) if plain_sets else set()
    patterns: dict[str, dict] = {}
    for rel in sorted(everywhere):
        patterns[f"-:{re.escape(prefix)}\\.\\d+\\.{re.escape(rel)}$"] = {}
    for i, plain in enumerate(plain_sets):
        for rel in sorted(plain - everywhere):
            patterns[f"-:{re.escape(f'{prefix}.{i}.{rel}')}$"] = {}
    return patterns


def _lm_head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)
