"""Self-generated calibration on quantkit's runtime: every sequence decoded at once, the step a CUDA graph.

``self_generated.sample_sequences`` drives the transformers model token by token on whatever device it
sits on; ``quantkit gptq`` loads it on the host, so on a GPU machine it sampled on the CPU (an 8B model:
not done after 8 minutes). Here the model's tensors go to the GPU once as a :class:`RuntimeModel`
(q/k/v and gate/up fused, quantkit's decode kernels), a KV cache holds ``batch`` sequences of ``seqlen``
positions, and each decoding step is one replay of a captured graph followed by the same sampler
(``sampling.sample_next``: temperature, top-k, top-p, one seeded ``torch.Generator``), so the host
never waits on the device except for progress. The start token is decoded as the step at position 0 (no
prefill); the last sampled token needs no forward.

Batch: as many sequences as the free device memory holds next to the weights (all 128 of GPTQ's default
on an H200 for an 8B model: 34 GB of KV cache); the samples depend on it, so it is part of the cache key.

:func:`runtime_blocker` says why a model cannot take this path (no CUDA device, a family the runtime does
not run, 32-bit weights); the caller then keeps the transformers path and logs the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.config import QuantkitError

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 15.0  # a log line at least this often while sampling
_MARGIN_BYTES = 6 * 2**30  # device memory left free: logits, sampling temporaries, the graph's pool
_SYNC_EVERY = 64  # steps between host waits: keeps the progress line's ETA honest


def runtime_blocker(model: nn.Module, device: torch.device | None = None) -> str | None:
    """None when ``model`` can be sampled on the runtime on ``device`` (default: the first CUDA device),
    else the reason it cannot."""
    if device is None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        device = torch.device("cuda", torch.cuda.current_device())
    params = list(model.parameters())
    if not params:
        return "the model has no parameters"
    dtype = params[0].dtype
    if device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        return f"the runtime's kernels take 16-bit weights, the model holds {str(dtype).removeprefix('torch.')}"
    if any(p.device.type == "meta" for p in params):
        return "some weights are not loaded (meta tensors)"
    try:
        _runtime_config(model)
    except QuantkitError as exc:
        return str(exc)
    return None


SAMPLERS = ("auto", "runtime", "transformers")


@dataclass(frozen=True)
class SamplerChoice:
    """Which sampler runs (``runtime`` or not), on which device, with how many sequences at once (the
    runtime's; None for transformers, whose batch the caller sets), and why the runtime was not taken."""

    runtime: bool
    device: torch.device
    batch: int | None = None
    reason: str = ""


def choose_sampler(model: nn.Module, nsamples: int, seqlen: int, requested: str = "auto") -> SamplerChoice:
    """``auto``: the runtime on the first CUDA device when :func:`runtime_blocker` finds nothing against it,
    else transformers on the model's device with the blocker as reason. ``runtime``: the runtime, on CUDA
    when there is one, else on the model's device with the reference backend (an error if it cannot run
    the model). ``transformers``: always the old path."""
    if requested not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {requested!r}")
    own = next(model.parameters()).device
    if requested == "transformers":
        return SamplerChoice(False, own, reason="the transformers sampler was asked for")
    cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = cuda if cuda is not None or requested == "auto" else own
    blocker = runtime_blocker(model, device) if device is not None else "no CUDA device"
    if blocker is not None:
        if requested == "runtime":
            raise QuantkitError(f"self-generated calibration cannot run on quantkit's runtime: {blocker}")
        return SamplerChoice(False, own, reason=blocker)
    return SamplerChoice(True, device, planned_batch(model, nsamples, seqlen, device))


def planned_batch(model: nn.Module, nsamples: int, seqlen: int, device: torch.device) -> int:
    """Sequences decoded at once: all ``nsamples`` on the CPU; on CUDA what the free memory holds once the
    weights are copied there (the samples depend on it: it goes into the cache key)."""
    if device.type != "cuda":
        return nsamples
    _, spec = _runtime_config(model)
    dtype = next(model.parameters()).dtype
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.device != device)
    free, _ = torch.cuda.mem_get_info(device)
    return batch_for_memory(free - weights, kv_bytes_per_sequence(spec, seqlen, dtype), spec.vocab_size, nsamples)


def _runtime_config(model: nn.Module):
    from quantkit.runtime.spec import hf_config, spec_from_config

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise QuantkitError("the model has no transformers config")
    cfg = hf_config(config.to_dict())
    return cfg, spec_from_config(cfg)


def build_runtime(model: nn.Module, device: torch.device, backend: str, max_positions: int):
    """A :class:`RuntimeModel` on ``device`` with ``model``'s tensors (copied there; ``model`` stays as it is)."""
    from quantkit.runtime.model import RuntimeModel
    from quantkit.runtime.weights import load_weights

    cfg, spec = _runtime_config(model)
    state = model.state_dict()
    dtype = next(model.parameters()).dtype

    def source(keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: state[k] for k in keys if k in state}

    weights = load_weights(source, set(state), spec, None, dtype, device, packed_kernel=False)
    return RuntimeModel(spec, cfg, weights, backend=backend, dtype=dtype, device=device, max_positions=max_positions)


