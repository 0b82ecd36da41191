"""Calibration token windows for a loaded model, and the sequence-length check every window source shares."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from quantkit.config import CalibConfig, QuantkitError
from quantkit.defaults import SELF_CALIB_CPU_SIZE

log = logging.getLogger(__name__)


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's config allows (``max_position_embeddings``), if it says."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def check_seqlen(model: torch.nn.Module, seqlen: int) -> None:
    """Refuse windows longer than the model's positions before any work on them."""
    limit = max_positions(model)
    if limit is not None and seqlen > limit:
        raise QuantkitError(f"--seqlen {seqlen} is longer than the model's {limit} positions; use --seqlen {limit} "
                            "or less")


def calibration_tokens(calib: CalibConfig, loaded, on_progress: Callable | None = None) -> torch.Tensor:
    """``[nsamples, seqlen]`` calibration token ids for a loaded model."""
    from quantkit.calib_data.sources import load_calibration

    check_seqlen(loaded.model, calib.seqlen)
    note = ""
    if calib.source == "self" and (calib.nsamples, calib.seqlen) == SELF_CALIB_CPU_SIZE:
        note = "; self-generated text is sized down on a CPU, where generating is slow"
    log.info("calibration: %s, %d windows x %d tokens (--calib, --nsamples, --seqlen set them%s)",
             calib.source, calib.nsamples, calib.seqlen, note)
    return load_calibration(calib, loaded.tokenizer, model=loaded.model, on_progress=on_progress)
