"""Perplexity by the protocol of the GPTQ paper, one function used by every command that needs it.

Protocol: documents joined with blank lines, tokenized once without special tokens, cut into
non-overlapping windows of ``seqlen`` tokens (the remainder is dropped), each window scored on its
own; perplexity = exp(mean token NLL over all scored positions).

BOS: models whose tokenizer puts a beginning-of-sequence token in front of every text (Llama 2/3,
Gemma, Mistral) score far worse on windows that start mid-text without it, so for them each window
is ``[BOS] + seqlen - 1`` text tokens and the BOS position itself is never a target. Either way a
window scores ``seqlen - 1`` targets. SmolLM2's tokenizer adds no BOS, so its windows are plain text
(the setting the peers' 19.86 on WikiText-2 was measured with).

Memory: the full logits of one window (2048 x 49152 in float32 is 400 MB, 2048 x 128256 for Llama 3
is 1 GB) are never built. The decoder's last hidden states go through the output head a chunk of
positions at a time, and each chunk's NLL is taken in float32.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.calib_data.text import (
    HubTextSpec,
    hub_documents,
    join_documents,
    load_hub_rows,
    needs_bos,
    read_documents,
    tokenize_text,
)
from quantkit.config import QuantkitError

log = logging.getLogger(__name__)

__all__ = ["PerplexityResult", "load_eval_tokens", "needs_bos", "perplexity"]

EVAL_SOURCES = {
    "wikitext2": HubTextSpec(path="Salesforce/wikitext", name="wikitext-2-raw-v1", split="test"),
}
# Logit elements per chunk: 2**24 float32 = 64 MB, i.e. 341 positions of a 49152-token vocabulary.
LOGIT_CHUNK_ELEMENTS = 1 << 24
# Positions used once per call to check that hidden states -> head reproduces the model's own logits.
_HEAD_CHECK_POSITIONS = 16


@dataclass(frozen=True)
class PerplexityResult:
    """One perplexity measurement. ``n_tokens`` counts scored targets (``n_windows * (seqlen - 1)``)."""

    ppl: float
    mean_nll: float
    n_tokens: int
    n_windows: int
    seqlen: int
    seconds: float
    bos_prepended: bool


def load_eval_tokens(source: str | Path, tokenizer: Any, *, text_field: str = "text") -> torch.Tensor:
    """Token ids ``[N]`` of an evaluation text: ``wikitext2`` (hub, raw test split, rows joined with
    blank lines) or a local ``.txt`` (lines joined with blank lines), ``.jsonl`` / ``.parquet``
    (``text_field`` of each row). Tokenized once without special tokens."""
    source_name = str(source)
    if source_name in EVAL_SOURCES:
        spec = EVAL_SOURCES[source_name]
        documents = hub_documents(load_hub_rows(spec, label=source_name, option="--data"), spec.column)
    elif Path(source_name).expanduser().exists() or Path(source_name).suffix:
        documents = read_documents(source_name, text_field=text_field)
    else:
        raise QuantkitError(
            f"unknown evaluation source {source_name!r}: use one of {', '.join(EVAL_SOURCES)} "
            "or a .txt/.jsonl/.parquet file"
        )
    token_ids = tokenize_text(tokenizer, join_documents(documents))
    log.info("evaluation text %s: %d tokens", source_name, token_ids.numel())
    return token_ids


def perplexity(
    model: nn.Module,
    token_ids: torch.Tensor,
    *,
    seqlen: int = 2048,
    max_windows: int | None = None,
    bos_token_id: int | None = None,
    device: str | torch.device = "cpu",
    on_window: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``token_ids`` (LongTensor ``[N]``) over non-overlapping windows.

    Each window is ``seqlen`` tokens: ``[BOS] + seqlen - 1`` text tokens when ``bos_token_id`` is
    given, else ``seqlen`` text tokens; ``seqlen - 1`` targets are scored per window. Only the first
    ``max_windows`` windows are used when given. The model must already sit on ``device``; windows
    are moved there one at a time. ``on_window(done, total, running_ppl)`` is called after each."""
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D [N], got shape {tuple(token_ids.shape)}")
    if seqlen < 2:
        raise QuantkitError(f"--seqlen must be at least 2 for perplexity, got {seqlen}")
    text_per_window = seqlen - (1 if bos_token_id is not None else 0)
    n_windows = token_ids.numel() // text_per_window
    if max_windows is not None:
        if max_windows < 1:
            raise QuantkitError(f"--max-windows must be at least 1, got {max_windows}")
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise QuantkitError(
            f"the evaluation text has {token_ids.numel()} tokens, fewer than one window of {text_per_window}; "
            "lower --seqlen or use a longer text"
        )
    head_check_pending = True
    total_nll, n_scored = 0.0, 0
    started = time.perf_counter()
    model.eval()
    with torch.inference_mode():
        for index in range(n_windows):
            window = token_ids[index * text_per_window : (index + 1) * text_per_window]
            if bos_token_id is not None:
                window = torch.cat([window.new_tensor([bos_token_id]), window])
            window = window.unsqueeze(0).to(device)  # [1, seqlen]
            if head_check_pending:
                _check_head_matches_model(model, window[:, :_HEAD_CHECK_POSITIONS])
                head_check_pending = False
            window_nll, window_scored = _window_nll(model, window)
            total_nll += window_nll
            n_scored += window_scored
            if on_window is not None:
                on_window(index + 1, n_windows, math.exp(total_nll / n_scored))
    seconds = time.perf_counter() - started
    mean_nll = total_nll / n_scored
    log.debug("perplexity %.4f over %d windows of %d (%d tokens scored) in %.1f s",
             math.exp(mean_nll), n_windows, seqlen, n_scored, seconds)
    return PerplexityResult(
        ppl=math.exp(mean_nll),
        mean_nll=mean_nll,
        n_tokens=n_scored,
        n_windows=n_windows,
        seqlen=seqlen,
        seconds=seconds,
        bos_prepended=bos_token_id is not None,
    )


