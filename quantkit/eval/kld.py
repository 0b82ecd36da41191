"""KL divergence between the next-token distributions of a base model and a quantized one.

Pure core: for each position, ``KL(P_base || P_quant) = sum_v p_base(v) * (log p_base(v) - log p_quant(v))``,
in float32 from log-softmaxed logits, and whether the two argmax tokens differ (:func:`token_kld`);
:func:`summarize_kld` turns the per-token values into the numbers a report shows.

Model-level driver: :func:`kld_windows` cuts a token stream into windows, :func:`model_kld` scores every
position of every window against a reference (the live base model, or its logits stored once by
:func:`store_reference` and shared by all quantized variants of that model).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


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


# -- model-level driver ------------------------------------------------------------------------------
#
# Logits are never built for a whole window: each window's final hidden states go through the output
# head LOGIT_CHUNK_ELEMENTS at a time (as in perplexity.py). The base model's side is a "reference":
# either the live base model (``LiveReference``, nothing stored) or logits computed once and kept in a
# safetensors file (``StoredReference``), which every quantized variant of that model is compared to.

# float16 holds logits to ~1e-3 relative: KL against a stored reference is off by ~1e-6 nats at most,
# three orders below what 4-bit quantization costs, at half the bytes of float32.
STORED_LOGITS_DTYPE = torch.float16
# A stored reference larger than this is refused (tokens x vocabulary x 2 bytes): fewer windows say as much.
MAX_STORED_BYTES = 8 << 30


@dataclass(frozen=True)
class KLDResult:
    """KL divergence of a model against a reference over ``n_windows`` windows of ``seqlen`` tokens."""

    stats: KLDStats
    n_windows: int
    seqlen: int
    seconds: float

    def to_dict(self) -> dict:
        return {"mean_kld": self.stats.mean_kld, "p99_kld": self.stats.p99_kld,
                "top1_changed": self.stats.top1_changed, "tokens": self.stats.n_tokens,
                "windows": self.n_windows, "seqlen": self.seqlen, "seconds": self.seconds}


def kld_windows(token_ids: torch.Tensor, *, seqlen: int, max_windows: int | None,
                bos_token_id: int | None = None) -> torch.Tensor:
    """Non-overlapping windows ``[W, seqlen]`` of ``token_ids`` (``[BOS] + seqlen - 1`` text tokens with BOS)."""
    from quantkit.config import QuantkitError

    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D [N], got shape {tuple(token_ids.shape)}")
    if seqlen < 2:
        raise QuantkitError(f"--seqlen must be at least 2 for KL divergence, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise QuantkitError(f"--max-windows must be at least 1, got {max_windows}")
    text = seqlen - (1 if bos_token_id is not None else 0)
    n_windows = token_ids.numel() // text
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise QuantkitError(f"the text has {token_ids.numel()} tokens, fewer than one window of {text}; "
                            "lower --seqlen or use a longer text")
    windows = token_ids[: n_windows * text].view(n_windows, text)
    if bos_token_id is not None:
        windows = torch.cat([windows.new_full((n_windows, 1), bos_token_id), windows], dim=1)
    return windows


def _chunk_positions(model: torch.nn.Module, seqlen: int) -> int:
    from quantkit.eval.perplexity import LOGIT_CHUNK_ELEMENTS, _vocab_size

    return max(16, LOGIT_CHUNK_ELEMENTS // _vocab_size(model, model.get_output_embeddings()))


def _window_hidden(model: torch.nn.Module, window: torch.Tensor, device) -> torch.Tensor:
    from quantkit.eval.perplexity import _last_hidden

    return _last_hidden(model, window.unsqueeze(0).to(device))[0]  # [T, H]


def _chunk_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    from quantkit.eval.perplexity import _head_logits

    return _head_logits(model, model.get_output_embeddings(), hidden)  # [c, V] float32


class LiveReference:
    """Reference logits from the base model itself, one window's hidden states at a time."""

    def __init__(self, model: torch.nn.Module, windows: torch.Tensor, device="cpu") -> None:
        self.model, self.windows, self.device = model.eval(), windows, device
        self._hidden: tuple[int, torch.Tensor] | None = None

    def chunk(self, index: int, start: int, stop: int) -> torch.Tensor:
        if self._hidden is None or self._hidden[0] != index:
            self._hidden = (index, _window_hidden(self.model, self.windows[index], self.device))
        return _chunk_logits(self.model, self._hidden[1][start:stop])


