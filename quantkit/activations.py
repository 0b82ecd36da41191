"""Where calibration activations live, and timing a layer's steps.

The hidden states between decoder layers (for an 8B model at 128 x 2048 tokens: 2 GiB in bf16, in
and out) stay on the work device when they fit and go to pinned host memory when they do not;
everything else a method holds is per calibration batch, so device memory does not grow with the
number of calibration tokens.
"""

from __future__ import annotations

import time

import torch

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
    """Seconds of each step of one layer's work, the device's queued work included (so GPU timings mean
    something): ``lap(name)`` closes a step. For the progress events and the benchmark's breakdown."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, float] = {}
        self.start = self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.phases[name] = now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start
