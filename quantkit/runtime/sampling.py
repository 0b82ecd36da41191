"""Choosing the next token from logits, and stopping on strings.

Greedy rows of a batch share one ``argmax``; sampled rows each draw from their own seeded
``torch.Generator``, so a request's tokens do not depend on what else is in the batch. Filters follow
transformers' order: repetition penalty, temperature, top-k, top-p.
"""

from __future__ import annotations

import torch

from quantkit.runtime.types import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's rule on ``logits [V]``: positive logits of ``seen`` ids divided by ``penalty``, negative multiplied."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits[seen]
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits [V]`` with everything below the k-th largest set to -inf (k == 0: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches ``p`` (the top token always stays)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= p  # mass before this token already >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_row(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, gen: torch.Generator | None) -> int:
    """The next token for one sequence from its float32 ``logits [V]``."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    logits = top_p_mask(top_k_mask(logits, params.top_k), params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seen: list[torch.Tensor],
                 gens: list[torch.Generator | None]) -> list[int]:
    """Next tokens for ``logits [B, V]``: one argmax (one host sync) for the plain-greedy rows."""
    plain = [p.greedy and p.repetition_penalty == 1.0 for p in params]
    tokens = [0] * len(params)
    if any(plain):
        greedy = torch.argmax(logits, dim=-1).tolist()
        for i, is_plain in enumerate(plain):
            if is_plain:
                tokens[i] = greedy[i]
    for i, is_plain in enumerate(plain):
        if not is_plain:
            tokens[i] = sample_row(logits[i], params[i], seen[i], gens[i])
    return tokens


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """Index of the earliest stop string in ``text`` at or after ``start`` (where the stop could begin),
    or -1."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else -1
