"""The records the serving runtime exchanges with its callers (CLI, HTTP server, scripts).

An engine takes token ids and a :class:`SamplingParams`, and answers with :class:`TokenEvent` s, one
per request per step. Everything here is plain data: no torch, so the server and the CLI can import
it without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from quantkit.config import QuantkitError

FINISH_STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens reached, or the cache slot is full
FINISH_ABORT = "abort"  # the caller aborted the request (a client that went away)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy decoding (top-k / top-p / seed are then ignored). ``top_k == 0``
    and ``top_p == 1`` switch those filters off. ``repetition_penalty`` divides positive logits and
    multiplies negative ones of every token already in the prompt or the output (CTRL's rule, as
    transformers applies it). ``stop`` strings end the request; the text returned never contains them.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # constrained decoding: an llguidance grammar (runtime.constrained: JSON schema, tool call); the
    # request ends ("stop") when the grammar is complete
    grammar: str | None = None
    # False: special tokens are kept in the text (tool calls whose markers are special tokens, such as
    # Mistral's [TOOL_CALLS] or Llama's <|python_tag|>); end-of-sequence tokens never appear either way
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if problems:
            raise QuantkitError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenEvent:
    """What one engine step produced for one request.

    ``text`` is the newly decodable text since the previous event (it may be empty while a multi-byte
    character is incomplete, and it never includes a stop string or anything after it). The last event
    of a request has ``finished=True`` and a ``finish_reason``; its ``token_id`` may be None.
    """

    request_id: int
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0


class Engine(Protocol):
    """A continuous-batching engine: requests join and leave between decode steps.

    Not thread-safe: one thread calls every method (the HTTP server runs it on a worker thread).
    """

    @property
    def max_seq_len(self) -> int: ...  # prompt + generated tokens one cache slot holds

    @property
    def max_batch(self) -> int: ...  # sequences decoded together at most

    @property
    def tokenizer(self): ...  # the Hugging Face tokenizer (chat template, decode)

    @property
    def model_name(self) -> str: ...

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; returns its id. Raises QuantkitError when it can never fit a slot."""
        ...

    def abort(self, request_id: int) -> None:
        """Drop a queued or running request; its slot is free from the next step on."""
        ...

    def has_work(self) -> bool:
        """Whether a request is queued or running."""
        ...

    def step(self) -> list[TokenEvent]:
        """Admit queued requests into free slots (prefill), then one decode step for all running ones."""
        ...
