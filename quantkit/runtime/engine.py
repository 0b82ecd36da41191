"""The continuous-batching engine: requests join and leave between decode steps (types.Engine).

Each running request owns one KV-cache slot. A step first admits queued requests into free slots, then
prefills at most ``prefill_chunk`` prompt tokens (chunked prefill: a long prompt is split over several
steps, each chunk attending to the part already in its slot; a prompt's last chunk gives its first
token), then runs one decode step for the requests that were already decoding. So a long prompt never
stalls the running streams: between two of their tokens lies at most one chunk of prefill (the worst
inter-token gap is one decode step plus the prefill of ``prefill_chunk`` tokens). Every request stops on
its own condition: an end-of-sequence or stop token, a stop string (never part of the text it returns),
max_tokens, or the end of its slot.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from quantkit.config import QuantkitError
from quantkit.runtime import sampling
from quantkit.runtime.constrained import apply_bitmask
from quantkit.runtime.graphs import DecodeGraphs, DecodeRunner, Launched
from quantkit.runtime.model import KVCache, RuntimeModel
from quantkit.runtime.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

_PROMPT_CONTEXT = 4  # prompt tokens decoded in front of the output, so the first word keeps its space
# Prompt tokens prefilled per engine step (chunked prefill): the worst inter-token gap of running streams
# is one decode step plus the prefill of this many tokens.
PREFILL_CHUNK_CUDA = 2048
PREFILL_CHUNK_CPU = 256


def default_prefill_chunk(device) -> int:
    return PREFILL_CHUNK_CUDA if torch.device(device).type == "cuda" else PREFILL_CHUNK_CPU


@dataclass
class EngineStats:
    """Cumulative timings (wall clock, device work included)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the cache slot
    output: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # prompt context + output, for detokenizing
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded output so far
    emitted: int = 0  # characters of text already returned
    matcher: object | None = None  # the grammar's state (constrained decoding), if any


def _plain_greedy(req: _Request) -> bool:
    return req.params.greedy and req.params.repetition_penalty == 1.0 and req.matcher is None


