"""CUDA-graph decode: the decode step captured once per batch bucket and replayed.

The step reads three static buffers (token, position and cache slot per row) and writes one static
logits buffer. A batch of n rows runs in the smallest bucket >= n; the padding rows point at the
cache's scratch slot at position 0, so they never touch a live sequence. Capturing runs each bucket
eagerly first (Triton compiles and autotunes there, outside the capture).
"""

from __future__ import annotations

import logging

import torch

from quantkit.runtime.model import KVCache, RuntimeModel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32)


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The capture buckets up to ``max_batch`` (which is always one of them)."""
    chosen = [b for b in BUCKETS if b < max_batch]
    return (*chosen, max_batch)


class DecodeGraphs:
    """One captured decode step per bucket; :meth:`run` fills the static inputs and replays."""

    def __init__(self, model: RuntimeModel, cache: KVCache, max_batch: int, warmup: int = 2,
                 buckets: tuple[int, ...] | None = None) -> None:
        self.model, self.cache = model, cache
        self.buckets = tuple(sorted({b for b in (buckets or buckets_for(max_batch)) if b < max_batch} | {max_batch}))
        dev = model.device
        self.scratch_slot = cache.slots - 1
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.slots = torch.full((max_batch,), self.scratch_slot, dtype=torch.int32, device=dev)
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
        torch.cuda.synchronize(dev)

    def _step(self, b: int) -> torch.Tensor:
        return self.model.decode(self.tokens[:b], self.positions[:b], self.slots[:b], self.cache)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """float32 logits ``[n, V]`` of one decode step for n rows (a view of the bucket's static output)."""
        n = len(tokens)
        b = self.bucket(n)
        pad = b - n
        host = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad])
        dev = host.to(self.model.device)
        self.tokens[:b].copy_(dev[0])
        self.positions[:b].copy_(dev[1])
        self.slots[:b].copy_(dev[2])
        self.graphs[b].replay()
        return self.outputs[b][:n]
