"""The communicator record: rank, world size and the few collectives quantization needs.

``LocalComm`` (one process) makes every collective a no-op returning its input, so the walker and
the methods have one code path; ``TorchComm`` runs them on a ``torch.distributed`` process group.
A collective that fails (a peer rank raised and exited, was killed, or a timeout passed) raises
``DistributedError`` (a ``QuantkitError``) naming the operation, instead of a bare backend error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from quantkit.config import QuantkitError


class DistributedError(QuantkitError):
    """A collective failed: most often another rank died first (its own error is reported by it)."""


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...
    def reduce_sum(self, t: torch.Tensor, dst: int) -> torch.Tensor: ...
    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...
    def broadcast_object(self, obj: Any, src: int) -> Any: ...
    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]: ...
    def barrier(self) -> None: ...


@dataclass(frozen=True)
class LocalComm:
    """One process: every collective returns its input unchanged (no copy)."""

    rank: int = 0
    world_size: int = 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reduce_sum(self, t: torch.Tensor, dst: int) -> torch.Tensor:
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return t

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t]

    def barrier(self) -> None:
        return None


LOCAL = LocalComm()


@dataclass(frozen=True)
class TorchComm:
    """Collectives on the default ``torch.distributed`` process group (already initialized).

    ``backend`` "gloo" moves CUDA tensors through host memory (gloo's CUDA support is partial); NCCL
    works on them in place. Every method is in-place-safe for its caller: it returns the result
    tensor, which may or may not be the argument.
    """

    rank: int
    world_size: int
    backend: str
    owns_group: bool = True  # whether quantkit created the process group (and destroys it)

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if self.backend == "gloo" and t.is_cuda:
            return t.cpu()
        if self.backend == "nccl" and not t.is_cuda:
            return t.to(torch.device("cuda", torch.cuda.current_device()))
        return t

    def _run(self, what: str, fn, *args, **kwargs):
        import torch.distributed as dist

        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError, ValueError) as err:  # peer gone, timeout, abort
            raise DistributedError(
                f"rank {self.rank}/{self.world_size}: {what} failed; another rank most likely failed or was "
                f"killed first (see its error). Backend said: {str(err).strip().splitlines()[0][:300]}"
            ) from err

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        buf = self._staged(t)
        self._run("all_reduce", dist.all_reduce, buf, op=dist.ReduceOp.SUM)
        return buf.to(t.device)

    def reduce_sum(self, t: torch.Tensor, dst: int) -> torch.Tensor:
        """The sum on ``dst``; other ranks get an unspecified tensor (do not use it)."""
        import torch.distributed as dist

        buf = self._staged(t)
        self._run("reduce", dist.reduce, buf, dst=dst, op=dist.ReduceOp.SUM)
        return buf.to(t.device)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``t`` from ``src``; every other rank passes a tensor of the same shape and dtype to fill."""
        import torch.distributed as dist

        buf = self._staged(t)
        self._run("broadcast", dist.broadcast, buf, src=src)
        return buf.to(t.device)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        self._run("broadcast_object_list", dist.broadcast_object_list, box, src=src,
                  device=torch.device("cpu") if self.backend == "gloo" else None)
        return box[0]

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t [rows_r, ...]`` (rows may differ; other dims agree), in rank order."""
        import torch.distributed as dist

        buf = self._staged(t)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=buf.device)
        sizes[self.rank] = buf.shape[0]
        sizes = self.all_reduce_sum(sizes).tolist()
        padded = torch.zeros((max(sizes), *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
        padded[: buf.shape[0]] = buf
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._run("all_gather", dist.all_gather, parts, padded)
        return [p[:n].to(t.device) for p, n in zip(parts, sizes)]

    def barrier(self) -> None:
        import torch.distributed as dist

        self._run("barrier", dist.barrier)
