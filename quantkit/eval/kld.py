"""KL divergence between the next-token distributions of a base model and a quantized one (pure core).

For each scored position, ``KL(P_base || P_quant) = sum_v p_base(v) * (log p_base(v) - log p_quant(v))``,
in float32 from log-softmaxed logits, and whether the two argmax tokens differ. A model-level driver
(windows over a text, chunked heads) builds on :func:`token_kld`; :func:`summarize_kld` turns the
per-token values into the numbers a report shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KLDStats:
    """Summary of per-token KL divergences: mean, 99th percentile, share of changed top-1 tokens."""

    mean_kld: float
    p99_kld: float
    top1_changed: float
    n_tokens: int


def token_kld(base_logits: torch.Tensor, quant_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position ``KL(base || quant)`` ``[T]`` (float32, >= 0) and top-1 disagreement ``[T]`` (bool).

    ``base_logits``, ``quant_logits``: ``[T, V]`` for the same positions (any float dtype)."""
    if base_logits.shape != quant_logits.shape or base_logits.dim() != 2:
        raise ValueError(f"logits must both be [T, V]; got {tuple(base_logits.shape)} and {tuple(quant_logits.shape)}")
    log_p = F.log_softmax(base_logits.float(), dim=-1)
    log_q = F.log_softmax(quant_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)  # rounding can dip below zero
    changed = base_logits.argmax(dim=-1) != quant_logits.argmax(dim=-1)
    return kl, changed


def summarize_kld(kl: torch.Tensor, changed: torch.Tensor) -> KLDStats:
    """Mean, 99th percentile and top-1 change rate of per-token values from :func:`token_kld`."""
    if kl.numel() == 0:
        raise ValueError("no tokens to summarize")
    kl = kl.flatten().float()
    return KLDStats(
        mean_kld=kl.mean().item(),
        p99_kld=torch.quantile(kl, 0.99).item() if kl.numel() > 1 else kl.item(),
        top1_changed=changed.flatten().float().mean().item(),
        n_tokens=kl.numel(),
    )
