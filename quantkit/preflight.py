"""Checks that need no weights, run before any model loads: a mistake costs a second, not a 25 s load.

Each function raises :class:`~quantkit.errors.QuantkitError` with what to do. The model's longest
sequence is read from its config.json alone (or a GGUF file's header, or the hub cache's config.json),
never from loaded weights. ``api.quantize`` and the CLI call :func:`check_quantize` before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError

# config.json keys that hold the longest sequence, in order of preference.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def looks_like_path(spec: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else with a slash, a leading ./ or ~, a .gguf
    suffix, or that exists on disk is a path (the rule of ``quantkit.models.load``)."""
    return (spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
            or Path(spec).expanduser().exists())


def check_model_spec(spec: str, *, check_hub: bool = True) -> None:
    """The model exists where it is named: a .gguf file, a folder with config.json, or a hub id that can
    be reached or is cached (``check_hub``: asks the hub, a few seconds at most when it cannot be reached)."""
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise QuantkitError(f"GGUF file {spec} does not exist; check the path (MODEL is a model folder, a .gguf "
                                "file or a Hugging Face hub id)")
        return
    if looks_like_path(spec):
        if not path.exists():
            raise QuantkitError(f"model folder {spec} does not exist; give a folder with config.json, a .gguf file "
                                "or a Hugging Face hub id")
        if not path.is_dir():
            raise QuantkitError(f"{spec} is a file, not a model folder; give a folder with config.json, a .gguf file "
                                "or a Hugging Face hub id")
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else " (is it a model folder?)"
            raise QuantkitError(f"{spec} has no config.json{hint}")
        return
    if check_hub:
        from quantkit.models.load import hub_offline

        hub_offline(spec)  # raises with what to do when the id is neither reachable nor cached


def _config_int(config: dict, keys: tuple[str, ...]) -> int | None:
    """The first positive integer under ``keys`` in a config (its text model's first, for multimodal configs)."""
    for cfg in (config.get("text_config"), config):
        if isinstance(cfg, dict):
            for key in keys:
                value = cfg.get(key)
                if isinstance(value, int) and value > 0:
                    return value
    return None


def _gguf_positions(path: Path) -> int | None:
    """``<arch>.context_length`` from a GGUF header (the gguf package memory-maps; no tensor is read)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch_field = reader.fields.get("general.architecture")
        if arch_field is None:
            return None
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
        field = reader.fields.get(f"{arch}.context_length")
        return int(field.parts[field.data[0]][0]) if field is not None else None
    except Exception:  # no gguf package or an unusual header: the check after loading still runs
        return None


def _config_file(spec: str) -> Path | None:
    path = Path(spec).expanduser()
    if looks_like_path(spec):
        return path / "config.json" if (path / "config.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return None
    found = try_to_load_from_cache(spec, "config.json")
    return Path(found) if isinstance(found, str) else None


def _config_json(spec: str) -> dict | None:
    """The model's config.json as a dict (a folder, or a hub id already cached); None where it cannot be read."""
    config_file = _config_file(spec)
    if config_file is None:
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_type(spec: str) -> str | None:
    """The model's ``model_type`` read cheaply from its config.json; None where unknown without loading (GGUF
    files, hub ids not cached)."""
    value = None if spec.endswith(".gguf") else (_config_json(spec) or {}).get("model_type")
    return value if isinstance(value, str) else None


def model_max_positions(spec: str) -> int | None:
    """The longest sequence the model allows, read cheaply (config.json or GGUF header); None if unknown."""
    if spec.endswith(".gguf"):
        return _gguf_positions(Path(spec).expanduser())
    config = _config_json(spec)
    return None if config is None else _config_int(config, _POSITION_KEYS)


def check_seqlen(spec: str, seqlen: int | None, option: str = "--seqlen") -> None:
    """Refuse windows longer than the model's positions, from its config alone."""
    if seqlen is None:
        return
    limit = model_max_positions(spec)
    if limit is not None and seqlen > limit:
        raise QuantkitError(f"{option} {seqlen} is longer than the model's {limit} positions; use {option} {limit} "
                            "or less")


def check_scheme(bits: int, group_size: int | None, sym: bool | None) -> None:
    """Bits and group size the checkpoint format holds (an automatic group size is checked once chosen)."""
    import warnings

    from quantkit.config import QuantScheme

    with warnings.catch_warnings():  # the kernel-support warning comes with the real scheme
        warnings.simplefilter("ignore")
        QuantScheme(bits, 128 if group_size is None else group_size, True if sym is None else bool(sym))


def check_quantize(model: str, *, bits: int, group_size: int | None, sym: bool | None,
                   seqlen: int | None, calib_source: str | None, check_hub: bool = True) -> None:
    """Everything about a quantize run that needs no weights, cheapest first (the output folder is
    ``check_output``'s; the calibration file ``check_text_source``'s)."""
    check_scheme(bits, group_size, sym)
    check_model_spec(model, check_hub=check_hub)
    if calib_source is not None and calib_source != "self":
        from quantkit.calib_data.sources import NAMED_SOURCES

        if calib_source not in NAMED_SOURCES:
            from quantkit.calib_data.text import check_local_text

            check_local_text(calib_source, "--calib")
    check_seqlen(model, seqlen)


def check_output_head_rows(rows: int | None, bits: int) -> None:
    """``--quantize-lm-head`` packs the head's ``rows`` (the vocabulary) ``32 / bits`` to a word in the GPTQ layout's
    zero points: refuse a vocabulary that does not fill whole words (``rows`` None: not known yet)."""
    from quantkit.pack import whole_word_multiple

    multiple = whole_word_multiple(bits)
    if rows is not None and rows % multiple:
        raise QuantkitError(f"--quantize-lm-head: the output head has {rows} rows (the vocabulary), not a multiple of "
                            f"{multiple}, which {bits}-bit GPTQ packing needs; leave the head in 16 bits (drop "
                            "--quantize-lm-head)")


def vocab_size(spec: str) -> int | None:
    """The vocabulary size read cheaply from config.json (its text model's for multimodal configs); None if unknown."""
    config = None if spec.endswith(".gguf") else _config_json(spec)
    return None if config is None else _config_int(config, ("vocab_size",))


def check_output(output: str | Path, overwrite: bool) -> Path:
    """Refuse an existing output folder before any long work starts."""
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise QuantkitError(f"output {out} is an existing file, not a folder; choose another --output "
                            "(--overwrite replaces only a folder)")
    if out.exists() and not overwrite:
        raise QuantkitError(f"output folder {out} already exists; choose another --output or pass --overwrite")
    return out


def check_text_source(source: str, named: Any, option: str) -> None:
    """Before any model is loaded: a local file must exist and hold text; a named hub source needs the hub
    (reachable, or offline mode set with a cached copy, which ``datasets`` checks when it loads)."""
    from quantkit.calib_data.text import check_local_text, env_offline, hub_reachable, local_file_hint

    if source == "self":
        return
    if source in named:
        if not env_offline() and not hub_reachable():
            raise QuantkitError(f"{option} {source} is on the Hugging Face hub, which cannot be reached from here; "
                                f"{local_file_hint(option)}")
        return
    check_local_text(source, option)
