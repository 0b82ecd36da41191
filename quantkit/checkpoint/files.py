"""Safetensors files as a checkpoint stores them: which files hold the weights, each file's header checked
(complete, known dtypes, byte ranges inside the file), every tensor's :class:`TensorRecord` (file, dtype, shape;
no data read), and :func:`read_tensors`, the one function that reads tensor data. Used by the readers
(:mod:`quantkit.checkpoint.read`, :mod:`quantkit.checkpoint.fp8_read`), the streamed model and ``inspect``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.checkpoint.format import INDEX_NAME, WEIGHTS_NAME
from quantkit.config import QuantkitError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_MAX_HEADER_BYTES = 100 * 2**20
_SHOW_KEYS = 5  # keys named in a message before "and N more"


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives and what its header says (no data read)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint (from the index when there is one)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise QuantkitError(f"{index} is damaged ({exc}); re-create the checkpoint") from exc
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    elif (path / WEIGHTS_NAME).is_file():
        files = [path / WEIGHTS_NAME]
    elif len(others := sorted(path.glob("*.safetensors"))) == 1:
        # AutoGPTQ-era folders name their one file after the settings' model_file_base_name
        # (gptq_model-4bit-128g.safetensors).
        files = others
    else:
        found = f" but {len(others)} other .safetensors files and no index to say which" if others else ""
        raise QuantkitError(f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}{found}; the weights are missing")
    for file in files:
        if not file.is_file():
            raise QuantkitError(f"{file.name} is listed in {INDEX_NAME} but missing from {path}")
    return files


def read_header(file: Path) -> tuple[dict[str, TensorRecord], dict[str, str]]:
    """Tensor records and ``__metadata__`` of one safetensors file, after checking it is complete."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise QuantkitError(f"{file} is truncated ({size} bytes): not even a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise QuantkitError(
                f"{file} is truncated or not a safetensors file (header of {header_len} bytes)"
            )
        try:
            header = json.loads(handle.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QuantkitError(f"{file} has a damaged safetensors header ({exc})") from exc
    metadata = header.pop("__metadata__", None) or {}
    records, data_end = {}, 0
    for key, entry in header.items():
        try:
            dtype_name, shape, end = (
                entry["dtype"],
                tuple(int(d) for d in entry["shape"]),
                int(entry["data_offsets"][1]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise QuantkitError(f"{file} has a damaged header entry for {key} ({exc!r})") from exc
        if dtype_name not in SAFETENSORS_DTYPES:
            raise QuantkitError(f"{file}: tensor {key} has unsupported dtype {dtype_name!r}")
        records[key] = TensorRecord(file, SAFETENSORS_DTYPES[dtype_name], shape)
        data_end = max(data_end, end)
    expected = 8 + header_len + data_end
    if size != expected:
        state = "truncated" if size < expected else "longer than its header describes"
        raise QuantkitError(
            f"{file} is {state}: {size} bytes on disk, {expected} expected; the copy or the write was "
            "interrupted, re-create or re-copy the checkpoint"
        )
    return records, metadata


def index_tensors(path: Path) -> dict[str, TensorRecord]:
    """Every tensor of the checkpoint by key, from the file headers (validated, no data read)."""
    files = weight_files(path)
    records: dict[str, TensorRecord] = {}
    for file in files:
        file_records, _ = read_header(file)
        for key, record in file_records.items():
            if key in records:
                raise QuantkitError(f"tensor {key} appears in both {records[key].file.name} and {file.name}")
            records[key] = record
    index = path / INDEX_NAME
    if index.is_file():
        for key, name in json.loads(index.read_text())["weight_map"].items():
            if key not in records or records[key].file.name != name:
                raise QuantkitError(f"{INDEX_NAME} places {key} in {name}, but that file does not hold it")
    return records


def read_tensors(records: dict[str, TensorRecord], keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` for ``keys`` (CPU tensors as stored), opening each file once."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(records[key].file, []).append(key)
    for file, file_keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in file_keys:
                yield key, handle.get_tensor(key)


def packed_modules(records: dict[str, TensorRecord]) -> list[str]:
    """Names of the packed linears (those with a ``.qweight``), in file order."""
    return [key[: -len(".qweight")] for key in records if key.endswith(".qweight")]


def name_keys(keys: list[str]) -> str:
    """The first few ``keys`` and how many there are, for messages."""
    shown = ", ".join(keys[:_SHOW_KEYS])
    return shown if len(keys) <= _SHOW_KEYS else f"{shown} and {len(keys) - _SHOW_KEYS} more ({len(keys)} in all)"
