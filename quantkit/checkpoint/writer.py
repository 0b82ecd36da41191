"""The one writer of checkpoint folders: tensors go into safetensors shards as they are added.

Everything is written into a hidden temporary sibling of the output folder and renamed into place
only by :meth:`CheckpointWriter.publish`, so an interrupted write never leaves a folder that looks
like a checkpoint. Shards are filled in the order tensors are added and written as soon as the next
tensor would overflow ``max_shard_bytes``: a caller that adds one decoder layer at a time (a model
streamed from disk) holds at most one shard's tensors. Shards are written under provisional names and
get their final ``model-0000i-of-0000n.safetensors`` names (or ``model.safetensors`` alone) when the
count is known.

What goes into the tensors and config.json is decided in :mod:`quantkit.checkpoint.save`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.format import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from quantkit.config import QuantkitError


@dataclass(frozen=True)
class PendingTensor:
    """A tensor to write: ``source`` as the model holds it, cast to ``dtype`` (None: as it is) only
    when its shard is written, so saving never holds a second copy of the whole model."""

    source: torch.Tensor
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        itemsize = self.dtype.itemsize if self.dtype is not None else self.source.element_size()
        return self.source.numel() * itemsize

    def materialize(self, key: str) -> torch.Tensor:
        if self.source.is_meta:
            raise QuantkitError(f"{key} was never read from the model's files (it is still on the meta device)")
        tensor = self.source.detach()
        if self.dtype is not None and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
            if not torch.isfinite(tensor).all():
                name = str(self.dtype).removeprefix("torch.")
                raise QuantkitError(f"{key} overflows {name}; save as bfloat16 instead")
        return tensor.to("cpu").contiguous()


@dataclass(frozen=True)
class FilePending:
    """A tensor copied straight from a source safetensors file (``quantkit.checkpoint.stream_io.FileTensor``) into its
    shard, chunk by chunk, cast to ``dtype`` (None: as stored): tensors a streamed model never holds."""

    source: Any  # quantkit.checkpoint.stream_io.FileTensor
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return self.source.numel * (self.dtype or self.source.dtype).itemsize


def shard_name(index: int, count: int) -> str:
    return WEIGHTS_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class CheckpointWriter:
    """Writes one checkpoint folder: ``add`` tensors (any number of times), then ``publish``.

    Used as a context manager, an exception inside the block deletes the temporary folder.
    ``metadata`` goes into every shard's safetensors header.
    """

    def __init__(self, output: str | os.PathLike, *, metadata: dict[str, str], overwrite: bool = False,
                 max_shard_bytes: int = 4 * 2**30) -> None:
        if max_shard_bytes <= 0:
            raise QuantkitError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.output = Path(output)
        self.overwrite = overwrite
        self.max_shard_bytes = max_shard_bytes
        self.metadata = dict(metadata)
        refuse_existing(self.output, overwrite)
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.output.parent / f".{self.output.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.written: set[str] = set()  # every key added so far (written or pending)
        self._pending: dict[str, PendingTensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total_bytes = 0
        # key -> quantkit.checkpoint.stream_io.FileTensor: a tensor added while still on the meta device (never read
        # by a streamed model) is copied from there instead
        self.file_sources: dict[str, Any] = {}

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, state: dict[str, PendingTensor]) -> None:
        """Queue ``state``'s tensors in order; each shard is written once the next tensor would overflow it."""
        for key, pending in state.items():
            if key in self.written:
                raise ValueError(f"tensor {key} was added twice to {self.output}")
            if isinstance(pending, PendingTensor) and pending.source.is_meta and key in self.file_sources:
                pending = FilePending(self.file_sources[key], pending.dtype)
            if self._pending and self._pending_bytes + pending.nbytes > self.max_shard_bytes:
                self._flush()
            self._pending[key] = pending
            self._pending_bytes += pending.nbytes
            self.written.add(key)

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.tmp / _provisional_name(len(self._shards))
        if any(isinstance(p, FilePending) for p in self._pending.values()):
            _write_streamed_shard(path, self._pending, self.metadata)
        else:
            tensors = _own_storage({k: p.materialize(k) for k, p in self._pending.items()})
            _write_shard(path, tensors, self.metadata)
        self._shards.append(list(self._pending))
        self._total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def publish(self, config: dict, *, model: Any = None, tokenizer: Any = None) -> list[str]:
        """Write the last shard, the index, config.json, tokenizer and generation config; rename into place.
        Returns the shard file names."""
        self._flush()
        if not self._shards:
            raise QuantkitError(f"nothing to save in {self.output}: no tensors were added")
        names = [shard_name(i, len(self._shards)) for i in range(len(self._shards))]
        for i, name in enumerate(names):
            os.replace(self.tmp / _provisional_name(i), self.tmp / name)
        if len(names) > 1:
            index = {
                "metadata": {"total_size": self._total_bytes},
                "weight_map": {k: name for name, keys in zip(names, self._shards) for k in keys},
            }
            (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (self.tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True, default=json_default) + "\n")
        _save_extras(self.tmp, model, tokenizer)
        _publish(self.tmp, self.output, self.overwrite)
        return names

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _provisional_name(index: int) -> str:
    return f"part-{index + 1:05d}.safetensors"


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy tensors that share storage with another one or view part of a bigger one.

    safetensors refuses shared storage, and methods share tensors legitimately: GPTQ with act-order
    gives the linears that read one input (q/k/v, gate/up) the same ``g_idx`` tensor.
    """
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    # safetensors creates its files owner-only (0600); a checkpoint is meant to be read by servers
    # running as other users, like the json files next to it.
    path.chmod(0o644)


def _write_streamed_shard(path: Path, pending: dict, metadata: dict[str, str]) -> None:
    """A shard holding tensors copied from source files: written tensor by tensor, file tensors in chunks."""
    from quantkit.checkpoint.stream_io import write_shard

    items = []
    for key, p in pending.items():
        if isinstance(p, FilePending):
            items.append((key, p.source, p.dtype or p.source.dtype))
        else:
            items.append((key, p.materialize(key), p.dtype or p.source.dtype))
    write_shard(path, items, metadata)
    path.chmod(0o644)


def _save_extras(folder: Path, model: Any, tokenizer: Any) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(folder))


def refuse_existing(output: Path, overwrite: bool) -> None:
    if overwrite or not (output.exists() or output.is_symlink()):
        return
    if output.is_dir() and not any(output.iterdir()):
        return  # an empty folder made ahead of time is fine
    raise QuantkitError(f"{output} already exists; pass --overwrite (overwrite=True) to replace it")


def _publish(tmp: Path, output: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` folder to ``output``; an existing output is swapped out, then deleted."""
    refuse_existing(output, overwrite)  # again: something may have appeared while we wrote
    if not (output.exists() or output.is_symlink()):
        os.replace(tmp, output)
        return
    old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(output, old)
    try:
        os.replace(tmp, output)
    except BaseException:
        os.replace(old, output)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


def json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")
