"""The offline default calibration source ``self``: text the model generates from its own start token.

Why: it needs no network and no one else's text, and it follows the model's own distribution (the
data-free calibration idea of LLM-QAT). Every sample is ``[start] + seqlen - 1`` sampled tokens.

Start token (``start_token_id``):
1. the BOS, when the tokenizer puts one in front of every text (``needs_bos``: Llama 2/3, Gemma).
   Windows then start with BOS exactly like the perplexity windows and the named sources' windows.
2. otherwise the first token of the chat template rendered for one user turn (``<|im_start|>`` for
   SmolLM2 and Qwen): an instruct model then writes conversations, the text it sees in use.
3. otherwise the tokenizer's BOS if it has one, else its EOS (the document separator GPT-2-style
   models were trained with).

Sampling: temperature 1, top-k 50, top-p 0.95 (keeps the model's distribution apart from its long
tail of unlikely tokens), EOS not treated as a stop so every sample has ``seqlen`` tokens; batches
of ``batch_size`` sequences with a KV cache; a ``torch.Generator`` seeded with ``seed`` (the global
RNG is never touched). The samples also depend on the batch size (which draws of the generator go
to which sequence) and on the device, so both are part of the cache key.

Cache: ``$QUANTKIT_CACHE/calib/`` (default ``~/.cache/quantkit/calib/``), one ``.pt`` file per key,
the SHA-256 of (model config, weights fingerprint, start token, nsamples, seqlen, seed, sampling
settings, batch size, device, dtype). The weights fingerprint hashes each tensor's name, shape,
dtype, 1,024 evenly strided values and its float64 sum, so any real change of the weights (another
checkpoint, a fine-tune, a quantized model) gives a new key.

Cost on the CPU (measured 2026-11-30, SmolLM2-135M fp32, batch 16, one thread): 16 x 512 took
109 s of CPU time (0.15 s per decoding step of 16 sequences at the start, 0.23 s near position 512
as attention reads a longer KV cache); on the shared, oversubscribed 2-core machine that was 204 s
of wall time. Expect about 15 CPU-minutes for 128 x 512 and well over an hour for GPTQ's 128 x
2048, so on a CPU choose small settings or a local file. A cache hit costs one weights fingerprint
(0.7 s for this model).

On a CUDA device (``sampler="auto"``) the samples come from quantkit's runtime instead, every sequence
decoded at once with the step in a CUDA graph (``runtime_sampler``): 128 x 2048 tokens of a Llama-3-8B
shape in 27.4 s on one H200 (2026-12-05, ``bench/results/shortest_command_8b_h200.json``). Models the
runtime cannot run keep the transformers path, with the reason logged.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.calib_data.sampling import sample_next
from quantkit.calib_data.text import needs_bos
from quantkit.config import QuantkitError

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what a cached file means changes
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 0.95
DEFAULT_TEMPERATURE = 1.0
DEFAULT_BATCH_SIZE = 16
_FINGERPRINT_VALUES = 1024
_SUM_CHUNK = 1 << 22  # elements summed at a time, so no float64 copy of a whole embedding is made
# Config keys that name where a model came from, not what it is.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path")

ProgressCallback = Callable[[int, int], None]


def default_cache_dir() -> Path:
    """``$QUANTKIT_CACHE/calib`` when the variable is set, else ``~/.cache/quantkit/calib``."""
    root = os.environ.get("QUANTKIT_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "quantkit") / "calib"


def start_token_id(tokenizer: Any, model_config: Any = None) -> int:
    """The token every generated sample starts from (see the module docstring for the order)."""
    if needs_bos(tokenizer, model_config):
        return int(tokenizer.bos_token_id)
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
        except Exception as err:  # noqa: BLE001 - templates may reject a lone user turn; fall back to BOS/EOS
            log.debug("chat template gave no start token: %s", err)
        else:
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            if ids:
                return int(ids[0])
    for token_id in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if token_id is not None:
            return int(token_id)
    raise QuantkitError("the tokenizer has no BOS, EOS or chat template to start self-generated calibration from; "
                        "use --calib PATH with a .txt/.jsonl/.parquet file")


def generate_calibration(
    model: nn.Module,
    tokenizer: Any,
    *,
    nsamples: int,
    seqlen: int,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int = DEFAULT_TOP_K,
    top_p: float = DEFAULT_TOP_P,
    cache_dir: str | Path | None = None,
    on_progress: ProgressCallback | None = None,
    sampler: str = "auto",
) -> torch.Tensor:
    """``nsamples`` sequences ``[nsamples, seqlen]`` (LongTensor, on the CPU) sampled from ``model``.

    Reads the result from the cache when the same model and settings were used before, else
    generates and stores it. ``cache_dir=None`` uses ``default_cache_dir()``. ``on_progress(done,
    total)`` counts generated tokens (``total = nsamples * (seqlen - 1)``). ``sampler``: "auto" (quantkit's
    runtime on a CUDA device when it runs the model, else transformers on the model's device:
    ``runtime_sampler.choose_sampler``), "runtime" or "transformers"; ``batch_size`` is the transformers
    path's (the runtime sizes its batch to the device memory)."""
    from quantkit.calib_data.runtime_sampler import choose_sampler

    _check_seqlen(model, seqlen)
    start_id = start_token_id(tokenizer, getattr(model, "config", None))
    choice = choose_sampler(model, nsamples, seqlen, sampler)
    settings = {
        "format": CACHE_FORMAT, "start": start_id, "nsamples": nsamples, "seqlen": seqlen, "seed": seed,
        "batch_size": choice.batch if choice.runtime else batch_size, "temperature": temperature,
        "top_k": top_k, "top_p": top_p, "device": choice.device.type,
    }
    if choice.runtime:  # the transformers path keeps its keys (and the files cached under them)
        settings["sampler"] = "runtime"
    key = cache_key(model, settings)
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = path / f"{key}.pt"
    cached = _read_cache(path, nsamples, seqlen)
    if cached is not None:
        log.info("self-generated calibration read from cache %s", path)
        return cached
    started = time.perf_counter()
    if choice.runtime:
        from quantkit.calib_data.runtime_sampler import sample_on_runtime

        on_cuda = choice.device.type == "cuda"
        samples = sample_on_runtime(
            model, start_id, nsamples=nsamples, seqlen=seqlen, seed=seed, batch_size=choice.batch,
            temperature=temperature, top_k=top_k, top_p=top_p, device=choice.device,
            backend="kernels" if on_cuda else "reference", cuda_graphs=on_cuda, on_progress=on_progress,
        )
        how = f"on quantkit's runtime ({choice.device}, {choice.batch} sequences at once)"
    else:
        log.info("self-generated calibration with transformers on %s: %s", choice.device, choice.reason)
        samples = sample_sequences(
            model, start_id, nsamples=nsamples, seqlen=seqlen, seed=seed, batch_size=batch_size,
            temperature=temperature, top_k=top_k, top_p=top_p, on_progress=on_progress,
        )
        how = f"with transformers on {choice.device}"
    log.info("generated %d x %d calibration tokens %s in %.1f s", nsamples, seqlen, how, time.perf_counter() - started)
    _write_cache(path, samples, settings)
    return samples


