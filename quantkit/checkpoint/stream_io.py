"""Tensor bytes between safetensors files and host memory, without memory maps and in bounded chunks.

A streamed model (:mod:`quantkit.models.lazy`) reads each decoder layer with plain file reads into buffers the
process owns, converting to the working dtype a chunk at a time: no page of a source file is ever mapped into
the process, so nothing of the files counts toward its resident size once a read returns (safetensors'
``safe_open`` maps the whole file, and every page a tensor view touched stays resident until the last view
of it is gone). The page cache keeps what was read, as for any file read; the kernel reclaims it when memory
is short, and it is not the process's memory.

Tensors that are not quantized and not needed for the work (the input embedding once the calibration inputs
are captured, an output head that is not quantized) are never held at all: :class:`FileTensor` names their
bytes in the source file and :func:`write_shard` copies them into the output shard in chunks, converted to
the checkpoint's dtype on the way when it differs from the stored one.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.checkpoint.read import SAFETENSORS_DTYPES, TensorRecord
from quantkit.config import QuantkitError

CHUNK_BYTES = 16 * 2**20  # one read or write of a streamed copy
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class FileTensor:
    """One tensor's bytes in a safetensors file: absolute byte offsets ``[start, stop)``, stored dtype, shape."""

    file: Path
    start: int
    stop: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return (self.stop - self.start) // self.dtype.itemsize


def file_tensors(records: dict[str, TensorRecord]) -> dict[str, FileTensor]:
    """Every record's byte range, from its file's header (each header read once)."""
    out: dict[str, FileTensor] = {}
    for file in dict.fromkeys(r.file for r in records.values()):
        for key, (start, stop) in _data_offsets(file).items():
            if key in records:
                rec = records[key]
                out[key] = FileTensor(file, start, stop, rec.dtype, tuple(rec.shape))
    missing = [k for k in records if k not in out]
    if missing:
        raise QuantkitError(f"the safetensors headers do not place {missing[:3]}")
    return out


def _data_offsets(file: Path) -> dict[str, tuple[int, int]]:
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    base = 8 + header_len
    header.pop("__metadata__", None)
    return {key: (base + int(e["data_offsets"][0]), base + int(e["data_offsets"][1])) for key, e in header.items()}


def read_tensor(ft: FileTensor, dtype: torch.dtype | None = None, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """The tensor as a CPU tensor the process owns, in ``dtype`` (None: as stored), read with plain file reads.

    A conversion goes ``chunk_bytes`` of the file at a time through one scratch buffer, so reading a bf16
    tensor into float32 holds the float32 result and one chunk, never a whole bf16 copy besides."""
    dtype = dtype or ft.dtype
    out = torch.empty(ft.numel, dtype=dtype)
    with open(ft.file, "rb", buffering=0) as handle:
        handle.seek(ft.start)
        if dtype == ft.dtype:
            _read_exact(handle, out.view(torch.uint8).numpy(), ft)
        else:
            item = ft.dtype.itemsize
            step = max(item, chunk_bytes - chunk_bytes % item)
            scratch = torch.empty(step, dtype=torch.uint8)
            done = 0
            for offset in range(0, ft.stop - ft.start, step):
                n = min(step, ft.stop - ft.start - offset)
                _read_exact(handle, scratch[:n].numpy(), ft)
                part = scratch[:n].view(ft.dtype)
                out[done : done + part.numel()].copy_(part)
                done += part.numel()
    return out.view(ft.shape)


def read_rows(ft: FileTensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (sorted ints) of the 2-D tensor ``ft``, as stored: ``[len(index), cols]``, one read per
    row (an embedding lookup of the calibration ids, without the table)."""
    cols = ft.shape[1]
    row_bytes = cols * ft.dtype.itemsize
    out = torch.empty(len(index), row_bytes, dtype=torch.uint8)
    with open(ft.file, "rb", buffering=0) as handle:
        for i, r in enumerate(index.tolist()):
            if not 0 <= r < ft.shape[0]:
                raise IndexError(f"row {r} of a table of {ft.shape[0]} rows")
            handle.seek(ft.start + r * row_bytes)
            _read_exact(handle, out[i].numpy(), ft)
    return out.view(ft.dtype).view(len(index), cols)


def _read_exact(handle, buffer, ft: FileTensor) -> None:
    view = memoryview(buffer).cast("B")
    got = 0
    while got < len(view):
        n = handle.readinto(view[got:])
        if not n:
            raise QuantkitError(f"{ft.file} ended early while reading a tensor (truncated file?)")
        got += n


def write_shard(path: Path, items: list[tuple[str, torch.Tensor | FileTensor, torch.dtype]],
                metadata: dict[str, str], chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write a safetensors file of ``(key, tensor or FileTensor, dtype to store)``, in that order.

    In-memory tensors are cast and written one at a time; file tensors are copied ``chunk_bytes`` at a time
    (cast chunk by chunk when the stored dtype differs), so the shard is never held whole."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, src, dtype in items:
        if dtype not in _DTYPE_NAMES:
            raise QuantkitError(f"{key}: dtype {dtype} cannot be stored in safetensors")
        numel = src.numel if isinstance(src, FileTensor) else src.numel()
        nbytes = numel * dtype.itemsize
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(src.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for _key, src, dtype in items:
            if isinstance(src, FileTensor):
                _copy_file_tensor(out, src, dtype, chunk_bytes)
            else:
                t = src.detach().to("cpu", dtype).contiguous().reshape(-1)
                out.write(memoryview(t.view(torch.uint8).numpy()))
                del t


def _copy_file_tensor(out, ft: FileTensor, dtype: torch.dtype, chunk_bytes: int) -> None:
    item = ft.dtype.itemsize
    step = max(item, chunk_bytes - chunk_bytes % item)
    scratch = torch.empty(step, dtype=torch.uint8)
    with open(ft.file, "rb", buffering=0) as handle:
        handle.seek(ft.start)
        for offset in range(0, ft.stop - ft.start, step):
            n = min(step, ft.stop - ft.start - offset)
            _read_exact(handle, scratch[:n].numpy(), ft)
            if dtype == ft.dtype:
                out.write(memoryview(scratch[:n].numpy()))
            else:
                part = scratch[:n].view(ft.dtype).to(dtype)
                if dtype.is_floating_point and not torch.isfinite(part).all():
                    name = str(dtype).removeprefix("torch.")
                    raise QuantkitError(f"a tensor of {ft.file.name} overflows {name}; save as bfloat16 instead")
                out.write(memoryview(part.view(torch.uint8).numpy()))
