"""Loading a causal LM to quantize: a Hugging Face folder, a hub id, or a GGUF file.

Models are loaded into host memory; the walker moves one decoder layer at a time to the device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.config import LoadConfig, QuantkitError, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what the user named
    gguf_file: str | None = None
    use_cache: bool | None = None  # the model's own setting, switched off while quantizing

    def restore_config(self) -> None:
        """Put back what loading changed for calibration, so a saved checkpoint keeps the model's settings."""
        if self.use_cache is not None:
            self.model.config.use_cache = self.use_cache


def _looks_like_path(spec: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else with a slash, a leading ./ or ~, a .gguf
    suffix, or that exists on disk is a path."""
    return (spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
            or Path(spec).expanduser().exists())


def _clear_gguf_quantizer_marks(model) -> None:
    """A GGUF-loaded model carries the marks of transformers' GGUF quantizer although its weights are
    plain dequantized tensors; clear them so the model saves and quantizes like any other."""
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def _fix_gguf_eos(model, tokenizer) -> None:
    """GGUF conversions can name the wrong end-of-sequence token; the generation config's is right."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None and tokenizer is not None and tokenizer.eos_token_id != eos:
        token = tokenizer.convert_ids_to_tokens(eos)
        log.info("tokenizer eos %r differs from the generation config's %r; using the latter",
                 tokenizer.eos_token, token)
        tokenizer.eos_token = token


def load_model(spec: str, load: LoadConfig = LoadConfig()) -> LoadedModel:
    """Load ``spec`` (folder, hub id or ``.gguf`` file) on the CPU in the configured dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(load.device)
    dtype = resolve_dtype(load.dtype, device)
    path = Path(spec).expanduser()
    kwargs: dict = {"dtype": dtype, "trust_remote_code": load.trust_remote_code}
    gguf_file = None
    if path.suffix == ".gguf":
        if not path.is_file():
            raise QuantkitError(f"GGUF file {spec} does not exist")
        gguf_file = path.name
        folder = str(path.parent)
        kwargs["gguf_file"] = gguf_file
    elif _looks_like_path(spec):
        if not path.exists():
            raise QuantkitError(f"model folder {spec} does not exist; give a folder with config.json, a .gguf file "
                                "or a Hugging Face hub id")
        if path.is_dir() and not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else ""
            raise QuantkitError(f"{spec} has no config.json{hint}")
        folder = str(path)
    else:
        folder = spec
        if hub_offline(spec):
            kwargs["local_files_only"] = True
    try:
        with quiet_transformers(gguf=gguf_file is not None):
            model, loading_info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(folder, **{k: v for k, v in kwargs.items() if k != "dtype"})
    except (OSError, ValueError) as exc:
        raise QuantkitError(_explain_load_error(spec, exc)) from exc
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" not in str(exc) and "size mismatch" not in str(exc):
            raise
        raise QuantkitError(f"{spec}: some weights in the files have shapes the model's config.json does not "
                            f"give ({str(exc).splitlines()[0]}); the weights do not belong to this config") from exc
    check_loading_info(spec, loading_info)
    if gguf_file is not None:
        _clear_gguf_quantizer_marks(model)
        _fix_gguf_eos(model, tokenizer)
    model.eval()
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = False  # calibration forwards need no KV cache
    return LoadedModel(model=model, tokenizer=tokenizer, source=spec, gguf_file=gguf_file, use_cache=use_cache)


@contextlib.contextmanager
def quiet_transformers(gguf: bool = False) -> Iterator[None]:
    """No tqdm bars from transformers and huggingface_hub while loading ("Loading weights", GGUF
    conversion): the CLI draws its own progress and the bars leak onto stderr."""
    import functools

    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The GGUF converter calls tqdm itself, past transformers' switch: hand it a disabled one meanwhile.
    gguf_utils = None
    if gguf:
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        except ImportError:  # no gguf package: loading will say so
            gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def hub_offline(repo_id: str) -> bool:
    """Whether hub id ``repo_id`` must be loaded from the local cache; refuses at once (QuantkitError)
    when it is not cached and the hub cannot be reached, instead of transformers' retries (35 s).

    Offline: ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is set, or the hub does not answer a TCP
    connection within a few seconds (``quantkit.hub.hub_reachable``)."""
    from quantkit.hub import env_offline, hub_reachable

    if env_offline():
        why = "offline mode is set (HF_HUB_OFFLINE)"
    elif hub_reachable():
        return False
    else:
        why = "the Hugging Face hub cannot be reached from here"
    if not _hub_cached(repo_id):
        raise QuantkitError(f"{repo_id!r} looks like a Hugging Face hub id, but {why} and it is not in the local "
                            "cache: pass a local model folder or a .gguf file, or download it where there is "
                            "network")
    return True


def _hub_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return False
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an invalid repo id is simply not cached
        return False


def _explain_load_error(spec: str, exc: Exception) -> str:
    text = str(exc)
    if "Unrecognized configuration class" in text or "does not recognize this architecture" in text:
        return f"{spec} is not a causal language model transformers can load: {text.splitlines()[0]}"
    if "pip install" in text and ("gguf" in text.lower() or "accelerate" in text):
        return f"loading {spec} needs extra packages: pip install 'quantkit[gguf]' ({text.splitlines()[0]})"
    if not _looks_like_path(spec):
        return (f"could not load {spec!r} from the Hugging Face hub ({text.splitlines()[0]}). Without network, "
                "download it elsewhere and pass its local folder, or a .gguf file")
    return f"could not load {spec}: {text.splitlines()[0]}"


def check_loading_info(spec: str, info: dict) -> None:
    """Refuse a load that left weights at random init or ignored tensors in the files.

    ``info`` is transformers' ``output_loading_info`` record (``missing_keys``, ``unexpected_keys``,
    ``mismatched_keys``); transformers only logs these, and a model with random layers evaluates to a
    plausible-looking number, so each is a :class:`QuantkitError` naming the keys.
    """
    from quantkit.checkpoint.read import name_keys

    problems = []
    for field, what in (("missing_keys", "missing from the files (they would stay at random init)"),
                        ("unexpected_keys", "in the files but not in the model"),
                        ("mismatched_keys", "of another shape than the model's")):
        keys = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(field) or ())
        if keys:
            problems.append(f"{len(keys)} weight(s) {what}: {name_keys(keys)}")
    if not problems:
        return
    unexpected = [str(k) for k in info.get("unexpected_keys") or ()]
    hint = "the files do not match the model's config.json; re-download or re-create the model"
    if any(k.endswith((".qweight", ".qzeros")) for k in unexpected):
        hint = ("the files hold packed GPTQ/AWQ tensors (.qweight) but the folder declares no quantization "
                "settings (config.json quantization_config or quantize_config.json): add the settings file "
                "the quantizing tool wrote")
    raise QuantkitError(f"{spec} does not load as a complete model: " + "; ".join(problems) + f". {hint}")


def load_any(model: str, load: LoadConfig = LoadConfig()):
    """(model, tokenizer) for a quantized checkpoint folder or any model ``load_model`` takes.

    ``load.dtype`` means the same for both: ``auto`` is bfloat16 on CUDA and float32 on the CPU.
    """
    from quantkit.checkpoint.settings import is_quantized_checkpoint

    device = resolve_device(load.device)
    dtype = resolve_dtype(load.dtype, device)
    if is_quantized_checkpoint(model):
        from quantkit.checkpoint.read import load_quantized as read_checkpoint

        return read_checkpoint(Path(model).expanduser(), device="cpu", dtype=dtype)
    loaded = load_model(model, load)
    return loaded.model, loaded.tokenizer