def kv_bytes_per_sequence(spec, seqlen: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one sequence of ``seqlen`` positions over every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * seqlen * spec.num_kv_heads * spec.head_dim * element


def batch_for_memory(free_bytes: int, per_sequence: int, vocab: int, nsamples: int) -> int:
    """Sequences that fit in ``free_bytes`` (after the weights), each with its KV cache and float32 logits
    (a few copies while sampling), at most ``nsamples``; at least 1."""
    per_row = per_sequence + 6 * vocab * 4
    return max(1, min(nsamples, (free_bytes - _MARGIN_BYTES) // per_row))


def sample_on_runtime(
    model: nn.Module,
    start_id: int,
    *,
    nsamples: int,
    seqlen: int,
    seed: int,
    batch_size: int | None,
    temperature: float,
    top_k: int,
    top_p: float,
    device: torch.device,
    backend: str = "kernels",
    cuda_graphs: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """``[nsamples, seqlen]`` token ids (CPU LongTensor) sampled from ``start_id`` on the runtime.

    ``batch_size`` None: sized to the free device memory after the copy (:func:`resolved_batch`). The CPU
    takes ``backend="reference", cuda_graphs=False``."""
    from quantkit.calib_data.sampling import sample_next

    started = time.perf_counter()
    runtime = build_runtime(model, device, backend, max_positions=seqlen)
    batch = batch_size or resolved_batch(runtime, nsamples, seqlen)
    log.info("self-calibration on the runtime (%s, %s): model on %s in %.1f s, %d sequences at once",
             backend, "CUDA graphs" if cuda_graphs else "eager", device, time.perf_counter() - started, batch)
    generator = torch.Generator(device=device).manual_seed(seed)
    total = nsamples * (seqlen - 1)
    report = _Reporter(total, on_progress)
    out = []
    for first in range(0, nsamples, batch):
        size = min(batch, nsamples - first)
        decoder = _Decoder(runtime, size, seqlen, start_id, cuda_graphs)
        tokens = torch.empty(size, seqlen, dtype=torch.long, device=device)  # [b, seqlen]
        tokens[:, 0] = start_id
        for step in range(seqlen - 1):
            logits = decoder.step()  # [b, V] for position step + 1
            next_ids = sample_next(logits, generator, temperature, top_k, top_p)  # [b]
            tokens[:, step + 1] = next_ids
            if step < seqlen - 2:
                decoder.feed(next_ids)
            if device.type == "cuda" and step % _SYNC_EVERY == _SYNC_EVERY - 1:
                torch.cuda.synchronize(device)
            report(first * (seqlen - 1) + size * (step + 1))
        out.append(tokens.cpu())
        del decoder
    del runtime
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return torch.cat(out)


def resolved_batch(runtime, nsamples: int, seqlen: int) -> int:
    """The batch :func:`sample_on_runtime` takes when none is given: what fits on the device now."""
    if runtime.device.type != "cuda":
        return nsamples
    free, _ = torch.cuda.mem_get_info(runtime.device)
    per_sequence = kv_bytes_per_sequence(runtime.spec, seqlen, runtime.dtype)
    return batch_for_memory(free, per_sequence, runtime.spec.vocab_size, nsamples)


class _Decoder:
    """``b`` sequences in cache slots ``0..b-1``: :meth:`step` runs the token buffer at the position buffer
    (one graph replay on CUDA) and returns the logits; :meth:`feed` sets the next tokens, one position on."""

    def __init__(self, runtime, b: int, seqlen: int, start_id: int, cuda_graphs: bool) -> None:
        from quantkit.runtime.model import KVCache

        dev = runtime.device
        self.runtime = runtime
        self.cache = KVCache.allocate(runtime.spec, b, seqlen, runtime.dtype, dev)
        self.tokens = torch.full((b,), start_id, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int32, device=dev)
        self.slots = torch.arange(b, dtype=torch.int32, device=dev)
        self.graph = None
        if cuda_graphs:
            self._capture()

    def _forward(self) -> torch.Tensor:
        return self.runtime.decode(self.tokens, self.positions, self.slots, self.cache)

    def _capture(self) -> None:
        dev = self.runtime.device
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # Triton compiles and tunes here, outside the capture
            for _ in range(2):
                self._forward()  # writes position 0 of every slot: the first real step writes it again
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()

    def step(self) -> torch.Tensor:
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits

    def feed(self, next_ids: torch.Tensor) -> None:
        self.tokens.copy_(next_ids)
        self.positions.add_(1)


class _Reporter:
    """Passes every count to ``on_progress`` and logs ``k / n tokens`` with an ETA every PROGRESS_SECONDS."""

    def __init__(self, total: int, on_progress: Callable[[int, int], None] | None) -> None:
        self.total, self.on_progress = total, on_progress
        self.started = self.last = time.perf_counter()

    def __call__(self, done: int) -> None:
        if self.on_progress is not None:
            self.on_progress(done, self.total)
        now = time.perf_counter()
        if now - self.last < PROGRESS_SECONDS or done >= self.total:
            return
        self.last = now
        elapsed = now - self.started
        eta = elapsed * (self.total - done) / max(done, 1)
        log.info("self-calibration: %d / %d tokens, %.0f s elapsed, about %.0f s left", done, self.total, elapsed, eta)
