"""Building a transformers model from a checkpoint's files, the parts both readers share (the INT4 reader
:mod:`quantkit.checkpoint.read` and the FP8 reader :mod:`quantkit.checkpoint.fp8_read`): the architecture from
``config.json`` with its parameters on the meta device (no memory, no random initialization), the stored tensors
matched against the model's (keys, shapes, dtypes; the error names what is missing or extra), each tensor assigned
in the working dtype, and the tokenizer and generation config beside the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint.files import TensorRecord, name_keys
from quantkit.checkpoint.format import QUANT_SUFFIXES
from quantkit.checkpoint.layouts import PackedGeometry
from quantkit.config import QuantkitError


def _resolve_dtype(dtype: torch.dtype | str | None, config: dict, device: str | torch.device = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    name = dtype if dtype is not None else (config.get("dtype") or config.get("torch_dtype") or "float32")
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(str(name), str(name))
    if name not in ("float32", "float16", "bfloat16"):
        raise QuantkitError(f"dtype must be float32, float16 or bfloat16, got {name!r}")
    return getattr(torch, name)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device while the model is built.

    Buffers stay real, so non-persistent ones computed in ``__init__`` (rotary frequency tables)
    keep their values; parameters cost no memory and no initialization until loaded.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_empty_model(config: dict, dtype: torch.dtype) -> nn.Module:
    """The architecture of ``config`` with meta parameters, its own GPTQ integration kept out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k not in ("quantization_config", "dtype", "torch_dtype")}
    model_type = plain.pop("model_type", None)
    try:
        hf_config = AutoConfig.for_model(model_type, **plain)
    except (ValueError, KeyError) as exc:
        raise QuantkitError(
            f"config.json names model_type {model_type!r}, which transformers does not know"
        ) from exc
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def _require_linear(model: nn.Module, name: str, leaf: str) -> nn.Linear:
    """``model``'s linear layer ``name``, or an error naming the stored tensor ``name.leaf`` that has none."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear):
        raise QuantkitError(f"{name}.{leaf}: {type(model).__name__} has no linear layer {name}")
    return linear


def check_tensors(
    model: nn.Module, records: dict[str, TensorRecord], geometry: dict[str, PackedGeometry] | None = None
) -> dict[str, torch.Tensor]:
    """Match checkpoint keys, shapes and dtypes against the model; returns key -> model tensor.

    The packed linears in ``geometry`` (checked against the settings by ``packed_geometry``) must have
    the model layer's sizes; their stored tensors are left out of the result (they are converted,
    not copied). Every tensor the model needs must be in the files, and every tensor in the files
    must be one the model has: otherwise the error names them (first few and the count).
    """
    geometry = geometry or {}
    expected = dict(model.state_dict(keep_vars=True))
    for name, geo in geometry.items():
        layer = model.get_submodule(name)
        if (layer.in_features, layer.out_features) != (geo.in_features, geo.out_features):
            raise QuantkitError(
                f"{name} is stored with {geo.in_features} inputs and {geo.out_features} outputs; the model's layer "
                f"has {layer.in_features} and {layer.out_features} (config.json does not match the weights)"
            )
    provided = {f"{name}.{leaf}" for name in geometry for leaf in QUANT_SUFFIXES}
    unexpected = [k for k in records if k not in expected and k not in provided]
    if unexpected:
        files = sorted({records[k].file.name for k in unexpected})
        raise QuantkitError(f"unexpected tensor {name_keys(unexpected)} in {', '.join(files)}: the model has no "
                            "such weight; the checkpoint does not belong to this config.json")
    out = {}
    for key, record in records.items():
        if key in provided:
            continue
        target = expected[key]
        if tuple(target.shape) != record.shape:
            raise QuantkitError(
                f"{key} in {record.file.name} has shape {list(record.shape)}, the model expects {list(target.shape)}"
            )
        if target.is_floating_point() != record.dtype.is_floating_point:
            raise QuantkitError(f"{key} is {record.dtype} in {record.file.name}, the model expects {target.dtype}")
        out[key] = target
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in expected if k not in records and k not in provided and k not in tied]
    if missing:
        raise QuantkitError(f"the checkpoint lacks tensor {name_keys(missing)}; without them the model would run "
                            "on random weights. Re-create or re-copy the checkpoint")
    return out


def _assign(model: nn.Module, key: str, tensor: torch.Tensor, target_dtype: torch.dtype, device) -> None:
    module_name, _, leaf = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    tensor = tensor.to(device=device, dtype=target_dtype if tensor.is_floating_point() else tensor.dtype)
    if leaf in module._parameters:
        setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
    else:
        setattr(module, leaf, tensor)


def _check_materialized(model: nn.Module, path: Path) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type == "meta":
            raise QuantkitError(f"{path}: the checkpoint lacks tensor {name}")


def _load_tokenizer(path: Path) -> Any:
    if not any(
        (path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _load_generation_config(model: nn.Module, path: Path) -> None:
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
