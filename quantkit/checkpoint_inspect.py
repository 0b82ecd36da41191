"""``inspect_checkpoint``: what a quantized checkpoint holds, from its config and file headers only."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantkit.checkpoint_layouts import packed_geometry, stored_leaves
from quantkit.checkpoint_read import index_tensors, packed_modules, read_config, weight_files
from quantkit.config import QuantkitError


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds, from its config and file headers (no tensor data read)."""

    path: str
    quant_method: str
    method: str | None  # the quantkit method that produced it (None for other producers)
    producer: tuple[str, ...]
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str
    quantized: tuple[tuple[str, int, int, int], ...]  # (name, in_features, out_features, n_groups)
    partial_group_layers: tuple[str, ...]  # in_features % group_size != 0
    unquantized_modules: tuple[str, ...]  # modules with a 2-D float weight (embeddings, lm_head, ...)
    tied_embeddings: bool
    n_files: int
    size_on_disk_bytes: int
    equivalent_16bit_bytes: int
    calibration: dict | None
    layout: str = "gptq_v1"  # as stored: gptq_v1, gptq_v2 or awq_gemm (all read as GPTQ v1)
    settings_source: str = "config.json"  # the file(s) the quantization settings were read from

    @property
    def n_quantized(self) -> int:
        return len(self.quantized)

    @property
    def compression_ratio(self) -> float:
        return self.equivalent_16bit_bytes / self.size_on_disk_bytes if self.size_on_disk_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["quantized"] = [
            {"name": n, "in_features": i, "out_features": o, "n_groups": g} for n, i, o, g in self.quantized
        ]
        # Byte counts under the names the CLI prints.
        out["size_on_disk"] = out.pop("size_on_disk_bytes")
        out["size_16bit"] = out.pop("equivalent_16bit_bytes")
        for key in ("producer", "partial_group_layers", "unquantized_modules"):
            out[key] = list(out[key])
        out["n_quantized"] = self.n_quantized
        out["compression_ratio"] = round(self.compression_ratio, 4)
        return out


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` after validating its settings and files.

    The settings are checked against the tensor shapes (bit width, group size, layout), so what this
    reports is what the loader will load.
    """
    path = Path(path)
    from quantkit.checkpoint_fp8 import inspect_fp8, is_fp8_checkpoint

    if is_fp8_checkpoint(path):  # compressed-tensors FP8: described by its own layout module
        return inspect_fp8(path)
    config, settings = read_config(path)
    records = index_tensors(path)
    quantized, partial = [], []
    equivalent = 0
    names = packed_modules(records)
    if not names:
        raise QuantkitError(f"{path} declares a quantized layout but holds no packed linear (no .qweight)")
    for name in names:
        geometry = packed_geometry(name, records, settings)
        in_features, out_features = geometry.in_features, geometry.out_features
        quantized.append((name, in_features, out_features, geometry.n_groups))
        if settings.group_size > 0 and in_features % settings.group_size:
            partial.append(name)
        bias = records.get(f"{name}.bias")
        equivalent += 2 * in_features * out_features + (2 * bias.numel if bias is not None else 0)
    packed_keys = {f"{row[0]}.{leaf}" for row in quantized for leaf in (*stored_leaves(settings.layout), "bias")}
    # A 16-bit checkpoint stores every other tensor at two bytes per element (tied ones once, as here).
    equivalent += sum(2 * r.numel for key, r in records.items() if key not in packed_keys)
    unquantized = [
        key[: -len(".weight")]
        for key, r in records.items()
        if key.endswith(".weight") and len(r.shape) == 2 and r.dtype.is_floating_point
    ]
    ours = settings.raw.get("quantkit") or {}
    return CheckpointInfo(
        path=str(path),
        quant_method=settings.quant_method,
        method=ours.get("method"),
        producer=tuple((settings.raw.get("meta") or {}).get("quantizer") or ()),
        bits=settings.bits,
        group_size=settings.group_size,
        sym=settings.sym,
        desc_act=settings.desc_act,
        checkpoint_format=settings.checkpoint_format,
        quantized=tuple(quantized),
        partial_group_layers=tuple(partial),
        unquantized_modules=tuple(unquantized),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        n_files=len(weight_files(path)),
        size_on_disk_bytes=sum(f.stat().st_size for f in weight_files(path)),
        equivalent_16bit_bytes=equivalent,
        calibration=ours.get("calibration"),
        layout=settings.layout,
        settings_source=settings.source,
    )
