"""The records the walker and the methods exchange: a layer's calibration inputs, what a method sees of one
layer (``LayerContext``) and returns for it (``LayerResult``), the method interface, progress events, and where
decoder layers come from (``LayerSource``). The walk itself is ``quantkit.calibrate.walker``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from quantkit.arch import ArchSpec
from quantkit.calibrate.activations import offload_to_host
from quantkit.distributed.comm import LOCAL, Communicator
from quantkit.qtensor import QuantizedWeight


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