def sample_sequences(
    model: nn.Module,
    start_id: int,
    *,
    nsamples: int,
    seqlen: int,
    seed: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int = DEFAULT_TOP_K,
    top_p: float = DEFAULT_TOP_P,
    on_progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """Sample ``[nsamples, seqlen]`` token ids from ``start_id`` in batches, with a KV cache. No cache on disk."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    device = _model_device(model)
    generator = torch.Generator(device=device).manual_seed(seed)
    total = nsamples * (seqlen - 1)
    batches = []
    model.eval()
    with torch.inference_mode():
        for first in range(0, nsamples, batch_size):
            size = min(batch_size, nsamples - first)
            tokens = torch.full((size, 1), start_id, dtype=torch.long, device=device)  # [b, 1]
            out = model(input_ids=tokens, use_cache=True)
            for step in range(seqlen - 1):
                next_ids = sample_next(out.logits[:, -1, :], generator, temperature, top_k, top_p)  # [b]
                tokens = torch.cat([tokens, next_ids[:, None]], dim=1)  # [b, step + 2]
                if on_progress is not None:
                    on_progress(first * (seqlen - 1) + size * (step + 1), total)
                if step < seqlen - 2:  # the last sampled token needs no forward of its own
                    out = _decode_step(model, next_ids[:, None], out)
            batches.append(tokens.cpu())
            log.info("self-generated calibration: %d / %d samples", first + size, nsamples)
    return torch.cat(batches)


def _decode_step(model: nn.Module, input_ids: torch.Tensor, previous: Any) -> Any:
    """One forward of ``input_ids`` ``[b, 1]`` on top of the KV cache ``previous`` returned.

    transformers 5.24 renamed the cache argument and output field from ``past_key_values`` to
    ``cache``; both spellings are handled so older releases keep working."""
    if "cache" in inspect.signature(model.forward).parameters:
        return model(input_ids=input_ids, use_cache=True, cache=previous.cache)
    return model(input_ids=input_ids, use_cache=True, past_key_values=previous.past_key_values)


def cache_key(model: nn.Module, settings: dict[str, Any]) -> str:
    """SHA-256 over the model's config, a fingerprint of its weights and ``settings``."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    for volatile in _VOLATILE_CONFIG_KEYS:
        config_dict.pop(volatile, None)
    digest.update(json.dumps(config_dict, sort_keys=True, default=str).encode())
    digest.update(weights_fingerprint(model).encode())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


def weights_fingerprint(model: nn.Module) -> str:
    """A hash of every tensor in ``model.state_dict()``: name, shape, dtype, strided values, sum."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            flat = tensor.detach().reshape(-1)
            stride = max(1, flat.numel() // _FINGERPRINT_VALUES)
            digest.update(flat[::stride].to("cpu", torch.float64).numpy().tobytes())
            total = sum(chunk.sum(dtype=torch.float64).item() for chunk in flat.split(_SUM_CHUNK))
            digest.update(repr(total).encode())
    return digest.hexdigest()


def _read_cache(path: Path, nsamples: int, seqlen: int) -> torch.Tensor | None:
    if not path.is_file():
        return None
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
        samples = stored["input_ids"]
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: regenerate rather than fail
        log.warning("ignoring unreadable calibration cache %s (%s)", path, err)
        return None
    if samples.dtype != torch.long or tuple(samples.shape) != (nsamples, seqlen):
        log.warning("ignoring calibration cache %s: shape %s, expected (%d, %d)", path, tuple(samples.shape),
                    nsamples, seqlen)
        return None
    return samples


def _write_cache(path: Path, samples: torch.Tensor, settings: dict[str, Any]) -> None:
    """Write through a temporary file and rename, so a crash never leaves a half-written cache entry."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"input_ids": samples, "settings": json.dumps(settings)}, partial)
        os.replace(partial, path)
    except OSError as err:  # a read-only home must not cost the user the generated samples
        log.warning("could not cache self-generated calibration at %s (%s)", path, err)


def _check_seqlen(model: nn.Module, seqlen: int) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and seqlen > max_positions:
        raise QuantkitError(f"--seqlen {seqlen} is longer than the model's {max_positions} positions; lower --seqlen")


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
