"""Building a :class:`RuntimeModel` or an :class:`Engine` from what a user names (RUNTIME_SPEC.md).

* A quantkit / GPTQ checkpoint folder: its tensors are read layer by layer through quantkit's
  checkpoint reader (validated headers, ``read_tensors``), packed linears kept packed.
* A 16-bit Hugging Face folder with safetensors: the same, every linear 16-bit (the bf16 baseline).
* A ``.gguf`` file or a hub id: loaded by transformers (:func:`quantkit.models.load_model`) and its
  state dict taken over.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from quantkit.config import QuantkitError, resolve_device, resolve_dtype
from quantkit.runtime.engine import Engine
from quantkit.runtime.model import RuntimeModel
from quantkit.runtime.spec import hf_config, spec_from_config
from quantkit.runtime.weights import QuantInfo, load_weights

log = logging.getLogger(__name__)

DEFAULT_MAX_POSITIONS = 32768  # rope tables beyond this are built only when a longer slot asks for them


def resolve_backend(backend: str, device: str) -> str:
    if backend not in ("auto", "kernels", "reference"):
        raise QuantkitError(f"backend must be auto, kernels or reference, got {backend!r}")
    if backend == "auto":
        return "kernels" if device.startswith("cuda") else "reference"
    if backend == "kernels" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise QuantkitError("the kernels backend needs a CUDA device; use --backend reference on the CPU")
    return backend


def _folder_source(path: Path):
    """A tensor source over a plain 16-bit model folder (validated headers, ``read_tensors``)."""
    from quantkit.checkpoint.read import index_tensors, read_tensors

    records = index_tensors(path)

    def source(keys: list[str]) -> dict[str, torch.Tensor]:
        return dict(read_tensors(records, keys))

    return source, set(records)


def _checkpoint_source(path: Path):
    """``(QuantInfo, source, names)`` of a quantized folder in any layout quantkit reads (GPTQ v1/v2, AutoAWQ
    GEMM; settings from config.json or quantize_config.json): the one checkpoint reader, packed linears
    converted to GPTQ v1 as they are read; other layouts are refused there, saying what they are."""
    from quantkit.checkpoint.read import open_checkpoint

    checkpoint = open_checkpoint(path)
    settings = checkpoint.settings
    return QuantInfo(settings.bits, settings.group_size, settings.sym), checkpoint.read, checkpoint.names


def _transformers_source(model: str, dtype: torch.dtype, trust_remote_code: bool):
    from quantkit.config import LoadConfig
    from quantkit.models.load import load_model

    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    loaded = load_model(model, LoadConfig(dtype=name, device="cpu", trust_remote_code=trust_remote_code))
    state = loaded.model.state_dict()
    if "lm_head.weight" in state and getattr(loaded.model.config, "tie_word_embeddings", False):
        del state["lm_head.weight"]

    def source(keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: state[k] for k in keys if k in state}

    gen = getattr(loaded.model, "generation_config", None)
    return source, set(state), loaded.model.config.to_dict(), loaded.tokenizer, gen


def _eos_ids(generation_config, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids: the generation config's (SmolLM2's GGUF tokenizer names the wrong one), else the
    tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _read_folder(path: Path):
    """(config dict, quant info or None, tensor source, tensor names, tokenizer, generation config)."""
    from quantkit.checkpoint.settings import is_quantized_checkpoint

    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else ""
        raise QuantkitError(f"{path} has no config.json{hint}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise QuantkitError(f"{config_file} is not valid JSON ({exc})") from exc
    hf_config(config)  # an unsupported architecture fails here, before any tensor is read
    from quantkit.checkpoint.fp8 import is_fp8_checkpoint, read_fp8_settings

    if is_fp8_checkpoint(path):  # compressed-tensors FP8: settings checked, tensors read as stored
        read_fp8_settings(config.get("quantization_config") or {}, str(config_file))
        quant = None
        source, names = _folder_source(path)
    elif is_quantized_checkpoint(path):
        quant, source, names = _checkpoint_source(path)
    else:
        quant = None
        source, names = _folder_source(path)
    tokenizer = None
    if any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    gen = None
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(path))
    return config, quant, source, names, tokenizer, gen


def load_runtime_model(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "auto",
    trust_remote_code: bool = False,
    max_positions: int | None = None,
    dequantize: bool = False,
):
    """``(RuntimeModel, tokenizer)`` for a checkpoint folder, a 16-bit model folder, a hub id or a .gguf file.

    ``dequantize``: hold packed linears as 16-bit weights (the same model in bf16, for comparisons).
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    chosen = resolve_backend(backend, dev)
    path = Path(model).expanduser()
    generation = None
    if path.is_dir():
        config, quant, source, names, tokenizer, generation = _read_folder(path)
    elif path.suffix == ".gguf" or not path.exists():
        source, names, config, tokenizer, generation = _transformers_source(model, torch_dtype, trust_remote_code)
        quant = None
    else:
        raise QuantkitError(f"{model} is neither a model folder nor a .gguf file")
    cfg = hf_config(config, trust_remote_code)
    spec = spec_from_config(cfg)
    weights = load_weights(
        source,
        names,
        spec,
        quant,
        torch_dtype,
        dev,
        packed_kernel=chosen == "kernels" and not dequantize,
        on_layer=lambda i: log.debug("loaded layer %d", i),
        fp8="dequantize" if dequantize else ("auto" if chosen == "kernels" else "reference"),
    )
    positions = max_positions or min(spec.max_position_embeddings, DEFAULT_MAX_POSITIONS)
    runtime = RuntimeModel(
        spec,
        cfg,
        weights,
        backend=chosen,
        dtype=torch_dtype,
        device=dev,
        max_positions=positions,
        name=path.name if path.exists() else model,
    )
    runtime.eos_token_ids = _eos_ids(generation, tokenizer)
    runtime.quant = quant
    return runtime, tokenizer