def _window_nll(model: nn.Module, window: torch.Tensor) -> tuple[float, int]:
    """Summed NLL (float64 accumulate) and number of targets of one window ``[1, T]``."""
    hidden = _last_hidden(model, window)[0, :-1]  # [T - 1, H]: the last position predicts nothing here
    targets = window[0, 1:]  # [T - 1]: position t predicts token t + 1
    head = model.get_output_embeddings()
    chunk = max(16, LOGIT_CHUNK_ELEMENTS // _vocab_size(model, head))
    total = 0.0
    for start in range(0, targets.numel(), chunk):
        logits = _head_logits(model, head, hidden[start : start + chunk])  # [c, V] float32
        total += F.cross_entropy(logits, targets[start : start + chunk], reduction="sum").item()
    return total, targets.numel()


def _last_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's final (normed) hidden states ``[1, T, H]``, without the output head."""
    out = model.get_decoder()(input_ids=input_ids, use_cache=False)
    if not hasattr(out, "last_hidden_state"):
        raise RuntimeError(f"{type(model).__name__}.get_decoder() does not return the base model's hidden states")
    return out.last_hidden_state


def _vocab_size(model: nn.Module, head: nn.Module) -> int:
    size = getattr(head, "out_features", None)
    return int(size) if size else int(_text_config(model).vocab_size)


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_logits(model: nn.Module, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits ``[c, V]`` of hidden states ``[c, H]``, with the post-processing some causal-LM
    classes apply after the head (Gemma 2/3 soft-capping, Cohere's logit scale, Granite's divisor)."""
    logits = head(hidden).float()
    config = _text_config(model)
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    return logits


def _check_head_matches_model(model: nn.Module, input_ids: torch.Tensor) -> None:
    """Guard against an architecture whose causal-LM forward post-processes logits in a way
    ``_head_logits`` does not know: compare both paths on a few positions once per call."""
    reference = model(input_ids=input_ids, use_cache=False).logits[0].float()  # [t, V]
    ours = _head_logits(model, model.get_output_embeddings(), _last_hidden(model, input_ids)[0])
    # Both paths run the same modules, so only reduced-precision rounding may separate them.
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    error = (ours - reference).abs().max().item() / max(reference.abs().max().item(), 1e-6)
    if error > tolerance:
        raise RuntimeError(
            f"{type(model).__name__}: chunked head logits differ from the model's own (relative error {error:.3g}); "
            "its forward post-processes logits in a way quantkit.eval.perplexity does not know yet"
        )
