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
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint.format import CONFIG_NAME, INDEX_NAME, QUANT_SUFFIXES, WEIGHTS_NAME
from quantkit.checkpoint.fp8 import _FOREIGN_LEAVES, FP8_LEAVES, FP8Settings, is_fp8_checkpoint, read_fp8_settings
from quantkit.checkpoint.layouts import PackedGeometry, packed_geometry, stored_leaves, to_gptq_v1
from quantkit.checkpoint.settings import GPTQSettings, read_config, validate_quant_config
from quantkit.config import QuantkitError

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_MAX_HEADER_BYTES = 100 * 2**20
_SHOW_KEYS = 5  # keys named in a message before "and N more"


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives and what its header says (no data read)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# -- safetensors files ------------------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint (from the index when there is one)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise QuantkitError(f"{index} is damaged ({exc}); re-create the checkpoint") from exc
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    elif (path / WEIGHTS_NAME).is_file():
        files = [path / WEIGHTS_NAME]
    elif len(others := sorted(path.glob("*.safetensors"))) == 1:
        # AutoGPTQ-era folders name their one file after the settings' model_file_base_name
        # (gptq_model-4bit-128g.safetensors).
        files = others
    else:
        found = f" but {len(others)} other .safetensors files and no index to say which" if others else ""
        raise QuantkitError(f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}{found}; the weights are missing")
    for file in files:
        if not file.is_file():
            raise QuantkitError(f"{file.name} is listed in {INDEX_NAME} but missing from {path}")
    return files


def read_header(file: Path) -> tuple[dict[str, TensorRecord], dict[str, str]]:
    """Tensor records and ``__metadata__`` of one safetensors file, after checking it is complete."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise QuantkitError(f"{file} is truncated ({size} bytes): not even a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise QuantkitError(
                f"{file} is truncated or not a safetensors file (header of {header_len} bytes)"
            )
        try:
            header = json.loads(handle.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QuantkitError(f"{file} has a damaged safetensors header ({exc})") from exc
    metadata = header.pop("__metadata__", None) or {}
    records, data_end = {}, 0
    for key, entry in header.items():
        try:
            dtype_name, shape, end = (
                entry["dtype"],
                tuple(int(d) for d in entry["shape"]),
                int(entry["data_offsets"][1]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise QuantkitError(f"{file} has a damaged header entry for {key} ({exc!r})") from exc
        if dtype_name not in SAFETENSORS_DTYPES:
            raise QuantkitError(f"{file}: tensor {key} has unsupported dtype {dtype_name!r}")
        records[key] = TensorRecord(file, SAFETENSORS_DTYPES[dtype_name], shape)
        data_end = max(data_end, end)
    expected = 8 + header_len + data_end
    if size != expected:
        state = "truncated" if size < expected else "longer than its header describes"
        raise QuantkitError(
            f"{file} is {state}: {size} bytes on disk, {expected} expected; the copy or the write was "
            "interrupted, re-create or re-copy the checkpoint"
        )
    return records, metadata


def index_tensors(path: Path) -> dict[str, TensorRecord]:
    """Every tensor of the checkpoint by key, from the file headers (validated, no data read)."""
    files = weight_files(path)
    records: dict[str, TensorRecord] = {}
    for file in files:
        file_records, _ = read_header(file)
        for key, record in file_records.items():
            if key in records:
                raise QuantkitError(f"tensor {key} appears in both {records[key].file.name} and {file.name}")
            records[key] = record
    index = path / INDEX_NAME
    if index.is_file():
        for key, name in json.loads(index.read_text())["weight_map"].items():
            if key not in records or records[key].file.name != name:
                raise QuantkitError(f"{INDEX_NAME} places {key} in {name}, but that file does not hold it")
    return records


def read_tensors(records: dict[str, TensorRecord], keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` for ``keys`` (CPU tensors as stored), opening each file once."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(records[key].file, []).append(key)
    for file, file_keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in file_keys:
                yield key, handle.get_tensor(key)


def packed_modules(records: dict[str, TensorRecord]) -> list[str]:
    """Names of the packed linears (those with a ``.qweight``), in file order."""
    return [key[: -len(".qweight")] for key in records if key.endswith(".qweight")]


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


def name_keys(keys: list[str]) -> str:
    """The first few ``keys`` and how many there are, for messages."""
    shown = ", ".join(keys[:_SHOW_KEYS])
    return shown if len(keys) <= _SHOW_KEYS else f"{shown} and {len(keys) - _SHOW_KEYS} more ({len(keys)} in all)"


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


__all__ = [
    "CheckpointTensors", "GPTQSettings", "TensorRecord", "index_tensors", "load_quantized", "name_keys",
    "open_checkpoint", "read_config", "read_tensors", "validate_quant_config",
]


# -- FP8 (compressed-tensors float-quantized; the format is quantkit.checkpoint.fp8) ---------------------


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
