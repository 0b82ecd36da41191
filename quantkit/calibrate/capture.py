"""Running one decoder layer on its calibration batches: the inputs entering layer 0 and every layer's keyword
arguments (``capture_layer_inputs``), the calls of named sub-modules inside a layer (``capture_calls``,
``capture_linear_inputs``), and the layer's outputs, which become the next layer's inputs (``run_layer``,
``propagate``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantkit.calibrate.activations import move_outside_layers, restore_outside_layers
from quantkit.calibrate.records import LayerInputs, LayerSource, StopForward

# Keyword arguments that belong to generation, not to a calibration forward.
_DROP_KWARGS = ("past_key_value", "past_key_values", "cache", "use_cache", "output_attentions")


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
    inputs_only: bool = False,
) -> None:
    """Run ``layer`` on every batch and call ``on_call(name, args, kwargs, output)`` for each call of the
    named sub-modules. With ``stop_early`` each batch's forward ends once all of them have run, so
    capturing the inputs of the attention projections costs no MLP work. ``inputs_only``: the calls are
    seen before the modules run (``output`` None), so the forward stops before the last named module
    runs: capturing the MLP's gate/up inputs does not compute gate/up (half the MLP's work).
    """
    modules = dict(layer.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"no sub-modules {missing} in {type(layer).__name__}")
    seen: set[str] = set()

    def seen_call(name: str, args, kwargs, output) -> None:
        on_call(name, args, kwargs, output)
        seen.add(name)
        if stop_early and len(seen) == len(names):
            raise StopForward

    if inputs_only:
        handles = [modules[n].register_forward_pre_hook(
            lambda module, args, kwargs, name=n: seen_call(name, args, kwargs, None), with_kwargs=True)
            for n in names]
    else:
        handles = [modules[n].register_forward_hook(
            lambda module, args, kwargs, output, name=n: seen_call(name, args, kwargs, output), with_kwargs=True)
            for n in names]
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
    capture_calls(layer, inputs, names, lambda name, args, kwargs, out: on_input(name, args[0]), inputs_only=True)


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
