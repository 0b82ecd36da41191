"""Constrained decoding: a grammar (JSON schema, JSON object, tool call) applied as a token mask in the sampler.

The grammar library is llguidance (Microsoft's, the engine behind llama.cpp's and vLLM's "guidance"
backend). Chosen over xgrammar because its wheel is one ``abi3`` manylinux build with no Python dependencies
(cp311 and cp312 alike; xgrammar needs pydantic, transformers, apache-tvm-ffi and triton at import), it
computes a mask in tens of microseconds without a per-vocabulary precompilation step, and the same matcher
reports when a grammar is complete (``is_stopped``). See docs/serving.md and bench/bench_grammar_mask.py.

How it runs: each constrained request holds an ``LLMatcher``. At each step the host fills an int32 bitmask
``[rows, ceil(V / 32)]`` (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed), copies it to the
device and sets the disallowed logits to -inf (:func:`apply_bitmask`) *after* the decode step (replayed
from its CUDA graph unchanged), then samples as usual; the chosen token advances the matcher. Requests
without a grammar never pay for any of this.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from quantkit.config import QuantkitError

# JSON as a model writes it compactly: no free whitespace (a small model would otherwise pad forever).
_JSON_OPTIONS = {"whitespace_flexible": False}


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of JSON matching ``schema`` (None: any JSON object, for ``json_object``)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                  defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise QuantkitError(f"the JSON schema cannot be used: {exc}") from exc


def lark_grammar(lark: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(lark)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits [B, V]`` to -inf where ``bitmask [B, ceil(V/32)]`` int32 (same device) has a 0 bit."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]  # [B, W*32] -> [B, V]
    logits.masked_fill_(~allowed, float("-inf"))


def bitmask_ref(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """The int32 bitmask of explicit allowed-token sets (a plain reference for the layout)."""
    words = (vocab + 31) // 32
    out = torch.zeros(len(allowed), words * 32, dtype=torch.bool)
    for i, tokens in enumerate(allowed):
        out[i, list(tokens)] = True
    weights = (1 << torch.arange(32, dtype=torch.int64))
    packed = (out.view(len(allowed), words, 32).long() * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


class GrammarMasks:
    """Builds matchers for one tokenizer and fills their masks (the tokenizer is converted once, lazily)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf, self.vocab_size, self._eos = hf_tokenizer, vocab_size, eos_token_ids
        self._tokenizer = None
        self._executor = None

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            try:
                import llguidance.hf
            except ImportError as exc:
                raise QuantkitError("structured output needs llguidance: pip install 'quantkit[serve]'") from exc
            try:
                eos = list(self._eos) or None
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=eos[0] if eos and len(eos) == 1 else eos)
            except ValueError as exc:
                raise QuantkitError(f"structured output needs a fast (Rust) tokenizer: {exc}") from exc
        return self._tokenizer

    def matcher(self, grammar: str):
        """A matcher at the start of ``grammar``; raises QuantkitError if the grammar is invalid."""
        from llguidance import LLMatcher

        tokenizer = self._ll_tokenizer()
        problem = LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise QuantkitError(f"the grammar is invalid: {problem}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise QuantkitError(f"the grammar is invalid: {matcher.get_error()}")
        return matcher

    def bitmask(self, matchers: list) -> torch.Tensor:
        """int32 ``[len(matchers), ceil(V/32)]`` on the CPU: the tokens each matcher allows next."""
        from llguidance import LLExecutor
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        mask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            if self._executor is None:
                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], mask)
        return mask


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))
