"""Writing quantized checkpoints: GPTQ v1 safetensors that transformers, vLLM and GPTQModel load.

A checkpoint folder holds

* ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards plus
  ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``). Every quantized
  linear ``name`` appears as ``name.qweight`` int32, ``name.qzeros`` int32, ``name.scales`` float16,
  ``name.g_idx`` int32 (+ ``name.bias``) in the layout documented in :mod:`quantkit.pack`; every other
  tensor (embeddings, norms, an unquantized ``lm_head``) in one 16-bit dtype. Tied embeddings are
  stored once. Each file's safetensors metadata carries ``format: pt`` and the layout.
* ``config.json`` with ``quantization_config`` (see :func:`build_quantization_config` for which key
  each reader honours), tokenizer files and ``generation_config.json``.

Everything is written into a hidden temporary sibling folder and renamed into place only when
complete, so an interrupted write never leaves a folder that looks like a checkpoint.

Reading lives in :mod:`quantkit.checkpoint_read` and :mod:`quantkit.checkpoint_inspect`;
``load_quantized`` and ``inspect_checkpoint`` are re-exported here so callers import one module.
File names and layout tags shared by both sides are in :mod:`quantkit.checkpoint_format`; the AWQ
GEMM layout in :mod:`quantkit.checkpoint_layouts`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint_config import build_quantization_config
from quantkit.checkpoint_format import (
    CONFIG_NAME,
    INDEX_NAME,
    LAYOUT,
    LAYOUT_AWQ_GEMM,
    QUANT_SUFFIXES,
    WEIGHTS_NAME,
)
from quantkit.checkpoint_inspect import CheckpointInfo, inspect_checkpoint
from quantkit.checkpoint_layouts import awq_quantization_config, export_awq_layout
from quantkit.checkpoint_read import load_quantized
from quantkit.config import QuantkitError, QuantScheme
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)

__all__ = [
    "CONFIG_NAME", "INDEX_NAME", "QUANT_SUFFIXES", "WEIGHTS_NAME", "CheckpointInfo", "PendingTensor",
    "build_state_dict", "inspect_checkpoint", "load_quantized", "plan_shards", "resolve_save_dtype",
    "save_quantized", "shard_name", "write_shards",
]
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_SAVE_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def save_quantized(
    model: nn.Module,
    weights: dict[str, QuantizedWeight],
    output_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    method: str,
    scheme: QuantScheme,
    extra: dict | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 4 * 2**30,
    save_dtype: str = "auto",
    layout: str = "gptq",
) -> Path:
    """Write ``model`` with ``weights`` (full module name -> packed linear) as a GPTQ v1 checkpoint.

    ``save_dtype`` applies to every tensor that is not packed: ``"auto"`` keeps the model's 16-bit
    dtype (the dtype of its input embeddings) and uses bfloat16 for a float32 model (bfloat16 has
    float32's range, so nothing overflows); ``"float16"`` / ``"bfloat16"`` force one. ``QuantLinear``
    modules already in ``model`` (a loaded checkpoint) are written as they are. ``extra`` is stored
    under ``quantization_config.quantkit`` (calibration info and the like); ``damp_percent``,
    ``true_sequential`` and ``static_groups`` in it are also written at the top level, where GPTQ
    readers look for them. ``layout="awq"`` writes the AWQ GEMM layout instead (4-bit, asymmetric,
    contiguous groups; for tools that only read AutoAWQ checkpoints; quantkit's own reader reads the
    GPTQ layout). Returns the output folder.
    """
    if layout not in ("gptq", "awq"):
        raise QuantkitError(f"--format must be gptq or awq, got {layout!r}")
    output = Path(output_dir)
    _refuse_existing(output, overwrite)
    if max_shard_bytes <= 0:
        raise QuantkitError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    extra = dict(extra or {})
    _require_json(extra, "extra")
    weights = _collect_weights(model, weights)
    dtype = resolve_save_dtype(model, save_dtype)
    state_dict, dropped_aliases = build_state_dict(model, weights, dtype)
    quant_config = build_quantization_config(model, weights, scheme=scheme, method=method, extra=extra)
    quant_config["quantkit"]["save_dtype"] = _dtype_name(dtype)
    lm_head_quantized = quant_config["lm_head"]
    if layout == "awq":
        state_dict, quant_config = _to_awq_layout(state_dict, weights, scheme, quant_config)
    config = _config_dict(model, quant_config, dtype, lm_head_quantized=lm_head_quantized)

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        metadata = _file_metadata(scheme, quant_config)
        files = write_shards(tmp, state_dict, plan_shards(state_dict, max_shard_bytes), metadata)
        (tmp / CONFIG_NAME).write_text(
            json.dumps(config, indent=2, sort_keys=True, default=_json_default) + "\n"
        )
        _save_extras(tmp, model, tokenizer)
        _publish(tmp, output, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "wrote %d quantized linears in %d file(s) to %s (tied aliases dropped: %s)",
        len(weights),
        len(files),
        output,
        ", ".join(dropped_aliases) or "none",
    )
    return output


# -- what goes into the files -------------------------------------------------------------------


def _to_awq_layout(
    state: dict[str, PendingTensor], weights: dict[str, QuantizedWeight], scheme: QuantScheme, gptq_config: dict
) -> tuple[dict[str, PendingTensor], dict]:
    """Swap every packed linear's GPTQ tensors for the AWQ GEMM ones (bit order in quantkit.pack)."""
    awq_tensors = export_awq_layout(weights)
    out: dict[str, PendingTensor] = {}
    for key, pending in state.items():
        module_name, _, leaf = key.rpartition(".")
        if module_name in weights and leaf in ("qweight", "qzeros", "scales", "g_idx", "bias"):
            for awq_key in (f"{module_name}.{k}" for k in ("qweight", "qzeros", "scales", "bias")):
                if awq_key in awq_tensors and awq_key not in out:
                    out[awq_key] = PendingTensor(awq_tensors[awq_key])
            continue
        out[key] = pending
    unquantized = [n.rpartition(".")[2] for n in gptq_config.get("quantkit", {}).get("unquantized_linears", [])]
    config = awq_quantization_config(scheme, sorted(set(unquantized)) or None)
    config["quantkit"] = {**gptq_config.get("quantkit", {}), "layout": LAYOUT_AWQ_GEMM}
    return out, config


def _collect_weights(model: nn.Module, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """``weights`` plus any ``QuantLinear`` already in the model, each checked against its module."""
    from quantkit.qlinear import QuantLinear

    merged = {
        name: m.to_quantized_weight() for name, m in model.named_modules() if isinstance(m, QuantLinear)
    }
    merged.update(weights)
    if not merged:
        raise QuantkitError("nothing to save: no quantized linear layers were given")
    modules = dict(model.named_modules())
    for name, qw in merged.items():
        module = modules.get(name)
        if not isinstance(module, (nn.Linear, QuantLinear)):
            raise QuantkitError(
                f"quantized weight {name!r} does not name a linear layer of {type(model).__name__}"
            )
        if (module.in_features, module.out_features) != (qw.in_features, qw.out_features):
            raise QuantkitError(
                f"quantized weight {name!r} is [{qw.out_features}, {qw.in_features}] but the layer is "
                f"[{module.out_features}, {module.in_features}]"
            )
    return merged


def resolve_save_dtype(model: nn.Module, save_dtype: str) -> torch.dtype:
    """The 16-bit dtype for unpacked tensors (see :func:`save_quantized`)."""
    name = _SAVE_DTYPE_ALIASES.get(save_dtype, save_dtype)
    if name in SAVE_DTYPES:
        return SAVE_DTYPES[name]
    if name != "auto":
        raise QuantkitError(f"save dtype must be auto, float16 or bfloat16, got {save_dtype!r}")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        model_dtype = embeddings.weight.dtype
    else:
        model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return model_dtype if model_dtype in SAVE_DTYPES.values() else torch.bfloat16


@dataclass(frozen=True)
class PendingTensor:
    """A tensor to write: ``source`` as the model holds it, cast to ``dtype`` (None: as it is) only
    when its shard is written, so saving never holds a second copy of the whole model."""

    source: torch.Tensor
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        itemsize = self.dtype.itemsize if self.dtype is not None else self.source.element_size()
        return self.source.numel() * itemsize

    def materialize(self, key: str) -> torch.Tensor:
        tensor = self.source.detach()
        if self.dtype is not None and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
            if not torch.isfinite(tensor).all():
                raise QuantkitError(f"{key} overflows {_dtype_name(self.dtype)}; save as bfloat16 instead")
        return tensor.to("cpu").contiguous()


def build_state_dict(
    model: nn.Module, weights: dict[str, QuantizedWeight], dtype: torch.dtype
) -> tuple[dict[str, PendingTensor], list[str]]:
    """The tensors to write, in model order: packed tensors for ``weights``, the rest cast to ``dtype``.

    Keys that alias an earlier key's storage (tied embeddings) are dropped; they are returned as the
    second element.
    """
    state: dict[str, PendingTensor] = {}
    seen: dict[tuple, str] = {}
    dropped: list[str] = []
    quantized_done: set[str] = set()
    for key, tensor in model.state_dict().items():
        module_name = key.rpartition(".")[0]
        if module_name in weights:
            if module_name not in quantized_done:
                state.update(_packed_tensors(module_name, weights[module_name], model, dtype))
                quantized_done.add(module_name)
            continue
        identity = _storage_identity(tensor)
        if identity is not None and identity in seen:
            dropped.append(key)
            continue
        if identity is not None:
            seen[identity] = key
        state[key] = PendingTensor(tensor, dtype if tensor.is_floating_point() else None)
    return state, dropped


def _packed_tensors(
    name: str, qw: QuantizedWeight, model: nn.Module, dtype: torch.dtype
) -> dict[str, PendingTensor]:
    out = {
        f"{name}.qweight": PendingTensor(qw.qweight, torch.int32),
        f"{name}.qzeros": PendingTensor(qw.qzeros, torch.int32),
        f"{name}.scales": PendingTensor(qw.scales, torch.float16),
        f"{name}.g_idx": PendingTensor(qw.g_idx, torch.int32),
    }
    bias = qw.bias if qw.bias is not None else getattr(model.get_submodule(name), "bias", None)
    if bias is not None:
        out[f"{name}.bias"] = PendingTensor(bias, dtype)
    return out


def _storage_identity(tensor: torch.Tensor) -> tuple | None:
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def _config_dict(model: nn.Module, quant_config: dict, dtype: torch.dtype, lm_head_quantized: bool) -> dict:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise QuantkitError(
            f"{type(model).__name__} has no transformers config; quantkit saves transformers models"
        )
    out = config.to_dict()
    out.pop("torch_dtype", None)
    out["dtype"] = _dtype_name(dtype)
    out["architectures"] = [type(model).__name__]
    out["quantization_config"] = quant_config
    if lm_head_quantized and out.get("tie_word_embeddings"):
        # A packed lm_head cannot share the embedding's tensor; readers must not re-tie them.
        out["tie_word_embeddings"] = False
    return out


def _file_metadata(scheme: QuantScheme, quant_config: dict) -> dict[str, str]:
    awq = quant_config["quant_method"] == "awq"
    return {
        "format": "pt",
        "quant_method": quant_config["quant_method"],
        "checkpoint_format": LAYOUT_AWQ_GEMM if awq else "gptq",
        "quantkit_layout": LAYOUT_AWQ_GEMM if awq else LAYOUT,
        "bits": str(scheme.bits),
        "group_size": str(scheme.group_size),
        "sym": str(scheme.sym).lower(),
        "quantkit_version": quant_config["quantkit"]["version"],
    }


# -- files ------------------------------------------------------------------------------------------


def plan_shards(state: dict[str, PendingTensor], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into files of at most ``max_shard_bytes`` each (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, pending in state.items():
        nbytes = pending.nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    return WEIGHTS_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shards(
    folder: Path, state: dict[str, PendingTensor], shards: list[list[str]], metadata: dict[str, str]
) -> list[str]:
    """Write each shard (and the index when there are several); returns the file names."""
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    for name, keys in zip(names, shards):
        _write_shard(folder / name, _own_storage({k: state[k].materialize(k) for k in keys}), metadata)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(p.nbytes for p in state.values())},
            "weight_map": {k: name for name, keys in zip(names, shards) for k in keys},
        }
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy tensors that share storage with another one or view part of a bigger one.

    safetensors refuses shared storage, and methods share tensors legitimately: GPTQ with act-order
    gives the linears that read one input (q/k/v, gate/up) the same ``g_idx`` tensor.
    """
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    # safetensors creates its files owner-only (0600); a checkpoint is meant to be read by servers
    # running as other users, like the json files next to it.
    path.chmod(0o644)


def _save_extras(folder: Path, model: nn.Module, tokenizer: Any) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(folder))


def _refuse_existing(output: Path, overwrite: bool) -> None:
    if overwrite or not (output.exists() or output.is_symlink()):
        return
    if output.is_dir() and not any(output.iterdir()):
        return  # an empty folder made ahead of time is fine
    raise QuantkitError(f"{output} already exists; pass --overwrite (overwrite=True) to replace it")


def _publish(tmp: Path, output: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` folder to ``output``; an existing output is swapped out, then deleted."""
    _refuse_existing(output, overwrite)  # again: something may have appeared while we wrote
    if not (output.exists() or output.is_symlink()):
        os.replace(tmp, output)
        return
    old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(output, old)
    try:
        os.replace(tmp, output)
    except BaseException:
        os.replace(old, output)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


def _require_json(value: Any, what: str) -> None:
    try:
        json.dumps(value, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise QuantkitError(f"{what} must be JSON-serializable to go into config.json: {exc}") from exc


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

