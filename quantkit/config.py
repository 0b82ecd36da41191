"""Frozen configuration records shared by every method. The CLI only maps options onto these."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from quantkit.errors import QuantkitError  # defined apart so the CLI catches it without torch
from quantkit.pack import SUPPORTED_BITS

# Group sizes the fast kernels (ours, vLLM's, transformers') serve; others are valid in the format.
KERNEL_GROUP_SIZES = (-1, 32, 64, 128)
DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass(frozen=True)
class QuantScheme:
    """How weights are quantized: bit width, group size along the input dimension, symmetry."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise QuantkitError(
                f"--bits {self.bits} is not supported; the GPTQ layout holds {', '.join(map(str, SUPPORTED_BITS))}"
            )
        if self.group_size != -1 and (self.group_size < 16 or self.group_size % 16):
            raise QuantkitError(
                f"--group-size {self.group_size} cannot be stored: use -1 (per output channel) or a positive "
                "multiple of 16 (32, 64 and 128 are the ones inference kernels serve)"
            )
        if self.group_size not in KERNEL_GROUP_SIZES:
            warnings.warn(
                f"group size {self.group_size} is valid in the checkpoint, but vLLM/transformers kernels only "
                f"serve {KERNEL_GROUP_SIZES}",
                stacklevel=2,
            )

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1


@dataclass(frozen=True)
class CalibConfig:
    """Calibration data: a named source or a local file, ``nsamples`` windows of ``seqlen`` tokens."""

    source: str = "self"
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    text_field: str = "text"

    def __post_init__(self) -> None:
        if self.nsamples < 1:
            raise QuantkitError(f"--nsamples must be at least 1, got {self.nsamples}")
        if self.seqlen < 8:
            raise QuantkitError(f"--seqlen must be at least 8 tokens, got {self.seqlen}")


@dataclass(frozen=True)
class LoadConfig:
    """How a model is loaded: data type, device for the layer being worked on, remote code."""

    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    # Read a safetensors folder one decoder layer at a time (quantkit.models.lazy): auto, on or off.
    stream: str = "auto"

    def __post_init__(self) -> None:
        dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype not in DTYPES:
            raise QuantkitError(f"--dtype must be one of {', '.join(DTYPES)} (or fp32/bf16/fp16), got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.stream not in ("auto", "on", "off"):
            raise QuantkitError(f"--stream must be auto, on or off, got {self.stream!r}")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; an explicit CUDA device must exist."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantkitError(f"--device {device} was asked for, but CUDA is not available here; use --device cpu")
    return device


def resolve_dtype(dtype: str, device: str):
    """The torch dtype for ``dtype`` (``auto``: bfloat16 on CUDA, float32 on the CPU)."""
    import torch

    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)
