"""Warm-up: run the prefill and decode shapes a server will use before it says it is ready.

Triton compiles (and autotunes) a kernel the first time it meets a new shape class, and the W4A16 GEMM
picks its kernel by the number of rows: without a warm-up the first requests after start pay for that
(issue 40: TTFT p95 2.1-2.6 s in the first minute on an H200, 0.10 s once warm). :func:`warm_up` runs

* prefill of 1, 2, 4, ... tokens up to the engine's ``prefill_chunk`` (and ``max_seq_len - 1``), so every
  row count the GEMM selection distinguishes and every attention block count are compiled;
* a chunk that attends to earlier keys in its slot (the chunked-prefill attention path);
* one decode step per batch bucket (replays of the captured CUDA graphs, or the eager step), greedy and
  sampled, so the sampler's host path is warm too;
* constrained decoding: the tokenizer's conversion for llguidance and one masked step.

It writes only into cache slots no request holds yet (the engine is idle): a slot's contents are always
rewritten from position 0 before they are read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from quantkit.runtime import sampling
from quantkit.runtime.types import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    prefill_lengths: tuple[int, ...]
    decode_buckets: tuple[int, ...]
    grammar: bool = False  # constrained decoding ready (tokenizer converted, one mask applied)

    def describe(self) -> str:
        return (f"warm-up: {self.seconds:.1f} s (prefill of {', '.join(map(str, self.prefill_lengths))} tokens and "
                f"a chunk over earlier keys; decode at batch {', '.join(map(str, self.decode_buckets))}"
                f"{'; grammar masks' if self.grammar else ''})")


def prefill_lengths(prefill_chunk: int, max_seq_len: int) -> tuple[int, ...]:
    """1, 2, 4, ... below the chunk size, and the chunk size itself (all within one sequence)."""
    top = min(prefill_chunk, max_seq_len - 1)
    lengths, n = [], 1
    while n < top:
        lengths.append(n)
        n *= 2
    return (*lengths, top)


def warm_up(engine) -> WarmupReport:
    """Run ``engine``'s prefill and decode shapes once (it must be idle); how long that took."""
    if engine.has_work():
        raise RuntimeError("warm_up needs an idle engine")
    start = time.perf_counter()
    model, cache, runner = engine.model, engine.cache, engine._runner
    vocab = model.spec.vocab_size
    lengths = prefill_lengths(engine.prefill_chunk, engine.max_seq_len)
    for i, n in enumerate(lengths):
        prompt = [(7 * j + 3) % vocab for j in range(n)]
        logits = model.prefill([prompt], [0], cache)
        log.debug("warm-up prefill %d tokens (%d of %d)", n, i + 1, len(lengths))
    half = max(1, min(engine.prefill_chunk, engine.max_seq_len - 1) // 2)
    if half + 1 < engine.max_seq_len:
        model.prefill([[1] * half], [0], cache)
        logits = model.prefill([[2] * half], [0], cache, [half]) if 2 * half < engine.max_seq_len else logits
    sampler = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    gen = sampling.make_generator(0, model.device)
    buckets = tuple(runner.buckets)
    for b in buckets:
        launched = runner.start([1] * b, [1] * b, [min(i, cache.slots - 2) for i in range(b)])
        runner.greedy_tokens(launched)
        sampling.sample_batch(launched.logits[:1], [sampler], [torch.empty(0, dtype=torch.long)], [gen])
    sampling.sample_batch(logits[:1].float(), [sampler], [torch.empty(0, dtype=torch.long)], [gen])
    grammar = _warm_grammar(engine, logits[:1].float())
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return WarmupReport(time.perf_counter() - start, lengths, buckets, grammar)


def _warm_grammar(engine, logits: torch.Tensor) -> bool:
    """Convert the tokenizer for constrained decoding (about a second, once) and mask one step, so the first
    request with a response_format does not stall the engine; False when llguidance or a tokenizer is missing."""
    try:
        from quantkit.runtime.constrained import apply_bitmask, json_grammar

        masks = engine._grammar_masks()
        matcher = masks.matcher(json_grammar(None))
        apply_bitmask(logits.clone(), masks.bitmask([matcher]).to(logits.device))
        return True
    except ImportError:
        return False
    except Exception as exc:  # noqa: BLE001 (warm-up must not stop the server)
        log.warning("constrained decoding could not be warmed up: %s", exc)
        return False
