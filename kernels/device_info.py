"""Facts about the device a kernel is launched on, shared by the kernel launchers."""

from __future__ import annotations

import functools
import os

import torch


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of ``device`` (sizes persistent and split-K grids); 4 off CUDA, for small
    interpreted grids."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    # a fixed property of the card, asked on every launch: looked up once per device
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device: torch.device | str) -> tuple[int, int]:
    """Compute capability (major, minor) of the CUDA ``device``, cached per device: launchers ask on every call and
    ``torch.cuda.get_device_capability`` costs host time (bench/archive/NOTES_attention.md)."""
    device = torch.device(device)
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gpu_arch(device: torch.device | str) -> str | None:
    """The architecture name the kernel selections read (``"sm90"`` for a Hopper GPU), None off CUDA."""
    device = torch.device(device)
    return "sm{}{}".format(*capability(device)) if device.type == "cuda" else None


def gpu_card(device: torch.device | str) -> str | None:
    """The GPU's name (``"NVIDIA H100 80GB HBM3"``), which the W4A16 table's card-specific entries match; None off
    CUDA. Cached per device, like the capability."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def programmatic_launch(device: torch.device | str) -> bool:
    """Whether small kernels on ``device`` use programmatic dependent launch (PDL): Hopper or newer, not the
    interpreter, ``QUANTKIT_PDL`` not 0 (off switch for A/B timing). They call ``griddepcontrol.launch_dependents``
    and ``griddepcontrol.wait`` before touching memory, so the next kernel's launch and prefetch overlap them."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or os.environ.get("QUANTKIT_PDL", "1") == "0":
        return False
    return capability(device)[0] >= 9


def pdl_launch(pdl: bool) -> dict:
    """The launch option of a kernel built with PDL (``launch_pdl=True``), as keyword arguments; none otherwise
    (the interpreter takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


def ab_switch(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name`` (an A/B switch of the benches) among ``choices``, the first when unset;
    anything else is refused, naming the variable and its choices."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def counts_switch(name: str, fields: str, powers_of_two: bool = False) -> tuple[int, ...] | None:
    """The environment variable ``name`` as comma-separated positive integers, one a field of ``fields`` (e.g.
    "BLOCK_N,WARPS,PROGRAMS": a launch config an A/B switch puts on every call), or None when unset; anything
    else is refused, naming the variable and its form."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    parts = [p.strip() for p in raw.split(",")]
    want = len(fields.split(","))
    ok = len(parts) == want and all(p.isdigit() and int(p) > 0 for p in parts)
    if ok and powers_of_two:
        ok = all(int(p) & (int(p) - 1) == 0 for p in parts)
    if not ok:
        kind = "powers of two" if powers_of_two else "positive integers"
        raise ValueError(f"{name} must be {fields} ({want} {kind}), got {raw!r}")
    return tuple(int(p) for p in parts)


def moe_programmatic_launch(device: torch.device | str) -> bool:
    """PDL for the MoE decode kernels (the fused router, the expert GEMVs and their sum: kernels/moe_router.py,
    kernels/moe_gemv.py), where :func:`programmatic_launch` allows it and ``QUANTKIT_MOE_PDL`` is not 0 (the A/B
    switch). Each of those kernels waits for the previous one before its first load (no prefetch: what they read
    next depends on the routing), so what it saves is each launch's latency and ramp, four times a layer: the
    30B-A3B shape's int4 step at batch 1 ran 336.7 tok/s with it against 321.4 without, batch 8 1,193 against
    1,208-1,220 in two runs without, a tie (H100, one machine, bench/results/bench_qwen3-30b-a3b_h100_pdl.json and
    ..._nopdl_717ce35.json)."""
    return ab_switch("QUANTKIT_MOE_PDL", ("1", "0")) == "1" and programmatic_launch(device)
