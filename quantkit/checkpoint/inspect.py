"""``inspect_checkpoint``: what a quantized checkpoint holds, from its config and file headers only."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantkit.checkpoint.layouts import packed_geometry, stored_leaves
from quantkit.checkpoint.read import index_tensors, packed_modules, read_config, weight_files
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
    moe: dict | None = None  # MoE checkpoints: experts and vLLM MoE serving by tensor-parallel size

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
    from quantkit.checkpoint.fp8 import is_fp8_checkpoint

    if is_fp8_checkpoint(path):  # compressed-tensors FP8: described by its own layout module
        return _inspect_fp8(path)
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
    # 2-D float weights (embeddings, lm_head, routers) and any fused 3-D tensor (experts left 16-bit)
    unquantized = [
        key.removesuffix(".weight")
        for key, r in records.items()
        if key not in packed_keys and r.dtype.is_floating_point
        and ((key.endswith(".weight") and len(r.shape) == 2) or len(r.shape) >= 3)
    ]
    from quantkit.moe.serving import moe_summary
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
        moe=moe_summary(config, settings.group_size, names),
    )


def _inspect_fp8(path: Path) -> CheckpointInfo:
    """A :class:`CheckpointInfo` for an FP8 checkpoint (compressed-tensors, :mod:`quantkit.checkpoint.fp8`), from its
    config and headers:
    ``bits`` 8, ``group_size`` -1 (channel), 0 (tensor) or the block's column count, ``layout`` ``fp8_e4m3_<strategy>``
    (``_static`` when activations have calibrated scales)."""
    import torch

    from quantkit.checkpoint.format import CONFIG_NAME
    from quantkit.checkpoint.fp8 import FP8_LEAVES, QUANT_METHOD, read_fp8_settings
    from quantkit.checkpoint.read import index_tensors, weight_files
    from quantkit.checkpoint.settings import read_json_object

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
