"""FP8 checkpoints in the compressed-tensors ``float-quantized`` layout: what vLLM and SGLang load as is.

Written (``save_fp8``) and read (``load_fp8``, ``read_fp8_settings``) here; the files go through the one
writer (:class:`quantkit.checkpoint_writer.CheckpointWriter`) and the one set of safetensors readers
(:mod:`quantkit.checkpoint_read`).

The layout (compressed-tensors' ``QuantizationConfig``, as vLLM's ``CompressedTensorsW8A8Fp8`` reads it):

* ``config.json`` ``quantization_config``: ``quant_method: "compressed-tensors"``, ``format: "float-quantized"``,
  ``quantization_status: "compressed"``, ``config_groups.group_0`` with ``targets: ["Linear"]``,
  ``weights`` {num_bits 8, type float, strategy channel | tensor | block, symmetric, dynamic false,
  block_structure [128, 128] for block} and ``input_activations`` {num_bits 8, type float, symmetric,
  strategy token + dynamic true (default); tensor + dynamic false (static); group 128 + dynamic (block)},
  ``ignore``: the full names of the linears left 16-bit (``lm_head``, routers), ``kv_cache_scheme: null``.
* Per quantized linear ``name``: ``name.weight`` float8_e4m3fn ``[out, in]``, ``name.weight_scale`` float32
  (``[out, 1]`` channel, ``[1]`` tensor, ``[ceil(out/128), ceil(in/128)]`` block), ``name.input_scale`` float32
  ``[1]`` for static activations, ``name.bias`` when the layer has one. Everything else 16-bit.

The ``compressed-tensors`` package is not used: writing the config is a dict, and the package needs pydantic,
which the GPU machine lacks; the tests validate the config with it where it is installed.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint_format import CONFIG_NAME
from quantkit.config import QuantkitError
from quantkit.methods.fp8 import FP8Config, FP8Weight

log = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
FLOAT_FORMATS = ("float-quantized", "naive-quantized")  # naive: same tensors, older writers
FP8_LEAVES = ("weight", "weight_scale", "input_scale")
# Tensors other tools add that quantkit does not use: KV-cache and output scales, zero points of a symmetric grid.
_FOREIGN_LEAVES = ("k_scale", "v_scale", "q_scale", "prob_scale", "output_scale", "weight_zero_point",
                   "input_zero_point", "output_zero_point")
CT_VERSION = "0.12.2"  # the compressed-tensors format version whose keys this writes


# -- writing ----------------------------------------------------------------------------------------


def _args(strategy: str, dynamic: bool, *, block: list[int] | None = None, group_size: int | None = None,
          observer: str | None = "minmax") -> dict[str, Any]:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": group_size, "block_structure": block, "actorder": None,
            "observer": observer, "observer_kwargs": {}}


def fp8_quantization_config(config: FP8Config, ignore: list[str], extra: dict | None = None) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ``config``; ``ignore``: full names of 16-bit linears."""
    block = list(config.block) if config.weights == "block" else None
    weights = _args(config.weights, False, block=block)
    if config.weights == "block":  # vLLM's block GEMM: activations per token and 128-column group, at run time
        inputs = _args("group", True, group_size=config.block[1], observer=None)
    elif config.activations == "static":
        inputs = _args("tensor", False)
    else:
        inputs = _args("token", True, observer=None)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None,
             "format": "float-quantized"}
    return {
        "quant_method": QUANT_METHOD, "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": sorted(ignore), "kv_cache_scheme": None,
        "global_compression_ratio": None, "version": CT_VERSION,
        "quantkit": {"method": "fp8", "weights": config.weights, "activations": config.activations,
                     **({"block": block} if block else {}), **(extra or {})},
    }


def unquantized_linears(model: nn.Module, weights: dict[str, Any]) -> list[str]:
    """Full names of the model's linears that stay 16-bit (lm_head, routers): the config's ``ignore``."""
    from quantkit.runtime.fp8_linear import FP8Linear

    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, FP8Linear) and name not in weights]


def file_metadata(config: FP8Config) -> dict[str, str]:
    from quantkit import __version__

    return {"format": "pt", "quant_method": QUANT_METHOD, "quantkit_layout": f"fp8_e4m3_{config.weights}",
            "quantkit_version": __version__}


def open_fp8_writer(model: nn.Module, output: str | os.PathLike, config: FP8Config, *, overwrite: bool = False,
                    max_shard_bytes: int = 4 * 2**30, save_dtype: str = "auto"):
    """A writer for ``model``'s FP8 checkpoint (decoder layers may be added as they are quantized)."""
    from quantkit.checkpoint import QuantizedCheckpointWriter, resolve_save_dtype

    return QuantizedCheckpointWriter(Path(output), dtype=resolve_save_dtype(model, save_dtype), layout="fp8",
                                     metadata=file_metadata(config), overwrite=overwrite,
                                     max_shard_bytes=max_shard_bytes)


