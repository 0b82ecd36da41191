"""Before the walk: put an MoE model in quantkit's layout and wrap the method so every expert is reached."""

from __future__ import annotations

from typing import Any

from torch import nn

from quantkit.arch import arch_for
from quantkit.config import QuantkitError
from quantkit.moe.experts import has_fused_experts


def prepare_for_quantization(model: nn.Module, method: Any, config: Any = None, streamed: bool = False) -> Any:
    """The method to walk ``model`` with: ``method`` itself for a dense model, else a
    :class:`~quantkit.moe.calibrate.MoEMethod` around it, after ``model``'s experts are unfused.

    A model with fused experts but no MoE record is walked as it is: its fused expert weights stay 16-bit
    and are named in a warning and in the report (``quantkit.coverage``)."""
    spec = arch_for(getattr(model.config, "model_type", ""))
    if spec is None or spec.moe is None:
        return method
    if streamed:
        raise QuantkitError("MoE models are not streamed from disk yet: load them whole (--stream off) "
                            "(docs/moe.md)")
    if method.name == "awq":
        raise QuantkitError("awq on MoE models is not supported yet; use gptq (the default) or rtn (docs/moe.md)")
    from quantkit.moe.calibrate import MoECalibConfig, MoEMethod
    from quantkit.moe.layout import prepare_moe_model

    prepare_moe_model(model, spec)
    if has_fused_experts(model):
        raise QuantkitError(f"{spec.family}: fused experts left after unfusing (an unknown expert layout)")
    return MoEMethod(method, config if config is not None else MoECalibConfig())
