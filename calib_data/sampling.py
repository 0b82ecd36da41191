"""The token sampler of the self-generated calibration, shared by its two drivers.

``self_generated`` (transformers, any device) and ``runtime_sampler`` (quantkit's runtime, CUDA graphs) draw
every token through this one function, so both give the same distribution for the same logits.
"""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor, generator: torch.Generator, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """One token per row of ``logits`` ``[b, V]``: temperature, then the ``top_k`` most likely, then
    the smallest prefix of those whose probability reaches ``top_p``. Returns ``[b]``."""
    scaled = logits.float() / temperature
    k = min(top_k, scaled.shape[-1]) if top_k and top_k > 0 else scaled.shape[-1]
    top_logits, top_ids = torch.topk(scaled, k, dim=-1)  # [b, k], sorted descending
    probs = torch.softmax(top_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked above each token
    probs = probs.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
    choice = torch.multinomial(probs, 1, generator=generator)  # [b, 1]; multinomial renormalizes
    return top_ids.gather(-1, choice).squeeze(-1)
