"""Before the walk: put an MoE model in quantkit's layout and wrap the method so every expert is reached."""

from __future__ import annotations

from typing import Any

from torch import nn

from quantkit.arch import arch_for
from quantkit.config import QuantkitError
from quantkit.moe.experts import find_separate_experts, has_fused_experts


def prepare_layout(model: nn.Module) -> int:
    """Unfuse ``model``'s experts into per-expert linears under the checkpoint names (before anything looks
    for linears: the group size, partial groups); returns the number of MoE blocks (0: dense or no record).

    A model with fused experts but no MoE record is left as it is: its fused expert weights stay 16-bit and
    are named in a warning and in the report (``quantkit.coverage``). A streamed model was put in this
    layout on the meta device when it was opened (``quantkit.models.lazy.open_streamed``): its layers are
    read from the files' per-expert tensors, and this call changes nothing more."""
    spec = arch_for(getattr(model.config, "model_type", ""))
    if spec is None or spec.moe is None:
        return 0
    from quantkit.moe.layout import prepare_moe_model

    count = prepare_moe_model(model, spec)
    if has_fused_experts(model):
        raise QuantkitError(f"{spec.family}: fused experts left after unfusing (an unknown expert layout)")
    return count


def wrap_method(model: nn.Module, method: Any, config: Any = None) -> Any:
    """``method`` for a dense model; a :class:`~quantkit.methods.moe.MoEMethod` around it when ``model``
    has experts in quantkit's layout (``prepare_layout``)."""
    if not find_separate_experts(model):
        return method
    from quantkit.methods.moe import MoECalibConfig, MoEMethod

    return MoEMethod(method, config if config is not None else MoECalibConfig())


def prepare_for_quantization(model: nn.Module, method: Any, config: Any = None) -> Any:
    """``prepare_layout`` then ``wrap_method`` (scripts and tests that build the method first)."""
    prepare_layout(model)
    return wrap_method(model, method, config)
