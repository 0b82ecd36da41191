"""FP8 checkpoints in the compressed-tensors ``float-quantized`` layout: what vLLM and SGLang load as is.

Written (``save_fp8``) and read (``load_fp8``, ``read_fp8_settings``) here; the files go through the one
writer (:class:`quantkit.checkpoint.writer.CheckpointWriter`) and the one set of safetensors readers
(:mod:`quantkit.checkpoint.read`).

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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from quantkit.checkpoint.format import CONFIG_NAME
from quantkit.config import QuantkitError

if TYPE_CHECKING:  # annotations only: the method's records (kept out of the import graph)
    from quantkit.fp8_weight import FP8Config

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
    from quantkit.fp8_linear import FP8Linear

    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, FP8Linear) and name not in weights]


def file_metadata(config: FP8Config) -> dict[str, str]:
    from quantkit.version import __version__

    return {"format": "pt", "quant_method": QUANT_METHOD, "quantkit_layout": f"fp8_e4m3_{config.weights}",
            "quantkit_version": __version__}


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


def fp8_bits_per_weight(records: dict) -> float:
    """Stored bits per weight of the FP8 linears of a checkpoint's tensor ``records`` (``read.index_tensors``):
    codes and scales over the weights they encode (about 8.004 per channel)."""
    names = [k[: -len(".weight_scale")] for k in records if k.endswith(".weight_scale")]
    weights = sum(records[f"{n}.weight"].numel for n in names)
    stored = sum(records[f"{n}.{leaf}"].numel * records[f"{n}.{leaf}"].dtype.itemsize * 8
                 for n in names for leaf in FP8_LEAVES if f"{n}.{leaf}" in records)
    return stored / weights if weights else float("nan")
