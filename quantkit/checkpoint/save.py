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

Files are written by :class:`quantkit.checkpoint.writer.CheckpointWriter` into a hidden temporary
sibling folder and renamed into place only when complete, so an interrupted write never leaves a
folder that looks like a checkpoint. A model streamed from disk adds each decoder layer as it is
quantized (:func:`open_writer`, :func:`add_layer`) and ends with :func:`save_quantized`.

Reading lives in :mod:`quantkit.checkpoint.read` and :mod:`quantkit.checkpoint.inspect`;
``load_quantized`` and ``inspect_checkpoint`` are re-exported here so callers import one module.
File names and layout tags shared by both sides are in :mod:`quantkit.checkpoint.format`; the AWQ
GEMM layout in :mod:`quantkit.checkpoint.layouts`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint.format import (
    CONFIG_NAME,
    INDEX_NAME,
    LAYOUT,
    LAYOUT_AWQ_GEMM,
    QUANT_SUFFIXES,
    WEIGHTS_NAME,
)
from quantkit.checkpoint.inspect import CheckpointInfo, inspect_checkpoint
from quantkit.checkpoint.layouts import awq_quantization_config, export_awq_layout
from quantkit.checkpoint.quant_config import build_quantization_config
from quantkit.checkpoint.read import load_quantized
from quantkit.checkpoint.writer import CheckpointWriter, PendingTensor, json_default, shard_name
from quantkit.config import QuantkitError, QuantScheme
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)

__all__ = [
    "CONFIG_NAME", "INDEX_NAME", "QUANT_SUFFIXES", "WEIGHTS_NAME", "CheckpointInfo", "CheckpointWriter",
    "PendingTensor", "add_layer", "build_state_dict", "inspect_checkpoint", "load_quantized", "open_writer",
    "resolve_save_dtype", "save_quantized", "shard_name",
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
    writer: CheckpointWriter | None = None,
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

    ``writer`` (from :func:`open_writer`) is one that already holds some of the tensors (decoder layers
    written as they were quantized, :func:`add_layer`): the rest are added and it is published.
    """
    if writer is None:
        writer = open_writer(model, output_dir, scheme=scheme, layout=layout, overwrite=overwrite,
                             max_shard_bytes=max_shard_bytes, save_dtype=save_dtype)
    with writer:
        extra = dict(extra or {})
        _require_json(extra, "extra")
        weights = _collect_weights(model, weights)
        state_dict, dropped_aliases = build_state_dict(model, weights, writer.dtype, writer.keep_fp32)
        quant_config = build_quantization_config(model, weights, scheme=scheme, method=method, extra=extra)
        quant_config["quantkit"]["save_dtype"] = _dtype_name(writer.dtype)
        lm_head_quantized = quant_config["lm_head"]
        if writer.layout == "awq":
            state_dict = _to_awq_layout(state_dict, weights)
            quant_config = _awq_config(scheme, quant_config)
        config = _config_dict(model, quant_config, writer.dtype, lm_head_quantized=lm_head_quantized)
        writer.add({k: v for k, v in state_dict.items() if k not in writer.written})
        files = writer.publish(config, model=model, tokenizer=tokenizer)
    log.info(
        "wrote %d quantized linears in %d file(s) to %s (tied aliases dropped: %s)",
        len(weights),
        len(files),
        writer.output,
        ", ".join(dropped_aliases) or "none",
    )
    return writer.output


class QuantizedCheckpointWriter(CheckpointWriter):
    """A :class:`CheckpointWriter` that also knows the dtype of unpacked tensors and the packed layout."""

    def __init__(self, output: str | os.PathLike, *, dtype: torch.dtype, layout: str,
                 keep_fp32: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(output, **kwargs)
        self.dtype = dtype
        self.layout = layout
        self.keep_fp32 = keep_fp32  # names transformers keeps in float32 (see :func:`build_state_dict`)


def open_writer(model: nn.Module, output_dir: str | os.PathLike, *, scheme: QuantScheme, layout: str = "gptq",
                overwrite: bool = False, max_shard_bytes: int = 4 * 2**30,
                save_dtype: str = "auto") -> QuantizedCheckpointWriter:
    """A writer for ``model``'s checkpoint (options as :func:`save_quantized`), its temporary folder made."""
    if layout not in ("gptq", "awq"):
        raise QuantkitError(f"--format must be gptq or awq, got {layout!r}")
    dtype = resolve_save_dtype(model, save_dtype)
    keep_fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) + tuple(
        getattr(model, "_keep_in_fp32_modules", None) or ())
    return QuantizedCheckpointWriter(Path(output_dir), dtype=dtype, layout=layout, keep_fp32=keep_fp32,
                                     metadata=_file_metadata(scheme, layout), overwrite=overwrite,
                                     max_shard_bytes=max_shard_bytes)