class Engine:
    """Implements :class:`quantkit.runtime.types.Engine` over a :class:`RuntimeModel`."""

    def __init__(
        self,
        model: RuntimeModel,
        tokenizer,
        *,
        max_batch: int = 32,
        max_seq_len: int = 2048,
        eos_token_ids: tuple[int, ...] = (),
        cuda_graphs: bool = False,
        model_name: str = "model",
        prefill_chunk: int | None = None,
        graph_buckets: tuple[int, ...] | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if max_batch < 1 or max_seq_len < 2:
            raise QuantkitError(f"max_batch must be >= 1 and max_seq_len >= 2, got {max_batch} and {max_seq_len}")
        if max_seq_len > model.max_positions:
            raise QuantkitError(f"max_seq_len {max_seq_len} exceeds the model's {model.max_positions} positions")
        self.model, self._tokenizer, self._model_name = model, tokenizer, model_name
        self.loaded_at = time.time()  # unix seconds (GET /v1/models reports it as "created")
        self._max_batch, self._max_seq_len = max_batch, max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(model.device)
        if self.prefill_chunk < 1:
            raise QuantkitError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if (kv_cache_dtype == "fp8" and model.backend == "kernels" and model.device.type == "cuda"
                and torch.cuda.get_device_capability(model.device) < (8, 9)):
            raise QuantkitError("an FP8 KV cache needs a GPU of compute capability 8.9 or later (Ada, Hopper) for "
                                "its e4m3 conversions; use --kv-cache-dtype auto here")
        self.cache = KVCache.allocate(model.spec, max_batch + 1, max_seq_len, model.dtype, model.device,
                                      kv_dtype=kv_cache_dtype)
        if cuda_graphs:
            self._runner = DecodeGraphs(model, self.cache, max_batch, buckets=graph_buckets)
        else:
            self._runner = DecodeRunner(model, self.cache, max_batch, buckets=graph_buckets)
        self.graphs = self._runner if cuda_graphs else None
        self.stats = EngineStats()
        self._next_id = 0
        self._queue: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}  # decoding
        self._prefilling: list[_Request] = []  # holding a slot, prompt partly in the cache (oldest first)
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out the lowest first
        self._aborted: list[TokenEvent] = []
        self._masks = None  # constrained decoding (runtime.constrained.GrammarMasks), built on first use
        # a greedy decode step launched but not yet read: (its rows, the launch); see step()
        self._inflight: tuple[list[_Request], Launched] | None = None

    # -- the Engine protocol --------------------------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if not isinstance(params, SamplingParams):
            raise QuantkitError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise QuantkitError("the prompt is empty: give at least one token")
        if len(prompt) + 1 > self._max_seq_len:
            raise QuantkitError(
                f"the prompt has {len(prompt)} tokens; a slot holds {self._max_seq_len} (prompt + 1 generated at "
                "least): shorten the prompt or raise max_seq_len"
            )
        vocab = self.model.spec.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise QuantkitError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        gen = None if params.greedy else sampling.make_generator(params.seed, self.model.device)
        context = prompt[-_PROMPT_CONTEXT:]
        req = _Request(
            self._next_id,
            prompt,
            params,
            min(params.max_tokens, self._max_seq_len - len(prompt)),
            frozenset(stop_ids),
            gen,
            ids=list(context),
            prefix_offset=0,
            read_offset=len(context),
        )
        if params.grammar is not None:
            req.matcher = self._grammar_masks().matcher(params.grammar)  # QuantkitError if invalid
        self._next_id += 1
        self._queue.append(req)
        return req.id

    def _grammar_masks(self):
        if self._masks is None:
            from quantkit.runtime.constrained import GrammarMasks

            if self._tokenizer is None:
                raise QuantkitError("constrained decoding needs the model's tokenizer")
            self._masks = GrammarMasks(self._tokenizer, self.model.spec.vocab_size, tuple(self.eos_token_ids))
        return self._masks

    def abort(self, request_id: int) -> None:
        for req in list(self._queue):
            if req.id == request_id:
                self._queue.remove(req)
                self._aborted.append(self._final(req, None, "", FINISH_ABORT))
                return
        req = self._running.pop(request_id, None)
        for waiting in self._prefilling:
            if waiting.id == request_id:
                self._prefilling.remove(waiting)
                req = waiting
                break
        if req is not None:
            self._free_slots.append(req.slot)
            self._free_slots.sort(reverse=True)
            self._aborted.append(self._final(req, None, "", FINISH_ABORT))

    @property
    def num_running(self) -> int:
        """Requests holding a cache slot (prefilling or decoding)."""
        return len(self._running) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def kv_cache_usage(self) -> float:
        """Tokens held in the cache / what its slots hold (read from another thread: an estimate)."""
        for _ in range(3):  # the engine thread may resize the dict while this reads it
            try:
                reqs = list(self._running.values()) + list(self._prefilling)
                break
            except RuntimeError:
                reqs = []
        held = sum(r.prefilled + len(r.output) for r in reqs)
        return held / (self._max_batch * self._max_seq_len)

    def warm_up(self, requests: bool | None = None):
        """Compile and run the prefill and decode shapes this engine serves (:mod:`.warmup`); call it idle."""
        from quantkit.runtime.warmup import warm_up

        return warm_up(self, requests)

    def has_work(self) -> bool:
        return bool(self._queue or self._running or self._prefilling or self._aborted or self._inflight)

    def step(self) -> list[TokenEvent]:
        """Admit and prefill what fits, decode the running requests; the events of what happened.

        A batch that only decodes greedily is pipelined: its step is launched and read in the next call,
        which first launches the step after it from the tokens the device chose (while the host reads
        and detokenizes, the device computes), as long as no request can join, every row is still running
        and none ends on its length at the step being read. A row that stops on a token or string at that
        step has one step too many in flight: its token is discarded, never emitted, and its cache slot
        is rewritten from position 0 by whoever gets it next (stream order puts that after the step).
        """
        events, self._aborted = self._aborted, []
        if self._inflight is not None and self._can_chain(*self._inflight):
            start = time.perf_counter()
            reqs, launched = self._inflight
            self._inflight = (reqs, self._runner.chain(launched))
            events += self._collect(reqs, launched)
            self.stats.decode_seconds += time.perf_counter() - start
            return events
        if self._inflight is not None:
            start = time.perf_counter()
            events += self._collect(*self._inflight)
            self._inflight = None
            self.stats.decode_seconds += time.perf_counter() - start
        decoding = list(self._running.values())
        self._admit()
        if self._prefilling:
            events += self._prefill_chunk()
        if decoding:
            events += self._decode(decoding)
        return events

    # -- steps ----------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Queued requests take free slots, in arrival order (their prompts are prefilled chunk by chunk)."""
        while self._queue and self._free_slots:
            req = self._queue.popleft()
            req.slot = self._free_slots.pop()
            self._prefilling.append(req)

    def _prefill_chunk(self) -> list[TokenEvent]:
        """Prefill up to ``prefill_chunk`` prompt tokens, oldest request first; the requests whose prompts are
        now whole get their first token and start decoding."""
        start = time.perf_counter()
        reqs, chunks, starts, budget = [], [], [], self.prefill_chunk
        for req in self._prefilling:
            take = min(len(req.prompt) - req.prefilled, budget)
            reqs.append(req)
            chunks.append(req.prompt[req.prefilled : req.prefilled + take])
            starts.append(req.prefilled)
            budget -= take
            if budget == 0:
                break
        logits = self.model.prefill(chunks, [r.slot for r in reqs], self.cache, starts)
        for req, chunk in zip(reqs, chunks):
            req.prefilled += len(chunk)
        done = [i for i, r in enumerate(reqs) if r.prefilled == len(r.prompt)]
        events = []
        if done:
            whole = [reqs[i] for i in done]
            tokens = self._sample(logits[done], whole, [None] * len(whole))
            for req, token in zip(whole, tokens):
                self._prefilling.remove(req)
                self._running[req.id] = req
                events.append(self._advance(req, token))
        self.stats.prefill_seconds += time.perf_counter() - start
        self.stats.prefill_tokens += sum(len(c) for c in chunks)
        return events

    def _decode(self, reqs: list[_Request]) -> list[TokenEvent]:
        """One decode step of ``reqs`` from the host's view of them; kept in flight (read by the next
        step()) when every row decodes greedily, read now otherwise."""
        start = time.perf_counter()
        launched = self._runner.start(
            [r.output[-1] for r in reqs],
            [len(r.prompt) + len(r.output) - 1 for r in reqs],
            [r.slot for r in reqs],
        )
        events = []
        if all(_plain_greedy(r) for r in reqs):
            self._inflight = (reqs, launched)
        else:
            events = self._collect(reqs, launched)
        self.stats.decode_seconds += time.perf_counter() - start
        return events

    def _can_chain(self, reqs: list[_Request], launched: Launched) -> bool:
        """Whether the step after ``launched`` may run before its tokens are read (see step())."""
        if (self._queue and self._free_slots) or self._prefilling:
            return False  # a request can join or is being prefilled: read this step, then admit / prefill
        if len(self._running) != len(reqs):
            return False
        # every row still running, and none ends on its length with the token in flight
        return all(self._running.get(r.id) is r and len(r.output) + 1 < r.max_new for r in reqs)

    def _collect(self, reqs: list[_Request], launched: Launched) -> list[TokenEvent]:
        """Read ``launched`` (waiting for it) and record each running row's token; rows that ended or were
        aborted meanwhile are skipped (their token is discarded)."""
        tokens = self._sample(launched.logits, reqs, self._runner.greedy_tokens(launched))
        self.stats.decode_steps += 1
        events = []
        for req, token in zip(reqs, tokens):
            if self._running.get(req.id) is req:
                self.stats.decode_tokens += 1
                events.append(self._advance(req, token))
        return events

    def _sample(self, logits: torch.Tensor, reqs: list[_Request], greedy: list[int | None]) -> list[int]:
        """Each row's token: the device's greedy choice where there is one and the row decodes plainly
        greedily, else sampled on the host from the float32 ``logits``."""
        if all(g is not None and _plain_greedy(r) for r, g in zip(reqs, greedy)):
            return list(greedy)
        constrained = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if constrained:  # the grammar's mask, applied to (a copy of) the step's logits outside any graph
            logits = logits.clone()
            mask = self._masks.bitmask([reqs[i].matcher for i in constrained]).to(logits.device, non_blocking=True)
            rows = torch.tensor(constrained, device=logits.device)
            masked = logits[rows]
            apply_bitmask(masked, mask)
            logits[rows] = masked
        seen = [
            torch.tensor(r.prompt + r.output, device=logits.device)
            if r.params.repetition_penalty != 1.0
            else torch.empty(0, dtype=torch.long)
            for r in reqs
        ]
        sampled = sampling.sample_batch(logits, [r.params for r in reqs], seen, [r.generator for r in reqs])
        return [g if g is not None and _plain_greedy(r) else t for r, g, t in zip(reqs, greedy, sampled)]

    # -- per-request bookkeeping ----------------------------------------------------------------------

    def _advance(self, req: _Request, token: int) -> TokenEvent:
        """Record ``token`` for ``req``; the event says what text it adds and whether the request ended."""
        req.output.append(token)
        if token in req.stop_ids:
            return self._finish(req, token, FINISH_STOP)
        req.text += self._detokenize(req, token)
        cut = sampling.find_stop(req.text, req.params.stop, max(0, req.emitted - self._longest_stop(req)))
        if cut >= 0:
            req.text = req.text[:cut]
            return self._finish(req, token, FINISH_STOP)
        if req.matcher is not None:
            req.matcher.consume_token(token)
            if req.matcher.is_stopped() or req.matcher.is_error():  # the grammar is complete (or broke)
                if req.matcher.is_error():
                    log.warning("request %d: grammar error: %s", req.id, req.matcher.get_error())
                req.text += self._undecoded(req)
                return self._finish(req, token, FINISH_STOP)
        if len(req.output) >= req.max_new:
            req.text += self._undecoded(req)
            return self._finish(req, token, FINISH_LENGTH)
        safe = len(req.text) - max(0, self._longest_stop(req) - 1)  # a stop string may still be forming
        delta = req.text[req.emitted : safe] if safe > req.emitted else ""
        req.emitted += len(delta)
        return TokenEvent(req.id, token, delta, prompt_tokens=len(req.prompt), generated_tokens=len(req.output))

    @staticmethod
    def _longest_stop(req: _Request) -> int:
        return max((len(s) for s in req.params.stop), default=0)

    def _detokenize(self, req: _Request, token: int) -> str:
        """Newly decodable text after ``token`` (empty while a multi-byte character is incomplete; always
        empty without a tokenizer, as for benchmarks on random weights)."""
        req.ids.append(token)
        if self._tokenizer is None:
            return ""
        skip = req.params.skip_special_tokens
        prefix = self._tokenizer.decode(req.ids[req.prefix_offset : req.read_offset], skip_special_tokens=skip)
        full = self._tokenizer.decode(req.ids[req.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            req.prefix_offset, req.read_offset = req.read_offset, len(req.ids)
            return full[len(prefix) :]
        return ""

    def _undecoded(self, req: _Request) -> str:
        """Text of tokens held back as an incomplete character, when the request ends (replacement marks)."""
        if self._tokenizer is None or req.read_offset == len(req.ids):
            return ""
        skip = req.params.skip_special_tokens
        prefix = self._tokenizer.decode(req.ids[req.prefix_offset : req.read_offset], skip_special_tokens=skip)
        return self._tokenizer.decode(req.ids[req.prefix_offset :], skip_special_tokens=skip)[len(prefix) :]

    def _finish(self, req: _Request, token: int, reason: str) -> TokenEvent:
        self._running.pop(req.id, None)
        self._free_slots.append(req.slot)
        self._free_slots.sort(reverse=True)
        delta = req.text[req.emitted :]
        req.emitted = len(req.text)
        return self._final(req, token, delta, reason)

    @staticmethod
    def _final(req: _Request, token: int | None, text: str, reason: str) -> TokenEvent:
        return TokenEvent(
            req.id,
            token,
            text,
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(req.prompt),
            generated_tokens=len(req.output),
        )
