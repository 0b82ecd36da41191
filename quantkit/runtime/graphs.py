"""The decode step over static device buffers, eager or captured in a CUDA graph per batch bucket.

The step reads four static buffers (token, position, cache slot and an advance flag per row), writes
the float32 logits and, on the device, prepares the next step: the greedy token (argmax) of each row
goes into the token buffer and each live row's position moves on by one. So a batch that only decodes
greedily can run step t + 1 straight from what step t left (:meth:`DecodeRunner.chain`) before the
host has looked at step t's tokens: the host reads them one step behind, through a pinned buffer and
an event, while the device already works on the next step.

A batch of n rows runs in the smallest bucket >= n; the padding rows point at the cache's scratch
slot at position 0 and do not advance, so they never touch a live sequence. Capturing runs each
bucket eagerly first (Triton compiles and autotunes there, outside the capture).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from quantkit.runtime.model import KVCache, RuntimeModel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32)


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The capture buckets up to ``max_batch`` (which is always one of them)."""
    chosen = [b for b in BUCKETS if b < max_batch]
    return (*chosen, max_batch)


@dataclass
class Launched:
    """One decode step on its way: ``n`` live rows in bucket ``bucket``; its greedy tokens land in ``host``
    (a pinned buffer on CUDA) once ``event`` has passed."""

    n: int
    bucket: int
    host: torch.Tensor
    event: torch.cuda.Event | None
    logits: torch.Tensor


class DecodeRunner:
    """The decode step run eagerly (any device); :class:`DecodeGraphs` replays it from CUDA graphs."""

    def __init__(self, model: RuntimeModel, cache: KVCache, max_batch: int,
                 buckets: tuple[int, ...] | None = None) -> None:
        self.model, self.cache = model, cache
        self.buckets = tuple(sorted({b for b in (buckets or buckets_for(max_batch)) if b < max_batch} | {max_batch}))
        dev = model.device
        self.scratch_slot = cache.slots - 1
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.slots = torch.full((max_batch,), self.scratch_slot, dtype=torch.int32, device=dev)
        self.advance = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self._staging = torch.zeros((4, max_batch), dtype=torch.long, device=dev)
        on_cuda = dev.type == "cuda"
        # two host buffers: a step's tokens are read while the next step's copy may already be queued
        self._host = [torch.zeros(max_batch, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
        self._next_host = 0
        self._on_cuda = on_cuda

    def _step(self, b: int) -> torch.Tensor:
        """One decode step on the first ``b`` rows of the buffers; leaves the next step's inputs behind."""
        logits = self.model.decode(self.tokens[:b], self.positions[:b], self.slots[:b], self.cache)
        self.tokens[:b].copy_(torch.argmax(logits, dim=-1))
        self.positions[:b].add_(self.advance[:b])
        return logits

    def _run_bucket(self, b: int) -> torch.Tensor:
        return self._step(b)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def start(self, tokens: list[int], positions: list[int], slots: list[int]) -> Launched:
        """Launch one step for n rows given by the host (each row's last token, its position and slot)."""
        n = len(tokens)
        b = self.bucket(n)
        pad = b - n
        host = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad,
                             [1] * n + [0] * pad])
        staged = self._staging[:, :b]
        staged.copy_(host)
        self.tokens[:b].copy_(staged[0])
        self.positions[:b].copy_(staged[1])
        self.slots[:b].copy_(staged[2])
        self.advance[:b].copy_(staged[3])
        return self._launch(n, b)

    def chain(self, launched: Launched) -> Launched:
        """Launch the step after ``launched`` for the same rows, from the tokens and positions it left on the
        device (each row's greedy token), without waiting for it."""
        return self._launch(launched.n, launched.bucket)

    def _launch(self, n: int, b: int) -> Launched:
        logits = self._run_bucket(b)
        host = self._host[self._next_host]
        self._next_host ^= 1
        event = None
        if self._on_cuda:
            host[:b].copy_(self.tokens[:b], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host[:b].copy_(self.tokens[:b])
        return Launched(n, b, host, event, logits[:n])

    @staticmethod
    def greedy_tokens(launched: Launched) -> list[int]:
        """The greedy token of each live row of ``launched`` (waits for the step)."""
        if launched.event is not None:
            launched.event.synchronize()
        return launched.host[: launched.n].tolist()


class DecodeGraphs(DecodeRunner):
    """One captured decode step per bucket, replayed by :meth:`start` and :meth:`chain`."""

    def __init__(self, model: RuntimeModel, cache: KVCache, max_batch: int, warmup: int = 2,
                 buckets: tuple[int, ...] | None = None) -> None:
        super().__init__(model, cache, max_batch, buckets)
        dev = model.device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        for b in sorted(self.buckets, reverse=True):  # the largest first: the smaller ones reuse its pool
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    self._step(b)
            torch.cuda.current_stream(dev).wait_stream(stream)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._step(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
            log.info("captured the decode step for batch %d", b)
        # the warm-up steps moved the padding rows' buffers; start clean
        self.positions.zero_()
        self.advance.zero_()
        torch.cuda.synchronize(dev)

    def _run_bucket(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        return self.outputs[b]
