"""Warm-up: run the prefill and decode shapes a server will use before it says it is ready.

Triton compiles a kernel the first time it meets a new specialization (constexprs, integer arguments equal
to 1 or divisible by 16), and the W4A16 GEMM picks its kernel by the number of rows: without a warm-up the
first requests after start pay for that (issue 40: TTFT p95 2.1-2.6 s in the first minute on an H200, 0.10 s
once warm). :func:`warm_up` runs

* prefill of 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, ... tokens up to the engine's ``prefill_chunk`` (and
  ``max_seq_len - 1``): every row bucket the GEMM selection distinguishes (powers of two) at its top and at
  three quarters, each also one below, since Triton specializes integer arguments (the rows, and the row
  tiles derived from them) on ``== 1`` and ``% 16`` and all variants occur (a 952-token second chunk of a
  3,000-token prompt is not a multiple of 16), and every attention block count;
* a chunk that attends to earlier keys in its slot (the chunked-prefill attention path);
* one decode step per batch bucket (replays of the captured CUDA graphs, or the eager step), greedy and
  sampled, so the sampler's host path is warm too;
* constrained decoding: the tokenizer's conversion for llguidance and one masked step;
* requests through the engine's own scheduler, as clients send them: 2, 3 and 4 prompts finishing in one
  prefill (the 16-bit output head's GEMV compiles per row count, 1-4, and decode graphs only meet 1, 2 and
  4), a burst of prompts of mixed lengths (greedy and sampled rows), every slot at once (prompts split
  across chunks), and a prompt longer than a chunk arriving while others decode (a chunk over earlier keys
  at an unaligned offset, beside decode steps). Measured on an H100 with single-prompt warm-up only: cold
  TTFT p95 1.15 s at 8 streams against 0.12 s warm, and an 853 ms inter-token gap during a 3,000-token
  prompt (SmolLM2, GPTQ).

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
    requests: int = 0  # requests run through the scheduler (:func:`request_scenarios`)

    def describe(self) -> str:
        lengths = self.prefill_lengths
        return (f"warm-up: {self.seconds:.1f} s (prefill of {len(lengths)} lengths, {lengths[0]} to {lengths[-1]} "
                f"tokens, and a chunk over earlier keys; decode at batch {', '.join(map(str, self.decode_buckets))}"
                f"{'; grammar masks' if self.grammar else ''}"
                f"{f'; {self.requests} requests through the scheduler' if self.requests else ''})")


def prefill_lengths(prefill_chunk: int, max_seq_len: int, off_16: bool = True) -> tuple[int, ...]:
    """Each power of two below the chunk size, then the chunk size (all within one sequence); with ``off_16``
    also three quarters of each power from 8 up, and the number one below each of these: every row bucket
    ``(n/2, n]``, on and off a multiple of 16, and inside each bucket a row count whose tile count is off a
    multiple of 16 too (the Gluon W4A16 kernel's ``tiles_m = ceil(M / BLOCK_M)`` is an integer argument: at
    bucket 1024 with 64-row tiles, M = 1024 gives 16 tiles, 896 gives 14, a second compile, seen as the one
    kernel still compiled after ready at 8 streams of 128-token prompts on an H100)."""
    top = min(prefill_chunk, max_seq_len - 1)
    lengths, n = {top}, 1
    while n < top:
        lengths.add(n)
        n *= 2
    if off_16:
        lengths |= {3 * n // 4 for n in lengths if n >= 8 and n & (n - 1) == 0}
        lengths |= {n - 1 for n in lengths if n > 1}
    return tuple(sorted(lengths))


def warm_up(engine, requests: bool | None = None) -> WarmupReport:
    """Run ``engine``'s prefill and decode shapes once (it must be idle); how long that took. Where kernels
    compile on first use (the kernels backend) prefill lengths off multiples of 16 run too, and ``requests``
    (default: there) runs :func:`request_scenarios` through the scheduler."""
    if engine.has_work():
        raise RuntimeError("warm_up needs an idle engine")
    start = time.perf_counter()
    model, cache, runner = engine.model, engine.cache, engine._runner
    vocab = model.spec.vocab_size
    compiles = getattr(model, "backend", "") == "kernels"  # the reference backend (the CPU) compiles nothing
    lengths = prefill_lengths(engine.prefill_chunk, engine.max_seq_len, off_16=compiles)
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
    n_requests = _warm_requests(engine) if (compiles if requests is None else requests) else 0
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return WarmupReport(time.perf_counter() - start, lengths, buckets, grammar, n_requests)


BURST_LENGTHS = (5, 37, 128, 1, 64, 17, 200, 96)  # on and off multiples of 16, one single-token prompt


@dataclass(frozen=True)
class WarmRequest:
    """One warm-up request: its prompt length, tokens to generate, greedy or sampled, and how many engine
    steps run before it arrives (so that earlier requests of its wave are decoding by then)."""

    prompt_tokens: int
    max_tokens: int
    sampled: bool = False
    steps_before: int = 0


def request_scenarios(max_batch: int, max_seq_len: int, prefill_chunk: int) -> list[list[WarmRequest]]:
    """The warm-up's request waves (each run until the engine is idle again):

    1. 2, 3 and 4 prompts at once (as many as fit the slots), then a burst of up to 8, of :data:`BURST_LENGTHS`,
       every other one sampled;
    2. every slot at once, odd-length prompts (their sum spills over a chunk, so chunks split prompts);
    3. a short prompt, then, once it decodes, one longer than a chunk by an odd count."""
    room = max_seq_len - 4  # a prompt leaves room for its tokens
    if room < 1:
        return []

    def clip(n: int) -> int:
        return max(1, min(n, room))

    def group(n: int, tokens: int) -> list[WarmRequest]:
        return [WarmRequest(clip(BURST_LENGTHS[i % len(BURST_LENGTHS)]), tokens, sampled=i % 2 == 1)
                for i in range(n)]

    waves = [group(n, 2) for n in (2, 3, 4) if n <= max_batch]
    waves += [group(min(max_batch, 8), 3), [WarmRequest(clip(97), 2) for _ in range(max_batch)]]
    if max_batch >= 2:
        waves.append([WarmRequest(clip(9), 8), WarmRequest(clip(prefill_chunk + 37), 2, steps_before=2)])
    return waves


def _warm_requests(engine) -> int:
    """Run :func:`request_scenarios` through ``engine.add_request`` / ``step`` until idle; returns how many
    requests ran. The engine's statistics are reset after (the warm-up is not traffic); if a step fails, the
    warm-up's requests are aborted before the error goes on, so none holds a slot when serving starts."""
    vocab = engine.model.spec.vocab_size
    ids: list[int] = []
    try:
        for wave in request_scenarios(engine.max_batch, engine.max_seq_len, engine.prefill_chunk):
            for i, req in enumerate(wave):
                for _ in range(req.steps_before):
                    engine.step()
                params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, seed=i,
                                        **(dict(temperature=0.7, top_k=20, top_p=0.9) if req.sampled else {}))
                ids.append(engine.add_request([(11 * j + 5 + i) % vocab for j in range(req.prompt_tokens)], params))
            for _ in range(100_000):  # bounded: each step makes progress; a stuck engine must not hang start-up
                if not engine.has_work():
                    break
                engine.step()
    except Exception:
        for request_id in ids:
            engine.abort(request_id)  # a finished request is no longer found: nothing happens
        raise
    finally:
        engine.stats = type(engine.stats)()
    return len(ids)


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
