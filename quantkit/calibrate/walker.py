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
from typing import Any

import torch
from torch import nn

from quantkit.arch import arch_for, find_decoder_layers, find_linears, sequential_groups
from quantkit.calibrate.activations import PhaseClock, offload_activations, offload_to_host
from quantkit.calibrate.capture import (
    capture_calls,
    capture_layer_inputs,
    capture_linear_inputs,
    check_finite,
    first_output,
    propagate,
    run_layer,
)
from quantkit.calibrate.pipeline import LayerPipeline, weight_to_host
from quantkit.calibrate.records import (
    LayerContext,
    LayerEvent,
    LayerInputs,
    LayerResult,
    LayerSource,
    Method,
    ModelLayers,
    StopForward,
    WalkResult,
)
from quantkit.distributed.comm import LOCAL, Communicator
from quantkit.distributed.plan import shard_windows
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)

# The records and capture helpers live in ``records`` and ``capture``; their names stay importable from here.
__all__ = [
    "LayerContext", "LayerEvent", "LayerInputs", "LayerResult", "LayerSource", "Method", "ModelLayers",
    "StopForward", "WalkResult", "capture_calls", "capture_layer_inputs", "capture_linear_inputs", "check_finite",
    "find_decoder_layers", "first_output", "install_weight", "iter_quantizable", "propagate",
    "quantize_output_head", "run_layer", "walk",
]


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
    # said before the first layer (which may run for minutes on a host): a log's heartbeat then names this
    # step instead of the calibration that came before it
    log.info("layers: %d decoder layers to quantize on %s", len(source), device.type)
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