def save_fp8(model: nn.Module, weights: dict[str, FP8Weight], output: str | os.PathLike, *, config: FP8Config,
             tokenizer: Any = None, extra: dict | None = None, overwrite: bool = False,
             max_shard_bytes: int = 4 * 2**30, writer=None) -> Path:
    """Write ``model`` with ``weights`` (full module name -> :class:`FP8Weight`) in the compressed-tensors layout.
    ``writer`` (from :func:`open_fp8_writer`) may already hold the decoder layers. Returns the folder."""
    from quantkit.checkpoint import _config_dict, build_state_dict

    if not weights:
        raise QuantkitError("nothing to save: no FP8 linear layers were given")
    modules = dict(model.named_modules())
    for name, w in weights.items():
        m = modules.get(name)
        if m is None or (getattr(m, "in_features", None), getattr(m, "out_features", None)) != (w.in_features,
                                                                                               w.out_features):
            raise QuantkitError(f"FP8 weight {name!r} [{w.out_features}, {w.in_features}] matches no linear "
                                "of the model")
    writer = writer or open_fp8_writer(model, output, config, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    with writer:
        state, _ = build_state_dict(model, weights, writer.dtype)
        quant_config = fp8_quantization_config(config, unquantized_linears(model, weights), extra)
        quant_config["quantkit"]["save_dtype"] = str(writer.dtype).removeprefix("torch.")
        writer.add({k: v for k, v in state.items() if k not in writer.written})
        files = writer.publish(_config_dict(model, quant_config, writer.dtype, lm_head_quantized=False), model=model,
                               tokenizer=tokenizer)
    log.info("wrote %d FP8 linears in %d file(s) to %s", len(weights), len(files), writer.output)
    return writer.output


# -- reading ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FP8Settings:
    """What a compressed-tensors FP8 checkpoint declares: weight strategy, block, static activations, ignore."""

    strategy: str
    block: tuple[int, int] | None
    static_input: bool
    ignore: tuple[str, ...]
    raw: dict


def _quant_config(path: Path) -> dict | None:
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return qc if isinstance(qc, dict) else None


def is_fp8_checkpoint(path: str | os.PathLike) -> bool:
    """True for a folder whose config.json declares compressed-tensors with float (FP8) weights."""
    qc = _quant_config(Path(path))
    if qc is None or qc.get("quant_method") != QUANT_METHOD:
        return False
    groups = qc.get("config_groups") or {}
    return any(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "float" for g in groups.values())


def read_fp8_settings(qc: dict, where: str) -> FP8Settings:
    """Validated settings of a compressed-tensors FP8 ``quantization_config``; anything else is refused, saying what."""
    fmt = qc.get("format")
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    if len(groups) != 1:
        raise QuantkitError(f"{where}: {len(groups)} config_groups; quantkit reads FP8 checkpoints with one scheme "
                            "for every quantized linear")
    group = groups[0]
    fmt = group.get("format") or fmt
    if fmt not in FLOAT_FORMATS:
        raise QuantkitError(f"{where}: compressed-tensors format {fmt!r}; quantkit reads float-quantized (FP8) only")
    w, a = group.get("weights") or {}, group.get("input_activations")
    declared = (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("dynamic", False))
    if declared != (8, "float", True, False):
        raise QuantkitError(f"{where}: weights {w}; quantkit reads static symmetric 8-bit float weights")
    strategy = w.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise QuantkitError(f"{where}: weight strategy {strategy!r}; quantkit reads channel, tensor or block")
    block = tuple(w.get("block_structure") or ()) if strategy == "block" else None
    if strategy == "block" and (block is None or len(block) != 2):
        raise QuantkitError(f"{where}: block weights without a two-number block_structure")
    if a is None:
        raise QuantkitError(f"{where}: FP8 weights with 16-bit activations (W8A16) are not read; quantkit serves W8A8")
    if (a.get("num_bits"), a.get("type")) != (8, "float"):
        raise QuantkitError(f"{where}: input activations {a}; quantkit reads 8-bit float activations")
    static = not a.get("dynamic", False)
    if static and a.get("strategy") != "tensor":
        raise QuantkitError(f"{where}: static activations by {a.get('strategy')!r}; quantkit reads per-tensor ones")
    if qc.get("kv_cache_scheme"):
        log.warning("%s: the KV-cache scheme (FP8 cache scales) is not used; quantkit keeps its cache 16-bit", where)
    return FP8Settings(strategy, block, static, tuple(qc.get("ignore") or ()), qc)


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
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            linear = None
        if not isinstance(linear, nn.Linear):
            raise QuantkitError(f"{name}.weight_scale: {type(model).__name__} has no linear layer {name}")
        if name in settings.ignore:
            raise QuantkitError(f"{name} is FP8 in the files but listed in the config's ignore")
        _check_fp8_tensors(name, linear, records, settings)
    return names


def load_fp8(path: str | os.PathLike, *, device: str | torch.device = "cpu",
             dtype: torch.dtype | str | None = None) -> tuple[nn.Module, Any]:
    """(model, tokenizer) from a compressed-tensors FP8 checkpoint (quantkit's or another tool's), its FP8 linears
    served by :class:`quantkit.runtime.fp8_linear.FP8Linear`; ``dtype`` as in ``checkpoint_read.load_quantized``."""
    from quantkit.checkpoint_read import (
        _assign, _check_materialized, _load_generation_config, _load_tokenizer, _resolve_dtype, build_empty_model,
        check_tensors, index_tensors, read_tensors,
    )
    from quantkit.checkpoint_settings import read_json_object
    from quantkit.runtime.fp8_linear import FP8Linear

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


def inspect_fp8(path: str | os.PathLike):
    """A :class:`quantkit.checkpoint_inspect.CheckpointInfo` for an FP8 checkpoint, from its config and headers:
    ``bits`` 8, ``group_size`` -1 (channel), 0 (tensor) or the block's column count, ``layout`` ``fp8_e4m3_<strategy>``
    (``_static`` when activations have calibrated scales)."""
    from quantkit.checkpoint_inspect import CheckpointInfo
    from quantkit.checkpoint_read import index_tensors, weight_files
    from quantkit.checkpoint_settings import read_json_object

    path = Path(path)
    config = read_json_object(path / CONFIG_NAME)
    settings = read_fp8_settings(config.get("quantization_config") or {}, str(path / CONFIG_NAME))
    records = index_tensors(path)
    names = [k[: -len(".weight_scale")] for k in records if k.endswith(".weight_scale")]
    if not names:
        raise QuantkitError(f"{path} declares FP8 weights but holds no weight_scale tensor")
    quantized = tuple((n, records[f"{n}.weight"].shape[1], records[f"{n}.weight"].shape[0], 1) for n in names)
    fp8_keys = {f"{n}.{leaf}" for n in names for leaf in FP8_LEAVES}
    equivalent = sum(2 * r.numel for r in records.values())  # every tensor at two bytes a value
    equivalent -= sum(2 * records[k].numel for k in fp8_keys if k in records and not k.endswith(".weight"))
    ours = settings.raw.get("quantkit") or {}
    group_size = {"channel": -1, "tensor": 0}.get(settings.strategy, (settings.block or (0, 0))[1])
    unquantized = [k[: -len(".weight")] for k, r in records.items()
                   if k.endswith(".weight") and len(r.shape) == 2 and r.dtype in (torch.float16, torch.bfloat16,
                                                                                  torch.float32)]
    files = weight_files(path)
    return CheckpointInfo(
        path=str(path), quant_method=QUANT_METHOD, method=ours.get("method"),
        producer=("llm-compressor",) if (path / "recipe.yaml").is_file() else (), bits=8, group_size=group_size,
        sym=True, desc_act=False, checkpoint_format=str(settings.raw.get("format")), quantized=quantized,
        partial_group_layers=(), unquantized_modules=tuple(unquantized),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), n_files=len(files),
        size_on_disk_bytes=sum(f.stat().st_size for f in files), equivalent_16bit_bytes=equivalent,
        calibration=ours.get("calibration"),
        layout=f"fp8_e4m3_{settings.strategy}" + ("_static" if settings.static_input else ""),
        settings_source="config.json")


def fp8_bits_per_weight(path: Path) -> float:
    """Stored bits per weight of the FP8 linears: codes and scales over the weights they encode (about 8.004
    per channel)."""
    from quantkit.checkpoint_read import index_tensors

    records = index_tensors(path)
    names = [k[: -len(".weight_scale")] for k in records if k.endswith(".weight_scale")]
    weights = sum(records[f"{n}.weight"].numel for n in names)
    stored = sum(records[f"{n}.{leaf}"].numel * records[f"{n}.{leaf}"].dtype.itemsize * 8
                 for n in names for leaf in FP8_LEAVES if f"{n}.{leaf}" in records)
    return stored / weights if weights else float("nan")