def add_layer(writer: QuantizedCheckpointWriter, layer: nn.Module, prefix: str,
              weights: dict[str, QuantizedWeight]) -> None:
    """Add one finished decoder layer: ``weights`` (names relative to ``layer``) packed, its other tensors
    in the writer's dtype, every key under ``prefix`` (``model.layers.3``)."""
    state, _ = build_state_dict(layer, weights, writer.dtype, writer.keep_fp32)
    if writer.layout == "awq":
        state = _to_awq_layout(state, weights)
    writer.add({f"{prefix}.{key}": pending for key, pending in state.items()})


# -- what goes into the files -------------------------------------------------------------------


def _to_awq_layout(state: dict[str, PendingTensor], weights: dict[str, QuantizedWeight]) -> dict[str, PendingTensor]:
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
    return out


def _awq_config(scheme: QuantScheme, gptq_config: dict) -> dict:
    unquantized = [n.rpartition(".")[2] for n in gptq_config.get("quantkit", {}).get("unquantized_linears", [])]
    config = awq_quantization_config(scheme, sorted(set(unquantized)) or None)
    config["quantkit"] = {**gptq_config.get("quantkit", {}), "layout": LAYOUT_AWQ_GEMM}
    return config


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


def build_state_dict(
    model: nn.Module, weights: dict[str, QuantizedWeight], dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()
) -> tuple[dict[str, PendingTensor], list[str]]:
    """The tensors to write, in model order: packed tensors for ``weights``, the rest cast to ``dtype``.

    Tensors named by ``keep_fp32`` (transformers' ``_keep_in_fp32_modules(_strict)`` of the model: DeepSeek's
    router ``gate.weight`` and ``e_score_correction_bias``, whose bfloat16 rounding can flip the choice between
    two close experts) are written in float32, as transformers holds them.

    Keys that alias an earlier key's storage (tied embeddings) are dropped; they are returned as the
    second element.
    """
    state: dict[str, PendingTensor] = {}
    seen: dict[tuple, str] = {}
    dropped: list[str] = []
    quantized_done: set[str] = set()
    # keep_vars: the parameters themselves, so tied ones still on the meta device (a streamed model's
    # embeddings, copied from its files) are one object under both keys
    for key, tensor in model.state_dict(keep_vars=True).items():
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
        if not tensor.is_floating_point():
            state[key] = PendingTensor(tensor, None)
        else:  # float32 for keep_fp32 even from a bfloat16 file (exact): streamed or not, the same bytes
            fp32 = any(f".{name}." in f".{key}." for name in keep_fp32)
            state[key] = PendingTensor(tensor, torch.float32 if fp32 else dtype)
    return state, dropped


def _packed_tensors(
    name: str, qw: QuantizedWeight, model: nn.Module, dtype: torch.dtype
) -> dict[str, PendingTensor]:
    if not isinstance(qw, QuantizedWeight):  # a record naming its own tensors (quantkit.methods.fp8.FP8Weight)
        out = {f"{name}.{leaf}": PendingTensor(t, dtype if leaf == "bias" else None)
               for leaf, t in qw.tensors().items()}
        bias = getattr(model.get_submodule(name), "bias", None)
        if bias is not None and f"{name}.bias" not in out:
            out[f"{name}.bias"] = PendingTensor(bias, dtype)
        return out
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
    if tensor.device.type == "meta":
        return ("meta", id(tensor))
    if tensor.numel() == 0:
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


def _file_metadata(scheme: QuantScheme, layout: str) -> dict[str, str]:
    from quantkit.version import __version__

    awq = layout == "awq"
    return {
        "format": "pt",
        "quant_method": "awq" if awq else "gptq",
        "checkpoint_format": LAYOUT_AWQ_GEMM if awq else "gptq",
        "quantkit_layout": LAYOUT_AWQ_GEMM if awq else LAYOUT,
        "bits": str(scheme.bits),
        "group_size": str(scheme.group_size),
        "sym": str(scheme.sym).lower(),
        "quantkit_version": __version__,
    }


def _require_json(value: Any, what: str) -> None:
    try:
        json.dumps(value, default=json_default)
    except (TypeError, ValueError) as exc:
        raise QuantkitError(f"{what} must be JSON-serializable to go into config.json: {exc}") from exc


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