def load_engine(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_batch: int = 32,
    max_seq_len: int | None = None,
    backend: str = "auto",
    cuda_graphs: bool | None = None,
    trust_remote_code: bool = False,
    kv_cache_memory: int | str | None = None,
    kv_cache_fraction: float | None = None,
    prefill_chunk: int | None = None,
    kv_cache_dtype: str = "auto",
) -> Engine:
    """An :class:`Engine` (types.Engine) serving ``model``; ``cuda_graphs`` None: on with the kernels backend.

    The KV cache is sized from a memory budget (:mod:`quantkit.runtime.kv_budget`): ``kv_cache_memory``
    bytes (or "4GiB"), ``kv_cache_fraction`` of the free CUDA memory, or the default; it serves as many
    sequences at once as the budget holds, at most ``max_batch``. ``engine.kv_plan`` says what was chosen.
    ``prefill_chunk``: prompt tokens prefilled per step (None: :func:`engine.default_prefill_chunk`).
    ``kv_cache_dtype``: "auto" (the model's dtype) or "fp8" (e4m3 codes and a scale a token and KV head: about
    half the bytes, so about twice the tokens in the same budget; :class:`model.KVCache`)."""
    from quantkit.runtime import kv_budget

    kv_budget.check_kv_dtype(kv_cache_dtype)  # before the model loads
    runtime, tokenizer = load_runtime_model(
        model,
        device=device,
        dtype=dtype,
        backend=backend,
        trust_remote_code=trust_remote_code,
        max_positions=max_seq_len,
    )
    if tokenizer is None:
        raise QuantkitError(f"{model} has no tokenizer files; the engine needs one to decode text")
    seq_len = max_seq_len or min(runtime.spec.max_position_embeddings, 4096)
    graphs = runtime.backend == "kernels" and runtime.device.type == "cuda" if cuda_graphs is None else cuda_graphs
    if graphs and runtime.device.type != "cuda":
        raise QuantkitError("CUDA graphs need a CUDA device")
    kv_plan = kv_budget.plan(runtime.spec, seq_len, runtime.dtype, runtime.device, max_batch=max_batch,
                             memory=kv_cache_memory, fraction=kv_cache_fraction, kv_dtype=kv_cache_dtype)
    log.info("%s", kv_plan.describe())
    engine = Engine(
        runtime,
        tokenizer,
        max_batch=kv_plan.slots,
        max_seq_len=seq_len,
        eos_token_ids=runtime.eos_token_ids,
        cuda_graphs=graphs,
        model_name=runtime.name,
        prefill_chunk=prefill_chunk,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine.kv_plan = kv_plan
    return engine
