"""The packed layouts quantkit reads and writes besides its own, and their conversion to it.

In memory every packed linear is GPTQ v1 (:class:`quantkit.qtensor.QuantizedWeight`,
:class:`quantkit.qlinear.QuantLinear`). On disk a checkpoint may hold

* ``gptq_v1``: quantkit's own layout (:mod:`quantkit.pack`, GPTQ section); read as it is.
* ``gptq_v2``: GPTQModel's v2, the same bit order with zero points stored without the minus one;
  the zero points are shifted on load.
* ``awq_gemm``: AutoAWQ's GEMM layout (:mod:`quantkit.pack`, AWQ section): codes packed along the
  outputs in AWQ's interleaved order, zero points as they are, contiguous groups and no ``g_idx``;
  unpacked and repacked as GPTQ v1 on load, written by ``save_quantized(..., layout="awq")``.

This module checks a packed linear's stored tensors against the settings (bit width and group size
must agree with the tensor shapes) and converts them; it reads no files itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from quantkit.checkpoint.format import LAYOUT_AWQ_GEMM, LAYOUT_GPTQ_V2, PACKED_DTYPES, QUANT_SUFFIXES
from quantkit.config import QuantkitError, QuantScheme
from quantkit.pack import pack_awq, pack_gptq, qzeros_v2_to_v1, unpack_awq
from quantkit.primitives import default_g_idx, num_groups
from quantkit.qtensor import QuantizedWeight

_WORD_BITS = 32


@dataclass(frozen=True)
class PackedGeometry:
    """A packed linear's sizes as its stored tensors give them."""

    name: str
    in_features: int
    out_features: int
    n_groups: int


def stored_leaves(layout: str) -> tuple[str, ...]:
    """The tensors (besides ``bias``) each packed linear has in ``layout``."""
    return ("qweight", "qzeros", "scales") if layout == LAYOUT_AWQ_GEMM else QUANT_SUFFIXES


