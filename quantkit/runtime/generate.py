"""One prompt through the engine, streamed: what ``quantkit generate`` runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quantkit.config import QuantkitError
from quantkit.runtime.types import SamplingParams


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    prefill_tps: float
    decode_tps: float


def prompt_ids(tokenizer, prompt: str, chat: bool, system: str | None = None) -> list[int]:
    """Token ids of ``prompt``; with ``chat``, wrapped in the tokenizer's chat template as one user turn."""
    if not chat:
        return tokenizer(prompt)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise QuantkitError("this tokenizer has no chat template; drop --chat and write the prompt in full")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may answer a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def generate(
    engine, ids: list[int], params: SamplingParams, on_text: Callable[[str], None] | None = None
) -> GenerateResult:
    """Run one request to its end on ``engine``; ``on_text`` receives each piece of text as it is decoded."""
    before_p = (engine.stats.prefill_tokens, engine.stats.prefill_seconds)
    before_d = (engine.stats.decode_tokens, engine.stats.decode_seconds)
    request = engine.add_request(ids, params)
    pieces, tokens, reason = [], [], None
    while reason is None:
        for event in engine.step():
            if event.request_id != request:
                continue
            if event.token_id is not None:
                tokens.append(event.token_id)
            if event.text:
                pieces.append(event.text)
                if on_text is not None:
                    on_text(event.text)
            if event.finished:
                reason = event.finish_reason
    s = engine.stats

    def rate(n, t):
        return n / t if t > 0 else 0.0

    return GenerateResult(
        "".join(pieces),
        tuple(tokens),
        reason,
        len(ids),
        rate(s.prefill_tokens - before_p[0], s.prefill_seconds - before_p[1]),
        rate(s.decode_tokens - before_d[0], s.decode_seconds - before_d[1]),
    )
