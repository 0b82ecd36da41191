"""quantkit's MoE layout of a transformers model: experts as named linears, blocks under checkpoint names.

``prepare_moe_model`` is applied to a model before it is quantized and to the empty model the reader
builds, so that module names equal checkpoint names: ``...mlp.experts.{e}.{gate_proj,up_proj,down_proj}``
(Qwen2/3-MoE, OLMoE) or ``...block_sparse_moe.experts.{e}.{w1,w3,w2}`` with ``block_sparse_moe.gate``
(Mixtral), the names vLLM's fused-MoE loader maps (``FusedMoE.make_expert_params_mapping``).
"""

from __future__ import annotations

import logging

from torch import nn

from quantkit.arch import ArchSpec, arch_for, find_decoder_layers
from quantkit.moe.experts import has_fused_experts, unfuse_experts

log = logging.getLogger(__name__)


def rename_block(layer: nn.Module, model_name: str, name: str) -> None:
    """Register ``layer``'s sub-module ``model_name`` as ``name`` (state dict and module names) while
    ``layer.<model_name>`` still reaches it (the layer's forward uses that attribute)."""
    if model_name == name or model_name not in layer._modules:
        return
    module = layer._modules.pop(model_name)
    layer._modules[name] = module
    object.__setattr__(layer, model_name, module)  # an instance attribute outside _modules: found first


def prepare_moe_model(model: nn.Module, spec: ArchSpec | None = None) -> int:
    """Unfuse ``model``'s fused experts and rename its MoE blocks per the family record; returns the number of
    MoE blocks now in quantkit's layout (0 for a dense model or a family without an MoE record)."""
    spec = spec if spec is not None else arch_for(getattr(model.config, "model_type", ""))
    if spec is None or spec.moe is None:
        return 0
    moe = spec.moe
    _, layers = find_decoder_layers(model)
    count = 0
    for layer in layers:
        block = getattr(layer, moe.model_block, None)
        if block is None or not hasattr(block, moe.experts):
            continue  # a dense layer (Qwen3-MoE's mlp_only_layers)
        if has_fused_experts(block):
            unfuse_experts(block, moe.expert_names)
        rename_block(layer, moe.model_block, moe.block)
        count += 1
    if count:
        log.info("%s: %d MoE blocks, experts as separate linears under %s.%s.{e}.{%s}", spec.family, count,
                 moe.block, moe.experts, ",".join(moe.expert_names))
    return count
