"""Quantization settings read the way the producing tools write them, and the layout they name.

Sources, in the order GPTQModel reads them: ``quantize_config.json`` and ``quant_config.json``
(AutoGPTQ, GPTQModel), then ``config.json``'s ``quantization_config`` (transformers, vLLM, quantkit,
AutoAWQ). The tools spell the same setting differently:

* method: ``quant_method`` (transformers) or ``method`` (GPTQModel); AutoGPTQ's
  ``quantize_config.json`` may name none (it only wrote GPTQ).
* layout: ``checkpoint_format`` (transformers, AutoGPTQ), ``format`` (GPTQModel), ``version``
  (AutoAWQ: ``gemm``, ``gemv``, ...), ``is_marlin_format: true`` (old AutoGPTQ Marlin folders).
* ``bits`` or ``w_bit``, ``group_size`` or ``q_group_size``; AWQ's ``zero_point`` is GPTQ's ``not sym``.

When two spellings or two files disagree, GPTQModel keeps one (``format`` over
``checkpoint_format``, the file read first); quantkit refuses and names both, because whichever it
picked, one of the two producers' readers would see another model than it does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.checkpoint.format import (
    CONFIG_NAME,
    LAYOUT,
    LAYOUT_AWQ_GEMM,
    LAYOUT_GPTQ_V2,
    QUANTIZE_CONFIG_NAMES,
)
from quantkit.config import QuantkitError
from quantkit.pack import SUPPORTED_BITS

# canonical setting -> the keys producers write it under
_SPELLINGS = {
    "method": ("quant_method", "method"),
    "format": ("checkpoint_format", "format"),
    "bits": ("bits", "w_bit"),
    "group_size": ("group_size", "q_group_size"),
}
_REQUANTIZE = "quantize the 16-bit original with `quantkit gptq` (or `quantkit awq`) instead"
# (method, format) -> (what the folder is, what would make it readable); format None: any
_FOREIGN: dict[tuple[str, str | None], tuple[str, str]] = {
    ("gptq", "marlin"): ("GPTQ weights repacked for the Marlin kernel",
                         "use the GPTQ folder it was repacked from, or load it with GPTQModel and save it "
                         "with format='gptq'"),
    ("gptq", "bitblas"): ("GPTQ weights repacked for the BitBLAS kernel",
                          "use the GPTQ folder it was repacked from, or load it with GPTQModel and save it "
                          "with format='gptq'"),
    ("gptq", "gptq_p"): ("GPTQModel's planar GPTQ layout (format 'gptq_p')",
                         "load it with GPTQModel and save it with format='gptq'"),
    ("gptq", "qqq"): ("a QQQ (W4A8) checkpoint", _REQUANTIZE),
    ("awq", "gemv"): ("an AutoAWQ GEMV-layout checkpoint",
                      "quantkit reads AutoAWQ's GEMM layout: quantize with AutoAWQ version='GEMM', or "
                      + _REQUANTIZE),
    ("awq", "gemv_fast"): ("an AutoAWQ GEMV-fast-layout checkpoint",
                           "quantkit reads AutoAWQ's GEMM layout: quantize with AutoAWQ version='GEMM', or "
                           + _REQUANTIZE),
    ("awq", "marlin"): ("AWQ weights repacked for the Marlin kernel",
                        "use the AWQ GEMM folder it was repacked from"),
    ("awq", "llm-awq"): ("an llm-awq checkpoint (int16 packing)", _REQUANTIZE),
    ("compressed-tensors", None): ("an llm-compressor checkpoint (compressed-tensors)",
                                   "vLLM serves it as it is; for quantkit, " + _REQUANTIZE),
    ("bitsandbytes", None): ("a bitsandbytes checkpoint (nf4/fp4/int8, quantized by bitsandbytes)",
                             _REQUANTIZE),
    ("exl2", None): ("an ExLlamaV2 (EXL2) checkpoint, with bits that vary by layer",
                     "ExLlamaV2/TabbyAPI serve it; for quantkit, " + _REQUANTIZE),
    ("exl3", None): ("an ExLlamaV3 (EXL3) checkpoint", "ExLlamaV3 serves it; for quantkit, " + _REQUANTIZE),
}


@dataclass(frozen=True)
class GPTQSettings:
    """What the quantization settings say about the packed linears, and which layout holds them.

    ``layout`` is ``gptq_v1``, ``gptq_v2`` or ``awq_gemm`` (:mod:`quantkit.checkpoint.format`);
    ``source`` names the file(s) the settings came from, for messages.
    """

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str
    raw: dict = field(repr=False, compare=False)
    layout: str = LAYOUT
    quant_method: str = "gptq"
    source: str = CONFIG_NAME


def read_config(path: Path) -> tuple[dict, GPTQSettings]:
    """``config.json`` of the checkpoint at ``path`` and its validated quantization settings."""
    if not path.is_dir():
        raise QuantkitError(f"{path} is not a folder; pass the folder a quantized checkpoint was written to")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise QuantkitError(f"{path} has no {CONFIG_NAME}; it is not a complete checkpoint (re-create it)")
    config = read_json_object(config_file)
    sources = [(name, read_json_object(path / name)) for name in QUANTIZE_CONFIG_NAMES if (path / name).is_file()]
    quantization_config = config.get("quantization_config")
    if quantization_config is None and not sources:
        validate_quant_config(None, config_file)  # raises: an unquantized model
    if quantization_config is not None:
        if not isinstance(quantization_config, dict):
            raise QuantkitError(f"quantization_config in {config_file} is not an object; the checkpoint is damaged")
        sources.append((f"{CONFIG_NAME} quantization_config", quantization_config))
    return config, settings_from_sources(sources, folder=path)


def read_json_object(file: Path) -> dict:
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{file} is not valid JSON ({exc}); the checkpoint is damaged") from exc
    if not isinstance(value, dict):
        raise QuantkitError(f"{file} does not hold a JSON object; the checkpoint is damaged")
    return value


def validate_quant_config(qc: Any, where: Path | str, layouts: tuple[str, ...] = (LAYOUT,)) -> GPTQSettings:
    """Settings from one ``quantization_config`` object; says what the checkpoint is when unreadable.

    ``layouts`` are the stored layouts the caller converts: by default only GPTQ v1, for callers that
    read the packed tensors as they are stored; :func:`quantkit.checkpoint.read.open_checkpoint` hands
    out every readable layout already converted to v1.
    """
    if qc is None:
        raise QuantkitError(
            f"{where} has no quantization_config (and the folder has no {' or '.join(QUANTIZE_CONFIG_NAMES)}): "
            "this is an unquantized model; load it as a plain model (or quantize it with `quantkit rtn`)"
        )
    if not isinstance(qc, dict):
        raise QuantkitError(f"quantization_config in {where} is not an object; the checkpoint is damaged")
    settings = settings_from_sources([(str(where), qc)])
    if settings.layout not in layouts:
        raise QuantkitError(
            f"{where} stores the {settings.layout} layout; this reader takes {', '.join(layouts)} tensors as they "
            "are stored. Read the folder through quantkit.checkpoint.read.open_checkpoint (or load_quantized), "
            "which converts it"
        )
    return settings


def settings_from_sources(sources: list[tuple[str, dict]], folder: Path | None = None) -> GPTQSettings:
    """One set of settings from every source (``(name, object)`` pairs, first read first)."""
    canon: dict[str, Any] = {}
    said: dict[str, str] = {}  # canonical key -> "file: key=value", for messages
    for where, qc in sources:
        for key, (spelled, value) in canonical_settings(qc, where).items():
            if key in canon and canon[key] != value:
                raise QuantkitError(
                    f"the quantization settings contradict each other: {said[key]}, but {where} says "
                    f"{spelled}. Remove the stale file or fix the wrong value (the tool that made the "
                    "checkpoint knows which is right)"
                )
            if key not in canon:
                canon[key], said[key] = value, f"{where} says {spelled}"
    raw: dict = {}
    for _, qc in reversed(sources):  # the first-read source wins on keys that are not settings
        raw.update(qc)
    where = " + ".join(name for name, _ in sources)
    if folder is not None:
        where = f"{folder} ({where})"
    in_quantize_config = any(name in QUANTIZE_CONFIG_NAMES for name, _ in sources)
    method = canon.get("method", "gptq" if in_quantize_config else "")
    return _settings(canon, method, raw, where)


def canonical_settings(qc: dict, where: str) -> dict[str, tuple[str, Any]]:
    """Canonical setting -> (``key=value`` as the source spells it, canonical value) of one source;
    two spellings of one setting in it must agree."""
    out: dict[str, tuple[str, Any]] = {}
    spellings = dict(_SPELLINGS)
    if str(qc.get("quant_method", qc.get("method", ""))).lower() == "awq":
        spellings["format"] = (*spellings["format"], "version")
    for canon, keys in spellings.items():
        present = [(k, _normalized(qc[k])) for k in keys if qc.get(k) is not None]
        for key, value in present[1:]:
            if value != present[0][1]:
                raise QuantkitError(
                    f"{where} contradicts itself: {present[0][0]}={present[0][1]!r} but {key}={value!r}; "
                    "fix the wrong key (both name the same setting)"
                )
        if present:
            out[canon] = (f"{present[0][0]}={present[0][1]!r}", present[0][1])
    if qc.get("is_marlin_format"):
        if "format" in out and out["format"][1] != "marlin":
            raise QuantkitError(f"{where} contradicts itself: is_marlin_format=true but {out['format'][0]}")
        out["format"] = ("is_marlin_format=True", "marlin")
    sym = [(f"sym={qc['sym']!r}", bool(qc["sym"]))] if qc.get("sym") is not None else []
    if qc.get("zero_point") is not None:
        sym.append((f"zero_point={qc['zero_point']!r}", not bool(qc["zero_point"])))
    if len(sym) == 2 and sym[0][1] != sym[1][1]:
        raise QuantkitError(f"{where} contradicts itself: {sym[0][0]} but {sym[1][0]}")
    if sym:
        out["sym"] = sym[0]
    if qc.get("desc_act") is not None:
        out["desc_act"] = (f"desc_act={qc['desc_act']!r}", bool(qc["desc_act"]))
    return out


def _normalized(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _settings(canon: dict, method: str, raw: dict, where: str) -> GPTQSettings:
    fmt = canon.get("format", "gemm" if method == "awq" else "gptq")
    layout = _layout(method, fmt, raw, where)
    bits, group_size = canon.get("bits"), canon.get("group_size", -1)
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise QuantkitError(f"{where}: bits={bits!r} is not supported; the GPTQ layout holds {SUPPORTED_BITS}")
    if not isinstance(group_size, int) or (group_size != -1 and group_size <= 0):
        raise QuantkitError(f"{where}: group_size={group_size!r} must be -1 or a positive integer")
    pack_dtype = str(raw.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise QuantkitError(
            f"{where}: pack_dtype={pack_dtype!r}; quantkit reads codes packed in int32 words (GPTQModel's "
            "default): save the checkpoint again with GPTQModel's pack_dtype=torch.int32"
        )
    for pattern, override in (raw.get("dynamic") or {}).items():
        if not str(pattern).startswith("-:") and override:
            raise QuantkitError(
                f"{where}: dynamic override {pattern!r} changes the scheme of some modules; quantkit reads "
                "checkpoints with one scheme for every packed linear"
            )
    sym = canon.get("sym", True)
    if layout == LAYOUT_AWQ_GEMM:
        if bits != 4 or group_size <= 0 or sym:
            raise QuantkitError(
                f"{where}: an AWQ GEMM checkpoint with bits={bits}, group_size={group_size}, "
                f"zero_point={not sym}; the layout holds 4-bit codes with zero points in groups"
            )
        return GPTQSettings(bits, group_size, False, False, fmt, raw, layout, method, where)
    return GPTQSettings(bits, group_size, bool(sym), bool(canon.get("desc_act", False)), fmt, raw, layout,
                        method, where)


def _layout(method: str, fmt: str, raw: dict, where: str) -> str:
    """quantkit's name for the layout of (method, format), or a refusal that says what the folder is."""
    if (method, fmt) == ("gptq", "gptq"):
        return LAYOUT
    if (method, fmt) == ("gptq", "gptq_v2"):
        return LAYOUT_GPTQ_V2
    if (method, fmt) == ("awq", "gemm"):
        if str(raw.get("backend", "")).lower() == "llm-awq":
            method, fmt = "awq", "llm-awq"
        else:
            return LAYOUT_AWQ_GEMM
    known = _FOREIGN.get((method, fmt)) or _FOREIGN.get((method, None))
    if known is not None:
        what, convert = known
        raise QuantkitError(f"{where} is {what} (method {method!r}, format {fmt!r}); quantkit reads GPTQ "
                            f"v1/v2 and AutoAWQ GEMM checkpoints. To use it: {convert}")
    if method in ("gptq", "awq"):
        raise QuantkitError(
            f"{where} stores {method} weights in format {fmt!r}, a layout quantkit does not read (it reads "
            "GPTQ 'gptq' (v1), 'gptq_v2' and AWQ 'gemm'); save it again in one of those with the tool that made it"
        )
    raise QuantkitError(
        f"{where} is a {method or 'unknown-method'} checkpoint (quant_method={raw.get('quant_method')!r}); "
        "quantkit reads GPTQ (v1, v2) and AutoAWQ GEMM checkpoints: load this one with the tool that made it, "
        f"or {_REQUANTIZE}"
    )


def is_quantized_checkpoint(path: str | Path) -> bool:
    """True for a folder that declares quantization settings: ``config.json``'s ``quantization_config``
    or a ``quantize_config.json`` / ``quant_config.json`` beside it (AutoGPTQ, GPTQModel).

    Such a folder is read by quantkit's checkpoint reader (which reads it or refuses it saying what it
    is), never as a plain model, where transformers would leave every packed layer at random init.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return False
    if any((folder / name).is_file() for name in QUANTIZE_CONFIG_NAMES):
        return True
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("quantization_config") is not None
