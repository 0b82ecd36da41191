"""Writing an FP8 checkpoint in the compressed-tensors layout (:mod:`quantkit.checkpoint.fp8` holds the format)
through the one checkpoint writer (:mod:`quantkit.checkpoint.save`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from quantkit.checkpoint.fp8 import file_metadata, fp8_quantization_config, unquantized_linears
from quantkit.config import QuantkitError

if TYPE_CHECKING:  # annotations only: the method's records (kept out of the import graph)
    from quantkit.fp8_weight import FP8Config, FP8Weight

log = logging.getLogger(__name__)


def open_fp8_writer(model: nn.Module, output: str | os.PathLike, config: FP8Config, *, overwrite: bool = False,
                    max_shard_bytes: int = 4 * 2**30, save_dtype: str = "auto"):
    """A writer for ``model``'s FP8 checkpoint (decoder layers may be added as they are quantized)."""
    from quantkit.checkpoint.save import QuantizedCheckpointWriter, resolve_save_dtype

    return QuantizedCheckpointWriter(Path(output), dtype=resolve_save_dtype(model, save_dtype), layout="fp8",
                                     metadata=file_metadata(config), overwrite=overwrite,
                                     max_shard_bytes=max_shard_bytes)


def save_fp8(model: nn.Module, weights: dict[str, FP8Weight], output: str | os.PathLike, *, config: FP8Config,
             tokenizer: Any = None, extra: dict | None = None, overwrite: bool = False,
             max_shard_bytes: int = 4 * 2**30, writer=None) -> Path:
    """Write ``model`` with ``weights`` (full module name -> :class:`FP8Weight`) in the compressed-tensors layout.
    ``writer`` (from :func:`open_fp8_writer`) may already hold the decoder layers. Returns the folder."""
    from quantkit.checkpoint.save import _config_dict, build_state_dict

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
