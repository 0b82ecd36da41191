"""Where calibration activations and finished layers live, and timing a layer's steps.

The hidden states between decoder layers (for an 8B model at 128 x 2048 tokens: 2 GiB in bf16, in
and out) stay on the work device when they fit and go to pinned host memory when they do not;
everything else a method holds is per calibration batch, so device memory does not grow with the
number of calibration tokens.
"""

from __future__ import annotations

import time

import torch
from torch import nn

ACTIVATIONS = ("auto", "device", "host")


def offload_to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``; pinned when ``t`` is on CUDA, so the way back is an asynchronous copy."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return host.copy_(t, non_blocking=True)


def offload_activations(policy: str, n_bytes: int, device: torch.device) -> bool:
    """Whether the calibration activations go to host memory: ``policy`` "host" / "device" says so;
    "auto" keeps them on an accelerator when the layer inputs and outputs together (``n_bytes``)
    take at most a quarter of its memory (the rest is for the layer, its Hessians and the forward's
    intermediates, which do not grow with the number of calibration tokens), else offloads."""
    if policy not in ACTIVATIONS:
        from quantkit.config import QuantkitError

        raise QuantkitError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {policy!r}")
    if device.type == "cpu":
        return False  # host memory already
    if policy != "auto":
        return policy == "host"
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return not total or n_bytes > total // 4


class PhaseClock:
    """Seconds of each step of one layer's work, the compute stream's queued work included (so GPU timings
    mean something): ``lap(name)`` closes a step. For the progress events and the benchmark's breakdown.

    Only the current stream is waited for, not the whole device: the walker's worker copies layers on a side
    stream while a step computes (``quantkit.calibrate.pipeline``), and a device-wide wait at every lap made the
    step that overlapped them wait for the copies too (the AWQ capture: 0.26 -> 0.44 s a layer on the H200,
    session 17); the copies' real cost shows where the compute waits for them (``move_in``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, float] = {}
        self.start = self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.phases[name] = now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def host_tensors(layer: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and buffer of ``layer`` with the host tensor that holds it now (to copy back into)."""
    return [(m, key, t.data) for m in layer.modules() for key, t in (*m._parameters.items(), *m._buffers.items())
            if t is not None]


@torch.no_grad()
def copy_home(layer: nn.Module, resident: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Bring ``layer`` back to host memory into the tensors it came from (``host_tensors``).

    ``layer.to("cpu")`` allocates fresh host memory for every tensor: on the H200 machine that way
    back took 0.26-0.40 s per layer of an 8B model (1.1-1.7 GB/s, growing over the walk, while the way
    in from resident memory took 0.07 s), and fresh pages there are slow (its memory grows as it is
    used). Copying into the resident tensors allocates nothing. A tensor whose shape or dtype changed
    on the way goes the plain way."""
    for module, key, host in resident:
        param = module._parameters.get(key)
        now = param.data if param is not None else module._buffers[key]
        if now.data_ptr() == host.data_ptr():
            continue
        target = host.copy_(now) if (now.shape, now.dtype) == (host.shape, host.dtype) else now.to(host.device)
        if param is not None:
            param.data = target
        else:
            module._buffers[key] = target


def move_outside_layers(model: nn.Module, layers_prefix: str, device: torch.device,
                         skip: nn.Module | None = None) -> list[tuple[dict, str, torch.Tensor]]:
    """Move every parameter and buffer that is not inside a decoder layer (embeddings, rotary, norm) nor in
    ``skip`` (the output head, which the capture never runs) to ``device``. Returns what each one held before
    (``restore_outside_layers`` puts those tensors back: nothing is copied on the way back)."""
    inside = layers_prefix + "."
    skipped = {id(m) for m in skip.modules()} if skip is not None else set()
    moved: list[tuple[dict, str, torch.Tensor]] = []
    for module_name, module in model.named_modules():
        if module_name == layers_prefix or module_name.startswith(inside) or id(module) in skipped:
            continue
        for key, param in module._parameters.items():
            # Meta parameters (an output head a streaming source has not read) stay where they are.
            if param is not None and param.device != device and not param.is_meta:
                moved.append((module._parameters, key, param.data))
                param.data = param.data.to(device)
        for key, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                moved.append((module._buffers, key, buf))
                module._buffers[key] = buf.to(device)
    return moved


def restore_outside_layers(moved: list[tuple[dict, str, torch.Tensor]]) -> None:
    """Undo ``move_outside_layers``: every tensor back to the one it held (the capture changes none of them;
    copying 2 GB of embeddings back into fresh host pages took ~1.5 s of an 8B model's input capture)."""
    for table, key, old in moved:
        if isinstance(table.get(key), nn.Parameter):
            table[key].data = old
        else:
            table[key] = old
