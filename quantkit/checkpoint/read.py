"""Reading quantized checkpoints back: validation, loading into a model.

The reader trusts nothing it has not checked: the quantization settings (``config.json``'s
``quantization_config`` and/or ``quantize_config.json``, see :mod:`quantkit.checkpoint.settings`)
must name a layout quantkit reads (GPTQ v1, GPTQ v2, AutoAWQ GEMM) with a supported bit width, and
agree with the tensor shapes; every safetensors file must be complete (its header's byte ranges
covered by the file); every tensor must be one the model expects, with the expected shape and
dtype, and every weight the model needs must be in the files. Each failure is a
:class:`QuantkitError` that names the file or the bad keys.

The model is built from its config with its parameters on the meta device (no memory, no random
initialization), the packed linears are swapped for :class:`QuantLinear`, and the tensors are
assigned from the files through :func:`read_tensors`, the one function that reads tensor data;
packed tensors of another layout are converted to GPTQ v1 on the way
(:mod:`quantkit.checkpoint.layouts`).

The safetensors files are :mod:`quantkit.checkpoint.files`, the model building both readers share
:mod:`quantkit.checkpoint.assemble`, the FP8 reader :mod:`quantkit.checkpoint.fp8_read`; the names other modules
import from here (``index_tensors``, ``read_tensors``, ``check_tensors``, ``parameters_on_meta``, ...) still are.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint.assemble import (  # noqa: F401  (_assign, parameters_on_meta: re-exported)
    _assign,
    _check_materialized,
    _load_generation_config,
    _load_tokenizer,
    _require_linear,
    _resolve_dtype,
    build_empty_model,
    check_tensors,
    parameters_on_meta,
)
from quantkit.checkpoint.files import (  # noqa: F401  (SAFETENSORS_DTYPES .. weight_files: re-exported)
    SAFETENSORS_DTYPES,
    TensorRecord,
    index_tensors,
    name_keys,
    packed_modules,
    read_header,
    read_tensors,
    weight_files,
)
from quantkit.checkpoint.format import QUANT_SUFFIXES
from quantkit.checkpoint.fp8 import is_fp8_checkpoint
from quantkit.checkpoint.fp8_read import fp8_linears, load_fp8  # noqa: F401  (fp8_linears: re-exported)
from quantkit.checkpoint.layouts import PackedGeometry, packed_geometry, stored_leaves, to_gptq_v1
from quantkit.checkpoint.settings import GPTQSettings, read_config, validate_quant_config  # noqa: F401
from quantkit.config import QuantkitError

# -- tensors as quantkit holds them ----------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointTensors:
    """A validated checkpoint folder whose packed linears read as GPTQ v1, whatever layout stores them.

    For readers that build their own model (the runtime): ``names`` are the keys a GPTQ v1
    checkpoint of the same model would hold (``<linear>.qweight/.qzeros/.scales/.g_idx`` and
    every other stored tensor), ``read(keys)`` returns them, converting packed linears on the way.
    """

    path: Path
    config: dict
    settings: GPTQSettings
    records: dict[str, TensorRecord]
    geometry: dict[str, PackedGeometry]

    @functools.cached_property
    def names(self) -> set[str]:
        leaves = stored_leaves(self.settings.layout)
        stored = {k for k in self.records if k.rpartition(".")[0] not in self.geometry
                  or k.rpartition(".")[2] not in leaves}
        return stored | {f"{name}.{leaf}" for name in self.geometry for leaf in QUANT_SUFFIXES}

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        unknown = [k for k in keys if k not in self.names]
        if unknown:
            raise QuantkitError(f"{self.path} holds no tensor {name_keys(unknown)}")
        leaves = stored_leaves(self.settings.layout)
        modules = {k.rpartition(".")[0] for k in keys if k.rpartition(".")[0] in self.geometry
                   and k.rpartition(".")[2] in QUANT_SUFFIXES}
        plain = [k for k in keys if k.rpartition(".")[0] not in modules or k.rpartition(".")[2] == "bias"]
        out = dict(read_tensors(self.records, plain))
        for name in modules:
            stored = {k.rpartition(".")[2]: t for k, t in read_tensors(self.records, [f"{name}.{x}" for x in leaves])}
            converted = to_gptq_v1(name, stored, self.settings, self.geometry[name])
            out.update({f"{name}.{leaf}": t for leaf, t in converted.items() if f"{name}.{leaf}" in keys})
        return {k: out[k] for k in keys}


def open_checkpoint(path: str | os.PathLike) -> CheckpointTensors:
    """Validate the checkpoint at ``path`` (settings, files, settings against tensor shapes); no data read."""
    path = Path(path)
    config, settings = read_config(path)
    records = index_tensors(path)
    names = packed_modules(records)
    if not names:
        raise QuantkitError(f"{path} declares a quantized layout but holds no packed linear (no .qweight)")
    geometry = {name: packed_geometry(name, records, settings) for name in names}
    return CheckpointTensors(path, config, settings, records, geometry)


# -- loading ----------------------------------------------------------------------------------------


def load_quantized(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None
) -> tuple[nn.Module, Any]:
    """Load a GPTQ (v1 or v2) or AutoAWQ GEMM checkpoint as a transformers model with :class:`QuantLinear` layers.

    ``dtype`` is the dtype of every unpacked tensor and of the activations: None keeps the dtype the
    checkpoint was saved in; ``"auto"`` is bfloat16 on CUDA and float32 on the CPU (as ``--dtype
    auto``); a name or torch dtype forces one. Returns ``(model, tokenizer)``; the tokenizer is None
    when the folder has none. The quantization settings are kept as ``model.quantkit_quant_config``.
    """
    path = Path(path)
    if is_fp8_checkpoint(path):  # compressed-tensors float-quantized (FP8): its own layout module
        return load_fp8(path, device=device, dtype=dtype)
    config, settings = read_config(path)
    records = index_tensors(path)
    model_dtype = _resolve_dtype(dtype, config, device)
    model = build_empty_model(config, model_dtype)
    from quantkit.moe.layout import prepare_moe_model

    prepare_moe_model(model)  # MoE: per-expert linears under the checkpoint's names (fused 3-D experts split)
    # Settings that the tensors contradict are refused before anything is built from them.
    geometry = {name: packed_geometry(name, records, settings) for name in _packed_linears(model, records)}
    install_quant_linears(model, records, settings, model_dtype)
    expected = check_tensors(model, records, geometry)
    _assign_tensors(model, records, expected, settings, geometry, device)
    model.tie_weights()
    model.to(device)  # non-persistent buffers (rotary tables) were built on the CPU
    _check_materialized(model, path)
    model.eval()
    model.quantkit_quant_config = settings.raw
    _load_generation_config(model, path)
    return model, _load_tokenizer(path)


def _assign_tensors(model: nn.Module, records: dict[str, TensorRecord], expected: dict[str, torch.Tensor],
                    settings: GPTQSettings, geometry: dict[str, PackedGeometry], device) -> None:
    """Read every tensor once; packed linears are converted to GPTQ v1 as soon as their parts are read."""
    leaves = stored_leaves(settings.layout)
    packed_keys = {f"{name}.{leaf}": name for name in geometry for leaf in leaves}
    targets = dict(model.state_dict(keep_vars=True))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in read_tensors(records, [*expected, *packed_keys]):
        name = packed_keys.get(key)
        if name is None:
            _assign(model, key, tensor, expected[key].dtype, device)
            continue
        parts = pending.setdefault(name, {})
        parts[key.rpartition(".")[2]] = tensor
        if len(parts) == len(leaves):
            for leaf, value in to_gptq_v1(name, pending.pop(name), settings, geometry[name]).items():
                _assign(model, f"{name}.{leaf}", value, targets[f"{name}.{leaf}"].dtype, device)


def install_quant_linears(
    model: nn.Module, records: dict[str, TensorRecord], settings: GPTQSettings, dtype: torch.dtype
) -> list[str]:
    """Replace each linear the checkpoint packs with an empty (meta) :class:`QuantLinear`."""
    from quantkit.qlinear import QuantLinear

    names = _packed_linears(model, records)
    for name in names:
        linear = model.get_submodule(name)
        try:
            qlinear = QuantLinear(
                linear.in_features,
                linear.out_features,
                settings.bits,
                settings.group_size,
                settings.sym,
                bias=linear.bias is not None,
                device="meta",
                bias_dtype=dtype,
            )
        except ValueError as exc:
            raise QuantkitError(f"{name} cannot be stored with bits={settings.bits}: {exc}") from exc
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, qlinear)
    return names


def _packed_linears(model: nn.Module, records: dict[str, TensorRecord]) -> list[str]:
    """Names of the packed linears, each checked to be a linear layer of ``model``."""
    names = packed_modules(records)
    if not names:
        raise QuantkitError("the checkpoint declares a quantized layout but holds no packed linear (no .qweight)")
    for name in names:
        _require_linear(model, name, "qweight")
    return names


__all__ = [
    "CheckpointTensors", "GPTQSettings", "TensorRecord", "index_tensors", "load_quantized", "name_keys",
    "open_checkpoint", "read_config", "read_tensors", "validate_quant_config",
]
