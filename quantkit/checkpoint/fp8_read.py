"""Reading FP8 checkpoints back (compressed-tensors float-quantized; the format is :mod:`quantkit.checkpoint.fp8`):
the FP8 linears checked against their layers and settings, then served by :class:`quantkit.fp8_linear.FP8Linear`.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint.assemble import (
    _assign,
    _check_materialized,
    _load_generation_config,
    _load_tokenizer,
    _require_linear,
    _resolve_dtype,
    build_empty_model,
    check_tensors,
)
from quantkit.checkpoint.files import index_tensors, read_tensors
from quantkit.checkpoint.format import CONFIG_NAME
from quantkit.checkpoint.fp8 import _FOREIGN_LEAVES, FP8_LEAVES, FP8Settings, read_fp8_settings
from quantkit.config import QuantkitError

log = logging.getLogger(__name__)


def _check_fp8_tensors(name: str, linear: nn.Linear, records: dict, settings: FP8Settings) -> None:
    out_f, in_f = linear.out_features, linear.in_features
    w, s = records[f"{name}.weight"], records[f"{name}.weight_scale"]
    if w.dtype != torch.float8_e4m3fn or w.shape != (out_f, in_f):
        raise QuantkitError(f"{name}.weight is {w.dtype} {list(w.shape)}; the layer needs float8_e4m3fn "
                            f"[{out_f}, {in_f}]")
    if settings.strategy == "block":
        expected = [(math.ceil(out_f / settings.block[0]), math.ceil(in_f / settings.block[1]))]
    elif settings.strategy == "channel":
        expected = [(out_f, 1), (out_f,)]
    else:
        expected = [(1,), ()]
    if s.dtype not in (torch.float32, torch.bfloat16, torch.float16) or s.shape not in expected:
        raise QuantkitError(f"{name}.weight_scale is {s.dtype} {list(s.shape)}; {settings.strategy} weights need "
                            f"float {list(expected[0])}")
    has_input = f"{name}.input_scale" in records
    if settings.static_input and not has_input:
        raise QuantkitError(f"{name}.input_scale is missing; the config declares static activation scales")
    if has_input and records[f"{name}.input_scale"].numel != 1:
        raise QuantkitError(f"{name}.input_scale has {records[f'{name}.input_scale'].numel} values, one expected")


def fp8_linears(model: nn.Module, records: dict, settings: FP8Settings) -> list[str]:
    """Names of the linears the checkpoint stores in FP8 (those with a ``weight_scale``), each checked."""
    names = [k[: -len(".weight_scale")] for k in records if k.endswith(".weight_scale")]
    if not names:
        raise QuantkitError("the checkpoint declares FP8 weights but holds no weight_scale tensor")
    for name in names:
        linear = _require_linear(model, name, "weight_scale")
        if name in settings.ignore:
            raise QuantkitError(f"{name} is FP8 in the files but listed in the config's ignore")
        _check_fp8_tensors(name, linear, records, settings)
    return names


def load_fp8(path: str | os.PathLike, *, device: str | torch.device = "cpu",
             dtype: torch.dtype | str | None = None) -> tuple[nn.Module, Any]:
    """(model, tokenizer) from a compressed-tensors FP8 checkpoint (quantkit's or another tool's), its FP8 linears
    served by :class:`quantkit.fp8_linear.FP8Linear`; ``dtype`` as in ``checkpoint_read.load_quantized``."""
    from quantkit.checkpoint.settings import read_json_object
    from quantkit.fp8_linear import FP8Linear

    path = Path(path)
    config = read_json_object(path / CONFIG_NAME)
    settings = read_fp8_settings(config.get("quantization_config") or {}, str(path / CONFIG_NAME))
    records = index_tensors(path)
    foreign = [k for k in records if k.rpartition(".")[2] in _FOREIGN_LEAVES]
    if foreign:
        log.info("%s: %d tensors quantkit does not use (KV-cache / output scales, zero points) are skipped",
                 path, len(foreign))
    records = {k: r for k, r in records.items() if k not in foreign}
    model_dtype = _resolve_dtype(dtype, config, device)
    model = build_empty_model(config, model_dtype)
    from quantkit.moe.layout import prepare_moe_model

    prepare_moe_model(model)  # MoE: per-expert linears under the checkpoint's names (fused 3-D experts split)
    names = fp8_linears(model, records, settings)
    for name in names:  # scale buffers in the stored shapes, so check_tensors compares them; normalized below
        linear = model.get_submodule(name)
        static = f"{name}.input_scale" in records
        module = FP8Linear(linear.in_features, linear.out_features, settings.strategy, block=settings.block,
                           static_input=static, bias=linear.bias is not None, device="meta", dtype=model_dtype,
                           scale_shape=records[f"{name}.weight_scale"].shape,
                           input_scale_shape=records[f"{name}.input_scale"].shape if static else (1,))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    fp8_keys = {f"{n}.{leaf}" for n in names for leaf in FP8_LEAVES if f"{n}.{leaf}" in records}
    expected = check_tensors(model, records)
    for key, tensor in read_tensors(records, expected):
        module_name, _, leaf = key.rpartition(".")
        if key in fp8_keys:
            value = tensor if leaf == "weight" else _scale_shape(tensor, settings, leaf)
            model.get_submodule(module_name)._buffers[leaf] = value.to(device)
        else:
            _assign(model, key, tensor, expected[key].dtype, device)
    model.tie_weights()
    model.to(device)
    _check_materialized(model, path)
    model.eval()
    model.quantkit_quant_config = settings.raw
    _load_generation_config(model, path)
    return model, _load_tokenizer(path)


def _scale_shape(tensor: torch.Tensor, settings: FP8Settings, leaf: str) -> torch.Tensor:
    """A stored scale in the shape :class:`FP8Weight` holds: ``[out, 1]``, ``[1]`` or the block grid; float32."""
    t = tensor.float()
    if leaf == "input_scale" or settings.strategy == "tensor":
        return t.reshape(1)
    return t.reshape(-1, 1) if settings.strategy == "channel" else t
