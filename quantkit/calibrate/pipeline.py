"""The walker's host <-> accelerator traffic, overlapped with the work on the current layer.

On one H200 an 8B layer took 0.08 s to come over from host memory (0.44 GB of pageable memory at ~5.5 GB/s)
and its packed weights about as long to go back into fresh host pages, both on the critical path of every
layer (bench/archive/NOTES_gptq.md, session 16). ``LayerPipeline`` runs both in one worker thread, on a CUDA stream of
its own, while the main thread computes:

* ``start(i + 1)`` as soon as layer ``i`` is on the device: the worker reads layer ``i + 1`` from its
  source (from disk for a streamed model) and queues its copy to the device; ``take(i + 1)`` then only
  makes the compute stream wait for that copy and points the parameters at the device tensors.
* ``finish(i, weights)`` hands layer ``i``'s packed weights (on the device or the host) to the worker, which
  brings them to the host and calls the source's ``finish``; ``results()`` waits for all of them, in order.

The worker is the only thread that calls the source once the pipeline runs, so a streaming source sees the
same sequence of calls as without it (``layer(0)``, ``layer(1)``, ``finish(0)``, ``layer(2)``, ...). Every
copy on the side stream first waits for the compute stream's work queued before it was asked for, and a
tensor made there is marked as used by the compute stream (``record_stream``) before the compute stream
sees it, so the caching allocator reuses no memory too early. Off CUDA (or with ``enabled=False``) every
call runs inline, in the same order.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from quantkit.calibrate.activations import copy_home, host_tensors
from quantkit.qtensor import QuantizedWeight


def weight_to_host(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with every tensor in host memory (itself when they already are)."""
    if not isinstance(qw, QuantizedWeight):  # a record that moves itself (quantkit.methods.fp8.FP8Weight)
        return qw.to("cpu")
    tensors = {f: getattr(qw, f) for f in ("qweight", "qzeros", "scales", "g_idx", "bias")}
    if all(t is None or t.device.type == "cpu" for t in tensors.values()):
        return qw
    return dataclasses.replace(qw, **{f: None if t is None else t.to("cpu") for f, t in tensors.items()})


@dataclasses.dataclass
class _Loaded:
    layer: nn.Module
    resident: list | None  # host tensors to copy the layer back into (activations.copy_home), or None
    copies: list[tuple[nn.Module, str, torch.Tensor]]  # (module, key, device tensor) still to install
    done: Any  # CUDA event after the copies, or None


class LayerPipeline:
    """Layer reads and device copies one layer ahead, packed weights to the host one layer behind (see the
    module docstring). Use as a context manager: leaving it waits for the worker."""

    def __init__(self, source, device: torch.device, enabled: bool = True, threaded: bool | None = None) -> None:
        self.source = source
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # ``threaded`` (default: on CUDA) lets a test run the worker on the CPU, where nothing is copied
        self.enabled = enabled and (cuda if threaded is None else threaded)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quantkit-layers") if self.enabled else None
        self._stream = torch.cuda.Stream(self.device) if self.enabled and cuda else None
        self._ahead: dict[int, Future] = {}
        self._behind: list[Future] = []

    def __enter__(self) -> LayerPipeline:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _marker(self):
        """An event after the compute stream's work queued so far (None off CUDA)."""
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start(self, index: int) -> None:
        """Begin reading layer ``index`` and copying it to the device (nothing past the last layer)."""
        if self.enabled and index < len(self.source) and index not in self._ahead:
            self._ahead[index] = self._pool.submit(self._load, index, self._marker())

    def _load(self, index: int, after) -> _Loaded:
        layer = self.source.layer(index)
        home = next(layer.parameters()).device
        resident = host_tensors(layer) if home.type == "cpu" else None
        if self._stream is None:
            layer.to(self.device)
            return _Loaded(layer, resident if self.device.type != "cpu" else None, [], None)
        copies = []
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(after)  # the memory handed out below may still be read by queued work
            for module, key, t in host_tensors(layer):
                if t.device != self.device:
                    copies.append((module, key, t.to(self.device, non_blocking=True)))
            done = torch.cuda.Event()
            done.record(self._stream)
        return _Loaded(layer, resident, copies, done)

    def take(self, index: int) -> tuple[nn.Module, list | None]:
        """Layer ``index`` on the device, and its resident host tensors (None: it was not in host memory)."""
        if index not in self._ahead:
            layer = self.source.layer(index) if not self.enabled else self._pool.submit(
                self.source.layer, index).result()
            home = next(layer.parameters()).device
            resident = host_tensors(layer) if home.type == "cpu" and self.device.type != "cpu" else None
            layer.to(self.device)
            return layer, resident
        loaded = self._ahead.pop(index).result()
        if loaded.done is None:
            return loaded.layer, loaded.resident
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(loaded.done)
        for module, key, t in loaded.copies:
            t.record_stream(compute)
            if key in module._parameters:
                module._parameters[key].data = t
            else:
                module._buffers[key] = t
        return loaded.layer, loaded.resident

    def finish(self, index: int, weights: dict[str, QuantizedWeight], layer: nn.Module, resident: list | None,
               home: torch.device) -> None:
        """Layer ``index`` back to the host (into ``resident``, else to ``home``), ``weights`` to the host, and
        both to the source's ``finish``: in the worker when enabled, after the work queued so far."""
        if not self.enabled:
            self._behind.append(_done(self._finish(index, weights, layer, resident, home, None)))
            return
        self._behind.append(self._pool.submit(self._finish, index, weights, layer, resident, home, self._marker()))

    def _finish(self, index: int, weights: dict[str, QuantizedWeight], layer: nn.Module, resident: list | None,
                home: torch.device, after) -> dict[str, QuantizedWeight]:
        if self._stream is None:
            _move_home(layer, resident, home)
            weights = {name: weight_to_host(qw) for name, qw in weights.items()}
        else:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(after)  # the layer's and the weights' last kernels are done first
                _move_home(layer, resident, home)
                weights = {name: weight_to_host(qw) for name, qw in weights.items()}
        return self.source.finish(index, weights)

    def results(self) -> dict[str, QuantizedWeight]:
        """Every finished layer's weights as the source returned them, in layer order."""
        out: dict[str, QuantizedWeight] = {}
        for fut in self._behind:
            out.update(fut.result())
        self._behind.clear()
        return out


def _move_home(layer: nn.Module, resident: list | None, home: torch.device) -> None:
    if resident is None:
        layer.to(home)
    else:
        copy_home(layer, resident)


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
