"""What a quantization run reached: every weight is quantized, kept 16-bit by design, or named as missed.

No model is partly quantized in silence: a 2-D-or-more float weight that no method quantized and that
is not 16-bit by design (embeddings, the output head, routers and shared-expert gates of an MoE record)
is "unreached" (fused 3-D expert tensors of a family quantkit has no record for, linears outside the
decoder layers); the walk names them in a warning and the report lists them. The compression ratio is
over all of the model's weights: 16-bit bytes / bytes as written (packed + everything else in 16 bits).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from quantkit.arch import arch_for, find_decoder_layers
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)
_SHOW = 6


@dataclass(frozen=True)
class Coverage:
    n_quantized: int
    kept_16bit: tuple[str, ...]  # by design: embeddings, output head, routers, shared-expert gates
    unreached: tuple[str, ...]  # weights no method quantized and no record keeps 16-bit
    bytes_16bit: int
    bytes_written: int

    @property
    def compression_ratio(self) -> float:
        return self.bytes_16bit / self.bytes_written if self.bytes_written else 0.0


def packed_bytes(qw: QuantizedWeight) -> int:
    """Bytes of a packed linear as written (qweight, qzeros, g_idx int32; scales float16; bias 16-bit)."""
    n = 0
    for field in ("qweight", "qzeros", "g_idx"):
        t = getattr(qw, field)
        n += 4 * t.numel() if t is not None else 0
    n += 2 * qw.scales.numel() + (2 * qw.bias.numel() if qw.bias is not None else 0)
    return n


def written_bytes(record) -> int:
    """Bytes of one quantized linear as written: a packed INT4 weight, or an FP8 record (codes and scales)."""
    if isinstance(record, QuantizedWeight):
        return packed_bytes(record)
    bias = record.bias
    return record.nbytes() + (2 * bias.numel() if bias is not None else 0)


def weight_coverage(model: nn.Module, weights: dict) -> Coverage:
    """Sort every parameter of ``model`` by what became of it (``weights``: full module name -> the packed
    :class:`QuantizedWeight` or :class:`quantkit.fp8_weight.FP8Weight`)."""
    spec = arch_for(getattr(model.config, "model_type", ""))
    keep_rel = set(spec.keep_16bit) if spec is not None else set()
    try:
        prefix, _ = find_decoder_layers(model)
    except Exception:  # noqa: BLE001 - a model without decoder layers: nothing is kept by a record
        prefix = None
    by_design = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None:
            by_design.add(id(module))
    modules = dict(model.named_modules())
    kept, unreached = [], []
    b16 = written = 0
    for name, p in model.named_parameters():
        module_name, _, _ = name.rpartition(".")
        b16 += 2 * p.numel()
        if module_name in weights:
            continue
        written += 2 * p.numel()
        if not p.is_floating_point() or p.dim() < 2:
            continue
        if id(modules.get(module_name)) in by_design or _relative(module_name, prefix) in keep_rel:
            kept.append(name)
        else:
            unreached.append(name)
    written += sum(written_bytes(w) for w in weights.values())
    return Coverage(len(weights), tuple(kept), tuple(unreached), b16, written)


def _relative(module_name: str, prefix: str | None) -> str:
    """``model.layers.3.mlp.gate`` -> ``mlp.gate`` (inside the decoder layers), else the name itself."""
    if prefix and module_name.startswith(prefix + "."):
        return module_name[len(prefix) + 1 :].partition(".")[2]
    return module_name


def warn_unreached(cov: Coverage) -> None:
    if not cov.unreached:
        return
    shown = ", ".join(cov.unreached[:_SHOW]) + (f" and {len(cov.unreached) - _SHOW} more" if len(cov.unreached)
                                                 > _SHOW else "")
    log.warning("%d weights were NOT quantized and stay 16-bit: %s. quantkit reaches only nn.Linear layers inside "
                "the decoder layers (and experts of the MoE families it has records for); the checkpoint is only "
                "partly quantized: %.2fx smaller over all weights.", len(cov.unreached), shown,
                cov.compression_ratio)