class StoredReference:
    """Reference logits kept in a safetensors file (one ``[T, V]`` float16 tensor per window)."""

    def __init__(self, path: str | Path, windows: torch.Tensor) -> None:
        from safetensors import safe_open

        self.path, self.windows = Path(path), windows
        self._file = safe_open(str(self.path), framework="pt", device="cpu")
        stored = self._file.get_tensor("windows")
        if not torch.equal(stored, windows):
            raise ValueError(f"{self.path} holds reference logits for other windows")

    def chunk(self, index: int, start: int, stop: int) -> torch.Tensor:
        return self._file.get_slice(f"logits.{index}")[start:stop].float()


def store_reference(model: torch.nn.Module, windows: torch.Tensor, path: str | Path, device="cpu",
                    on_window: Callable[[int, int], None] | None = None) -> StoredReference:
    """Compute the base model's logits on ``windows`` once and write them to ``path`` (atomically)."""
    from safetensors.torch import save_file

    from quantkit.config import QuantkitError
    from quantkit.eval.perplexity import _vocab_size

    path = Path(path)
    vocab = _vocab_size(model, model.get_output_embeddings())
    nbytes = windows.numel() * vocab * torch.finfo(STORED_LOGITS_DTYPE).bits // 8
    if nbytes > MAX_STORED_BYTES:
        raise QuantkitError(f"reference logits for {windows.shape[0]} windows of {windows.shape[1]} tokens x "
                            f"{vocab} would take {nbytes / 2**30:.1f} GiB; use fewer KL windows or a shorter seqlen")
    live = LiveReference(model, windows, device)
    chunk = _chunk_positions(model, windows.shape[1])
    tensors = {"windows": windows.contiguous()}
    with torch.inference_mode():
        for index in range(windows.shape[0]):
            parts = [live.chunk(index, s, s + chunk).to(STORED_LOGITS_DTYPE).cpu()
                     for s in range(0, windows.shape[1], chunk)]
            tensors[f"logits.{index}"] = torch.cat(parts)
            if on_window is not None:
                on_window(index + 1, windows.shape[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial))
    os.replace(partial, path)
    log.info("stored reference logits for %d windows in %s (%.0f MiB)", windows.shape[0], path, nbytes / 2**20)
    return StoredReference(path, windows)


def model_kld(reference, model: torch.nn.Module, windows: torch.Tensor, *, device="cpu",
              on_window: Callable[[int, int, float], None] | None = None) -> KLDResult:
    """KL(reference || model) per position of every window, summarized. ``reference`` is a
    :class:`LiveReference` or :class:`StoredReference` over the same ``windows``; ``model`` sits on ``device``.
    ``on_window(done, total, running_mean_kl)`` is called after each window."""
    started = time.perf_counter()
    chunk = _chunk_positions(model, windows.shape[1])
    kls, changes = [], []
    model.eval()
    with torch.inference_mode():
        for index in range(windows.shape[0]):
            hidden = _window_hidden(model, windows[index], device)
            for start in range(0, windows.shape[1], chunk):
                quant = _chunk_logits(model, hidden[start : start + chunk])
                base = reference.chunk(index, start, start + chunk).to(quant.device)
                kl, changed = token_kld(base, quant)
                kls.append(kl.cpu())
                changes.append(changed.cpu())
            if on_window is not None:
                on_window(index + 1, windows.shape[0], torch.cat(kls).mean().item())
    stats = summarize_kld(torch.cat(kls), torch.cat(changes))
    seconds = time.perf_counter() - started
    log.info("KL divergence mean %.5f p99 %.5f, top-1 changed %.2f%% over %d windows in %.1f s",
             stats.mean_kld, stats.p99_kld, 100 * stats.top1_changed, windows.shape[0], seconds)
    return KLDResult(stats=stats, n_windows=int(windows.shape[0]), seqlen=int(windows.shape[1]), seconds=seconds)
