"""The one layer-by-layer walker every method runs under.

For each decoder layer i: move it to the work device, hand it with its calibration inputs (hidden
states plus the keyword arguments the model passes it: attention mask, position embeddings, ...) to
the method, install the dequantized weights the method returns, and run the quantized layer to
produce the inputs of layer i + 1. Only the layer being worked on sits on the accelerator; the rest
of the model stays where it was loaded (the CPU).

The layers are reached through ``LayerSource``, so a later reader that materializes one layer at a
time from safetensors shards (for models larger than host memory) only has to implement it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from quantkit.arch import ArchSpec, arch_for, find_decoder_layers, find_linears, sequential_groups
from quantkit.calibrate.activations import (
    PhaseClock,
    move_outside_layers,
    offload_activations,
    offload_to_host,
    restore_outside_layers,
)
from quantkit.calibrate.pipeline import LayerPipeline, weight_to_host
from quantkit.distributed.comm import LOCAL, Communicator
from quantkit.distributed.plan import shard_windows
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)

# Keyword arguments that belong to generation, not to a calibration forward.
_DROP_KWARGS = ("past_key_value", "past_key_values", "cache", "use_cache", "output_attentions")


class StopForward(Exception):
    """Raised inside a forward to end it early once everything needed has been seen."""


@dataclass
class LayerInputs:
    """Calibration inputs of one decoder layer: batches ``[b, S, H]`` and the layer's keyword arguments.

    Under several ranks ``hidden`` is this rank's share, windows ``first_window ..`` of the whole set
    of ``total_tokens`` tokens (None: this share is the whole set).

    The batches live on the work device, or in (pinned) host memory when ``offload`` is set: read
    them through ``batches()``, which brings each one to ``device`` as it is needed, and store a
    batch produced on the device (a layer's output) through ``keep()``.
    """

    hidden: list[torch.Tensor]
    kwargs: dict[str, Any]
    first_window: int = 0
    total_tokens: int | None = None
    device: torch.device | None = None  # None: use the batches where they are
    offload: bool = False

    def batches(self):
        """The batches on the work device, one at a time (the next one's copy already queued)."""
        if self.device is None:
            yield from self.hidden
            return
        nxt = self.hidden[0].to(self.device, non_blocking=True) if self.hidden else None
        for i in range(len(self.hidden)):
            cur = nxt
            if i + 1 < len(self.hidden):
                nxt = self.hidden[i + 1].to(self.device, non_blocking=True)
            yield cur

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as this set stores batches: unchanged, or copied to (pinned) host memory."""
        return offload_to_host(t) if self.offload else t

    @property
    def n_tokens(self) -> int:
        """Tokens of this rank's share."""
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    @property
    def n_tokens_all(self) -> int:
        """Tokens of the whole calibration set, over every rank (decisions that must agree use it)."""
        return self.n_tokens if self.total_tokens is None else self.total_tokens


@dataclass
class LayerContext:
    """What a method sees of one decoder layer."""

    index: int
    n_layers: int
    prefix: str  # full module name of the layer, e.g. "model.layers.3"
    layer: nn.Module  # on ``device``
    linears: dict[str, nn.Linear]  # the linears to quantize, by path relative to the layer
    groups: list[list[str]]  # true-sequential groups of ``linears``
    spec: ArchSpec | None
    inputs: LayerInputs | None  # None for methods without calibration
    device: torch.device
    comm: Communicator = LOCAL  # the ranks sharing this layer's work (one process: LOCAL)
    # The layer is dropped once its packed weights are handed over (a streaming source): a method may free a
    # linear's float weight as soon as nothing of this layer's work reads it again.
    releasable: bool = False


@dataclass
class LayerResult:
    """What a method returns for one layer. ``stats[name]`` holds per-linear numbers (errors, time)."""

    weights: dict[str, QuantizedWeight]
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # A method that already computed the next layer's inputs (or wants them from another version of
    # the layer) returns them here; otherwise the walker runs the quantized layer.
    next_hidden: list[torch.Tensor] | None = None
    # Linears whose layer already holds exactly ``weights[name].dequantize()`` (installed on the device
    # by the method): the walker does not unpack and install them again.
    installed: frozenset[str] = frozenset()
    phases: dict[str, float] = field(default_factory=dict)  # seconds of the method's own steps, by name


class Method(Protocol):
    """The interface a quantization method implements."""

    name: str
    needs_calibration: bool

    def quantize_layer(self, ctx: LayerContext) -> LayerResult: ...


@dataclass
class LayerEvent:
    """Progress of the walk, for whoever displays it."""

    index: int
    n_layers: int
    prefix: str
    seconds: float
    elapsed: float
    peak_memory_bytes: int
    result: LayerResult
    phases: dict[str, float] = field(default_factory=dict)  # the walker's steps (and the method's), seconds


@dataclass
class WalkResult:
    weights: dict[str, QuantizedWeight]  # by full module name
    layer_stats: list[dict[str, Any]]
    seconds: float


class LayerSource(Protocol):
    """Where decoder layers come from: a loaded model (``ModelLayers``) or safetensors read one layer at a
    time (``quantkit.models.lazy.SafetensorsLayers``).

    ``layers`` is the model's own module list (its layers may hold meta parameters until ``layer(i)``
    materializes them). ``finish(i, weights)`` is called once layer ``i`` is quantized, with its packed
    weights by full module name; it returns the ones the walk result keeps (a streaming source writes
    them out, frees the layer and keeps only their shapes).
    """

    prefix: str
    layers: nn.ModuleList

    def __len__(self) -> int: ...
    def layer(self, index: int) -> nn.Module: ...
    def finish(self, index: int, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]: ...


@dataclass
class ModelLayers:
    """Decoder layers of a model already in host memory."""

    prefix: str
    layers: nn.ModuleList

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, index: int) -> nn.Module:
        return self.layers[index]

    def finish(self, index: int, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        return weights


def first_output(out: Any) -> torch.Tensor:
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item is one (4.x)."""
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    """Outputs of ``layer`` for every calibration batch, stored as ``inputs`` stores its batches."""
    return [inputs.keep(first_output(layer(h, **inputs.kwargs))) for h in inputs.batches()]


@torch.no_grad()
def propagate(layer: nn.Module, inputs: LayerInputs, name: str) -> list[torch.Tensor]:
    """Like ``run_layer``, but each output replaces its input batch in ``inputs.hidden`` as soon as it
    exists (the inputs are not needed any more): inputs and outputs never both fill memory.
    Non-finite outputs raise, naming the layer."""
    hidden = inputs.hidden
    finite = []  # checked once at the end: no host round trip per batch
    for i, h in enumerate(inputs.batches()):
        out = first_output(layer(h, **inputs.kwargs))
        finite.append(torch.isfinite(out).all())
        del h
        hidden[i] = inputs.keep(out)
    check_finite(finite, name)
    return hidden


def check_finite(flags: list[torch.Tensor], name: str) -> None:
    """Raise if any of the per-batch ``isfinite(...).all()`` flags is false (one host round trip)."""
    if flags and not bool(torch.stack([f.to(flags[0].device) for f in flags]).all()):
        raise FloatingPointError(f"non-finite activations after {name}")


@torch.no_grad()
def capture_calls(
    layer: nn.Module,
    inputs: LayerInputs,
    names: list[str],
    on_call: Callable[[str, tuple, dict, Any], None],
    stop_early: bool = True,
) -> None:
    """Run ``layer`` on every batch and call ``on_call(name, args, kwargs, output)`` for each call of the
    named sub-modules. With ``stop_early`` each batch's forward ends once all of them have run, so
    capturing the inputs of the attention projections costs no MLP work.
    """
    modules = dict(layer.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"no sub-modules {missing} in {type(layer).__name__}")
    seen: set[str] = set()

    def make_hook(name: str):
        def hook(module, args, kwargs, output):
            on_call(name, args, kwargs, output)
            seen.add(name)
            if stop_early and len(seen) == len(names):
                raise StopForward

        return hook

    handles = [modules[n].register_forward_hook(make_hook(n), with_kwargs=True) for n in names]
    try:
        for h in inputs.batches():
            seen.clear()
            try:
                layer(h, **inputs.kwargs)
            except StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()


def capture_linear_inputs(
    layer: nn.Module, inputs: LayerInputs, names: list[str], on_input: Callable[[str, torch.Tensor], None]
) -> None:
    """Call ``on_input(name, x)`` with the input ``x [b, S, in]`` of each named linear, batch by batch."""
    capture_calls(layer, inputs, names, lambda name, args, kwargs, out: on_input(name, args[0]))


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, source: LayerSource, token_ids: torch.Tensor, device: torch.device, batch_size: int,
    keep: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Hidden states entering layer 0 for every calibration batch, and the kwargs of every layer.

    Layers are swapped for recorders that return their input unchanged, so this costs one embedding
    pass; ``keep`` stores each batch (on the device, or offloaded). The kwargs do not depend on the
    hidden states (masks and position embeddings are made before the first layer), so one
    single-sample forward records them for all layers; batch dimensions of 1 broadcast over any
    calibration batch.
    """
    layers = source.layers
    n = len(layers)
    per_layer_kwargs: list[dict[str, Any]] = [dict() for _ in range(n)]
    hidden: list[torch.Tensor] = []

    def recorder(i: int, record_hidden: bool, last: int):
        def forward(hidden_states, *args, **kwargs):
            if record_hidden and i == 0:
                hidden.append(hidden_states.detach())
            if per_layer_kwargs[i] is not None and not per_layer_kwargs[i]:
                per_layer_kwargs[i] = {k: v for k, v in kwargs.items() if k not in _DROP_KWARGS}
                if args:
                    raise RuntimeError(f"layer {i} got positional arguments besides hidden states; unsupported")
            if i == last:
                raise StopForward
            return hidden_states

        return forward

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    moved = move_outside_layers(model, source.prefix, device, skip=None if tied else head)
    try:
        # One sample to record every layer's kwargs.
        for i, layer in enumerate(layers):
            layer.forward = recorder(i, record_hidden=False, last=n - 1)
        try:
            model(input_ids=token_ids[:1].to(device), use_cache=False)
        except StopForward:
            pass
        # Then the hidden states entering layer 0, batch by batch.
        for i, layer in enumerate(layers):
            layer.forward = recorder(i, record_hidden=True, last=0)
        for start in range(0, token_ids.shape[0], batch_size):
            try:
                model(input_ids=token_ids[start : start + batch_size].to(device), use_cache=False)
            except StopForward:
                pass
            hidden[-1] = keep(hidden[-1])
    finally:
        for layer in layers:
            # Remove the instance attribute so the class's forward is used again.
            layer.__dict__.pop("forward", None)
        restore_outside_layers(moved)
    return hidden, per_layer_kwargs


def iter_quantizable(layer: nn.Module, skip: Callable[[str], bool]) -> dict[str, nn.Linear]:
    return {name: m for name, m in find_linears(layer).items() if not skip(name)}


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return 0


@torch.no_grad()
def install_weight(linear: nn.Linear, qw: QuantizedWeight) -> None:
    """Replace a linear's weight by the dequantized one, in its own dtype and device."""
    w = qw.dequantize(linear.weight.device).to(dtype=linear.weight.dtype)
    if w.shape != linear.weight.shape:
        raise ValueError(f"quantized weight {tuple(w.shape)} does not match {tuple(linear.weight.shape)}")
    linear.weight.data.copy_(w)


def walk(
    model: nn.Module,
    method: Method,
    *,
    device: torch.device | str,
    token_ids: torch.Tensor | None = None,
    batch_size: int = 8,
    skip: Callable[[str], bool] = lambda name: False,
    on_layer: Callable[[LayerEvent], None] | None = None,
    quantize_lm_head: bool = False,
    comm: Communicator = LOCAL,
    activations: str = "auto",
    source: LayerSource | None = None,
    overlap: bool | None = None,
) -> WalkResult:
    """Quantize every decoder layer of ``model`` with ``method``; returns the packed weights by full name.

    ``token_ids [nsamples, seqlen]`` are the calibration windows (required when the method needs
    calibration). ``skip(relative_name)`` keeps a linear in 16 bits. With ``quantize_lm_head`` the
    output projection is quantized last, as one more "layer" whose input is the final norm's output
    (tied embeddings are untied first: the input embeddings stay in 16 bits). The model is left
    holding the dequantized weights, so it computes what the checkpoint will.

    With a ``comm`` of several ranks (each holding the same model and ``token_ids``), each rank runs
    every layer on its share of whole calibration batches; the method reduces statistics and shares
    solved weights through ``comm``, so every rank ends with the same weights.

    ``activations``: where the calibration hidden states between layers live: "device", "host"
    (pinned memory, brought over batch by batch) or "auto" (see ``offload_activations``). The
    methods see them one batch at a time, so device memory does not grow with the number of
    calibration tokens beyond this set.

    ``source`` gives the decoder layers (default: the model's own, already loaded). ``overlap``: on CUDA,
    read and copy the next layer to the device, and the finished one's weights back, in a worker thread
    while the current layer is worked on (``quantkit.calibrate.pipeline``); False: all in line, in turn; None:
    on unless the environment sets ``QUANTKIT_OVERLAP=0`` (an off switch for A/B timing).
    """
    device = torch.device(device)
    source = source if source is not None else ModelLayers(*find_decoder_layers(model))
    prefix = source.prefix
    spec = arch_for(getattr(model.config, "model_type", ""))
    if spec is None:
        log.warning("no architecture record for %r: linears are quantized one by one in module order",
                    getattr(model.config, "model_type", "?"))
    hidden: list[torch.Tensor] | None = None
    offload = False
    layer_kwargs: list[dict[str, Any]] = [{} for _ in range(len(source))]
    share, total_tokens = slice(0, 0), None
    if method.needs_calibration:
        if token_ids is None:
            raise ValueError(f"{method.name} needs calibration token ids")
        share = shard_windows(token_ids.shape[0], batch_size, comm.world_size, comm.rank)
        total_tokens = token_ids.shape[0] * token_ids.shape[1]
        embed = model.get_input_embeddings().weight
        set_bytes = 2 * token_ids[share].numel() * embed.shape[1] * embed.element_size()  # inputs + outputs
        offload = offload_activations(activations, set_bytes, device)
        log.info("calibration activations (%.2f GiB in and out) kept in %s memory", set_bytes / 2**30,
                 "host" if offload else device.type)
        keep = offload_to_host if offload else (lambda t: t)
        # a streaming source reads the input embedding for this and releases it after
        with getattr(source, "input_embeddings", contextlib.nullcontext)():
            hidden, layer_kwargs = capture_layer_inputs(model, source, token_ids[share], device, batch_size, keep)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    weights: dict[str, QuantizedWeight] = {}
    layer_stats: list[dict[str, Any]] = []
    start = time.perf_counter()
    if overlap is None:
        overlap = os.environ.get("QUANTKIT_OVERLAP", "1") != "0"
    with LayerPipeline(source, device, enabled=overlap) as pipe:
        for i in range(len(source)):
            clock = PhaseClock(device)
            layer, resident = pipe.take(i)
            home = torch.device("cpu") if resident is not None else next(layer.parameters()).device
            pipe.start(i + 1)  # the next layer's read and copy run while this one is worked on
            clock.lap("move_in")
            linears = iter_quantizable(layer, lambda n: skip(n) or (spec is not None and n in spec.keep_16bit))
            inputs = None if hidden is None else LayerInputs(hidden, layer_kwargs[i], share.start, total_tokens,
                                                             device, offload)
            ctx = LayerContext(
                index=i, n_layers=len(source), prefix=f"{prefix}.{i}", layer=layer, linears=linears,
                groups=sequential_groups(spec, linears), spec=spec, inputs=inputs, device=device, comm=comm,
                releasable=getattr(source, "releases_layers", False),
            )
            result = method.quantize_layer(ctx)
            clock.lap("method")
            layer_weights = {}
            for name, qw in result.weights.items():
                if name not in result.installed:
                    install_weight(linears[name], qw)
                layer_weights[f"{ctx.prefix}.{name}"] = qw
            clock.lap("install")
            if inputs is not None:
                if result.next_hidden is None:
                    hidden = propagate(layer, inputs, ctx.prefix)
                else:
                    hidden = result.next_hidden
                    check_finite([torch.isfinite(h).all() for h in hidden], ctx.prefix)
            clock.lap("propagate")
            pipe.finish(i, layer_weights, layer, resident, home)  # in the worker: layer and weights to the host
            clock.lap("move_out")
            seconds = clock.total()
            clock.phases.update({f"method.{k}": v for k, v in result.phases.items()})
            layer_stats.append({"layer": i, "prefix": ctx.prefix, "seconds": seconds, "linears": result.stats,
                                "notes": result.notes, "phases": clock.phases})
            if on_layer is not None:
                on_layer(LayerEvent(i, len(source), ctx.prefix, seconds, time.perf_counter() - start,
                                    _peak_memory(device), result, clock.phases))
        weights.update(pipe.results())
    if quantize_lm_head:
        inputs = None if hidden is None else LayerInputs(hidden, {}, share.start, total_tokens, device, offload)
        with getattr(source, "output_head", contextlib.nullcontext)():  # a streaming source reads it now
            name, qw, stats = quantize_output_head(model, method, inputs, device, comm)
        weights[name] = qw
        layer_stats.append({"layer": len(source), "prefix": name, "seconds": stats.pop("_seconds"),
                            "linears": {name: stats}, "notes": []})
    return WalkResult(weights=weights, layer_stats=layer_stats, seconds=time.perf_counter() - start)


class _OutputHead(nn.Module):
    """The final norm and the output projection, walked like one more decoder layer."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_states))


def quantize_output_head(
    model: nn.Module, method: Method, inputs: LayerInputs | None, device: torch.device, comm: Communicator = LOCAL
) -> tuple[str, QuantizedWeight, dict[str, float]]:
    """Quantize ``lm_head`` with ``method``; ``inputs`` hold the last decoder layer's outputs."""
    from quantkit.config import QuantkitError

    t0 = time.perf_counter()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if not isinstance(head, nn.Linear) or norm is None:
        raise QuantkitError(f"--quantize-lm-head is not supported for {type(model).__name__}: no final norm "
                            "and linear output projection found")
    name = next(n for n, m in model.named_modules() if m is head)
    embeddings = model.get_input_embeddings()
    if embeddings is not None and embeddings.weight.data_ptr() == head.weight.data_ptr():
        head.weight = nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        log.info("untied %s from the input embeddings to quantize it", name)
    block = _OutputHead(norm, head)
    home = head.weight.device
    block.to(device)
    ctx = LayerContext(index=-1, n_layers=1, prefix="", layer=block, linears={"lm_head": head},
                       groups=[["lm_head"]], spec=None, inputs=inputs, device=device, comm=comm)
    result = method.quantize_layer(ctx)
    qw = result.weights["lm_head"]
    install_weight(head, qw)
    qw = weight_to_host(qw)  # a method may pack on the device
    block.to(home)
    stats = dict(result.stats.get("lm_head", {}))
    stats["_seconds"] = time.perf_counter() - t0
    return name, qw, stats
