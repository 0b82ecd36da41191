"""Facts about the device a kernel is launched on, shared by the kernel launchers."""

from __future__ import annotations

import functools
import os

import torch


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of ``device``, which size persistent and split-K grids.

    Off CUDA (Triton's interpreter) 4, so that interpreted grids stay small."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    # a fixed property of the card, asked on every launch: looked up once per device
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device: torch.device | str) -> tuple[int, int]:
    """Compute capability (major, minor) of the CUDA ``device``; every launcher asks it on every call, and
    ``torch.cuda.get_device_capability`` cost ~14 us of host time a query under cProfile (a device-properties
    lookup; bench/NOTES_attention.md), so it is looked up once per device."""
    device = torch.device(device)
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gpu_arch(device: torch.device | str) -> str | None:
    """The architecture name the kernel selections read (``"sm90"`` for a Hopper GPU), None off CUDA."""
    device = torch.device(device)
    return "sm{}{}".format(*capability(device)) if device.type == "cuda" else None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def programmatic_launch(device: torch.device | str) -> bool:
    """Whether small kernels on ``device`` launch with programmatic dependent launch (PDL): a Hopper or newer
    GPU, not the interpreter, and ``QUANTKIT_PDL`` not set to 0 (an off switch for A/B timing). Such kernels
    call ``griddepcontrol.launch_dependents`` and ``griddepcontrol.wait`` before touching memory, so the next
    kernel's launch and its weight prefetch overlap them."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or os.environ.get("QUANTKIT_PDL", "1") == "0":
        return False
    return capability(device)[0] >= 9