def stored_shapes(layout: str, in_features: int, out_features: int, bits: int, n_groups: int) -> dict:
    """leaf -> shape of a packed ``[out, in]`` linear in ``layout``."""
    zeros_words = out_features * bits // _WORD_BITS
    if layout == LAYOUT_AWQ_GEMM:
        return {"qweight": (in_features, zeros_words), "qzeros": (n_groups, zeros_words),
                "scales": (n_groups, out_features)}
    return {"qweight": (in_features * bits // _WORD_BITS, out_features), "qzeros": (n_groups, zeros_words),
            "scales": (n_groups, out_features), "g_idx": (in_features,)}


def packed_geometry(name: str, records: dict[str, Any], settings: Any) -> PackedGeometry:
    """Sizes of packed linear ``name`` from its tensor records, after checking them against ``settings``.

    ``records`` maps keys to objects with ``shape``, ``dtype`` and ``file`` (checkpoint_read's
    ``TensorRecord``); ``settings`` is a ``GPTQSettings``. A bit width or group size that the tensors
    contradict is refused naming the settings file; a tensor that fits no setting as damaged.
    """
    layout = settings.layout
    if layout == LAYOUT_AWQ_GEMM and f"{name}.g_idx" in records:
        raise QuantkitError(
            f"{settings.source} says AutoAWQ GEMM, but {name}.g_idx is stored: that tensor belongs to the GPTQ "
            "layout. The settings contradict the tensors; fix quant_method/format in the settings file"
        )
    rec = {}
    for leaf in stored_leaves(layout):
        record = records.get(f"{name}.{leaf}")
        if record is None:
            raise QuantkitError(f"the checkpoint lacks tensor {name}.{leaf} (the packed linear {name} has a qweight)")
        if record.dtype != PACKED_DTYPES[leaf]:
            raise QuantkitError(f"{name}.{leaf} is {record.dtype} in {record.file.name}; the {layout} layout stores "
                                f"it as {PACKED_DTYPES[leaf]}")
        if len(record.shape) != (1 if leaf == "g_idx" else 2):
            raise QuantkitError(f"{name}.{leaf} in {record.file.name} has shape {list(record.shape)}; the checkpoint "
                                "is damaged")
        rec[leaf] = record
    n_groups, out_features = rec["scales"].shape
    if layout == LAYOUT_AWQ_GEMM:
        in_features, qweight_words, packed_len = rec["qweight"].shape[0], rec["qweight"].shape[1], out_features
    else:
        in_features = rec["g_idx"].shape[0]
        qweight_words, packed_len = rec["qweight"].shape[0], in_features
    _check_settings_fit(name, rec, settings, Fraction(qweight_words * _WORD_BITS, max(packed_len, 1)),
                        in_features, out_features, n_groups)
    expected = stored_shapes(layout, in_features, out_features, settings.bits, n_groups)
    for leaf, shape in expected.items():
        if tuple(rec[leaf].shape) != shape:
            raise QuantkitError(
                f"{name}.{leaf} in {rec[leaf].file.name} has shape {list(rec[leaf].shape)}; a {layout} linear of "
                f"{in_features} inputs and {out_features} outputs at {settings.bits} bits stores {list(shape)}. "
                "The checkpoint is damaged"
            )
    return PackedGeometry(name, in_features, out_features, n_groups)


def _check_settings_fit(name: str, rec: dict, settings: Any, qweight_bits: Fraction, in_features: int,
                        out_features: int, n_groups: int) -> None:
    """Refuse settings that the tensors, consistent among themselves, contradict."""
    zeros_bits = Fraction(rec["qzeros"].shape[1] * _WORD_BITS, max(out_features, 1))
    if qweight_bits == zeros_bits and qweight_bits != settings.bits:
        raise QuantkitError(
            f"{settings.source} says bits={settings.bits}, but the tensors of {name} hold {qweight_bits} bits per "
            f"weight ({name}.qweight is {list(rec['qweight'].shape)} for {in_features} inputs and {out_features} "
            "outputs). The settings contradict the tensors; fix bits in the settings file"
        )
    expected_groups = num_groups(in_features, settings.group_size)
    if qweight_bits == zeros_bits and rec["qzeros"].shape[0] == n_groups != expected_groups:
        raise QuantkitError(
            f"{settings.source} says group_size={settings.group_size}, but {name} stores {n_groups} groups for "
            f"{in_features} inputs (group_size {settings.group_size} gives {expected_groups}). The settings "
            "contradict the tensors; fix group_size in the settings file"
        )


def to_gptq_v1(name: str, stored: dict[str, torch.Tensor], settings: Any, geometry: PackedGeometry) -> dict:
    """The GPTQ v1 tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``) of one stored packed linear."""
    if settings.layout == LAYOUT_GPTQ_V2:
        try:
            qzeros = qzeros_v2_to_v1(stored["qzeros"], settings.bits, geometry.out_features)
        except ValueError as exc:
            raise _unholdable_zero(name, settings, exc) from exc
        return {**stored, "qzeros": qzeros}
    if settings.layout == LAYOUT_AWQ_GEMM:
        codes, zeros = unpack_awq(stored["qweight"], stored["qzeros"])  # [out, in], [G, out]
        try:
            qweight, qzeros = pack_gptq(codes, zeros, settings.bits)
        except ValueError as exc:
            raise _unholdable_zero(name, settings, exc) from exc
        g_idx = default_g_idx(geometry.in_features, settings.group_size)
        return {"qweight": qweight, "qzeros": qzeros, "scales": stored["scales"], "g_idx": g_idx}
    return dict(stored)


def _unholdable_zero(name: str, settings: Any, exc: ValueError) -> QuantkitError:
    return QuantkitError(
        f"{name}: {exc}. quantkit holds packed weights as GPTQ v1 (zero points 1..{2 ** settings.bits - 1}), so "
        f"this {settings.layout} checkpoint cannot be read exactly; quantize the 16-bit original with quantkit"
    )


# -- writing the AWQ GEMM layout ---------------------------------------------------------------


def check_awq_exportable(name: str, qw: QuantizedWeight) -> None:
    """Raise ``QuantkitError`` unless ``qw`` fits the AWQ GEMM layout."""
    problems = []
    if qw.bits != 4:
        problems.append(f"{qw.bits}-bit (the layout holds 4 bits only)")
    if qw.sym:
        problems.append("symmetric (AWQ readers expect asymmetric zero points: use --asym)")
    if qw.group_size == -1 or qw.in_features % qw.group_size:
        problems.append(f"group size {qw.group_size} does not divide in_features {qw.in_features}")
    elif qw.act_order:
        problems.append("act-order groups (the layout has no g_idx)")
    if qw.out_features % 8:
        problems.append(f"out_features {qw.out_features} is not a multiple of 8")
    if problems:
        raise QuantkitError(f"--format awq cannot hold {name}: " + "; ".join(problems)
                            + ". Write the GPTQ layout (the default format) instead.")


def export_awq_layout(weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Tensors of the AWQ GEMM layout by full name: ``<name>.qweight`` int32 ``[in, out/8]``,
    ``<name>.qzeros`` int32 ``[G, out/8]``, ``<name>.scales`` float16 ``[G, out]`` (and ``.bias``)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, qw in weights.items():
        check_awq_exportable(name, qw)
        codes, zeros = qw.unpack()  # [out, in], [G, out]
        qweight, qzeros = pack_awq(codes, zeros)
        tensors[f"{name}.qweight"] = qweight
        tensors[f"{name}.qzeros"] = qzeros
        tensors[f"{name}.scales"] = qw.scales.to(torch.float16).contiguous()
        if qw.bias is not None:
            tensors[f"{name}.bias"] = qw.bias.contiguous()
    return tensors


def awq_quantization_config(scheme: QuantScheme, modules_to_not_convert: list[str] | None = None) -> dict[str, Any]:
    """``quantization_config`` for config.json that transformers' ``AwqConfig`` and vLLM's AWQ reader
    accept (both spellings of bits and group size, as AutoAWQ writes them)."""
    if scheme.bits != 4 or scheme.sym or scheme.group_size == -1:
        raise QuantkitError("--format awq needs --bits 4, asymmetric quantization and a positive group size")
    return {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "w_bit": 4,
        "group_size": scheme.group_size,
        "q_group_size": scheme.group_size,
        "zero_point": True,
        "modules_to_not_convert": modules_to_not_convert,
    }
