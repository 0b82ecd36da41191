"""How many KV-cache slots a memory budget holds (the server sizes its cache from memory, not slot counts).

One slot holds ``max_seq_len`` tokens of keys and values for every layer:
``2 * layers * max_seq_len * kv_heads * head_dim * bytes(dtype)``. The engine allocates its batch plus one
scratch slot (padding rows of a decode step), so a budget of ``B`` bytes serves
``min(max_batch, B // slot_bytes - 1)`` sequences at once. The budget is a number of bytes
(``--kv-cache-memory 4GiB``), a fraction of the device memory free once the weights are loaded
(``--kv-cache-fraction 0.8``, CUDA only), or by default: 1 GiB on the CPU, 0.8 of the free memory on CUDA
(a default too small for one sequence is raised to one; an explicit budget that small is an error).
The cache is held in the model's dtype (16-bit whenever the model runs in 16-bit, on the CPU too), or with
``kv_dtype="fp8"`` as e4m3 codes and a float32 scale a token and KV head (1 + 4 / head_dim bytes a value).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.config import QuantkitError

CPU_DEFAULT_BYTES = 1 << 30
CUDA_DEFAULT_FRACTION = 0.8
KV_DTYPES = ("auto", "fp8")  # the model's dtype, or e4m3 codes with a scale a token and KV head
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_memory(text: str | int) -> int:
    """Bytes from ``"4GiB"``, ``"512MiB"``, ``"2GB"``, ``"1.5g"`` or a plain number of bytes."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
        unit = match and match.group(2).lower()
        if not match or unit not in _UNITS:
            raise QuantkitError(f"--kv-cache-memory: cannot read {text!r} as a size; write e.g. 4GiB, 512MiB or "
                                "a number of bytes")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise QuantkitError(f"--kv-cache-memory must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class KVPlan:
    """The cache the engine will allocate, and why."""

    slots: int  # sequences served at once (the engine's max_batch)
    max_seq_len: int
    slot_bytes: int
    budget_bytes: int
    budget_source: str  # how the budget was chosen, for the start-up line
    dtype_name: str

    @property
    def total_bytes(self) -> int:
        return (self.slots + 1) * self.slot_bytes  # + the scratch slot

    def describe(self) -> str:
        gib = 1 << 30
        return (f"KV cache: {self.slots} slots x {self.max_seq_len} tokens in {self.dtype_name}, "
                f"{self.total_bytes / gib:.2f} GiB ({self.slot_bytes / (1 << 20):.1f} MiB a slot; budget "
                f"{self.budget_bytes / gib:.2f} GiB, {self.budget_source})")


def check_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` if it is one of KV_DTYPES, else the error that names the option and its choices."""
    if kv_dtype not in KV_DTYPES:
        raise QuantkitError(f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return kv_dtype


def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int, element_size: int,
               scale_size: int = 0) -> int:
    """Bytes of one slot: keys and values of ``element_size`` bytes, and ``scale_size`` bytes a token and KV head
    for each (an FP8 cache's scales)."""
    return 2 * num_layers * max_seq_len * num_kv_heads * (head_dim * element_size + scale_size)


def plan(spec, max_seq_len: int, dtype, device, *, max_batch: int, memory: int | str | None = None,
         fraction: float | None = None, free_bytes: int | None = None, kv_dtype: str = "auto") -> KVPlan:
    """The slots a budget holds, at most ``max_batch``. ``free_bytes``: the device's free memory (CUDA; read
    from the device when None). ``kv_dtype``: one of KV_DTYPES."""
    import torch

    check_kv_dtype(kv_dtype)
    if memory is not None and fraction is not None:
        raise QuantkitError("give --kv-cache-memory or --kv-cache-fraction, not both")
    on_cuda = torch.device(device).type == "cuda"
    if fraction is not None and not 0 < fraction <= 1:
        raise QuantkitError(f"--kv-cache-fraction must be in (0, 1], got {fraction}")
    if fraction is not None and not on_cuda:
        raise QuantkitError("--kv-cache-fraction is for CUDA devices; on the CPU give --kv-cache-memory (e.g. 2GiB)")
    if memory is not None:
        budget, source = parse_memory(memory), "--kv-cache-memory"
    elif on_cuda:
        fraction = CUDA_DEFAULT_FRACTION if fraction is None else fraction
        free = torch.cuda.mem_get_info(torch.device(device))[0] if free_bytes is None else free_bytes
        budget, source = int(free * fraction), f"{fraction:g} of {free / (1 << 30):.1f} GiB free"
    else:
        budget, source = CPU_DEFAULT_BYTES, "the CPU default"
    fp8 = kv_dtype == "fp8"
    size = 1 if fp8 else torch.empty((), dtype=dtype).element_size()
    per_slot = slot_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, max_seq_len, size, 4 if fp8 else 0)
    fit = budget // per_slot - 1
    if fit < 1 and memory is None and fraction is None:  # the default never refuses: one sequence at least
        fit, source = 1, source + ", raised to one sequence"
    if fit < 1:
        raise QuantkitError(
            f"a KV-cache budget of {budget / (1 << 20):.0f} MiB ({source}) holds no sequence of {max_seq_len} "
            f"tokens: one needs {2 * per_slot / (1 << 20):.0f} MiB with its scratch slot; raise --kv-cache-memory "
            "or lower --max-seq-len")
    name = "fp8 (e4m3, a scale a token and head)" if fp8 else str(dtype).removeprefix("torch.")
    return KVPlan(min(max_batch, fit), max_seq_len, per_slot, budget, source, name)
