"""Progress of a long run as short lines: one per decoder layer, calibration with an ETA.

The CLI draws a progress bar and prints :func:`format_layer_line` under it; the Python API, with no
callbacks given, logs the same lines through ``logging`` (:class:`LogProgress`), with a stderr handler
added for the call in interactive sessions where nothing else would show them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

log = logging.getLogger("quantkit.progress")

# Keys of a linear's stats: (error before the method's correction, error after) in order of preference.
_BEFORE_KEYS = ("err_rtn", "err_before")
_AFTER_KEYS = ("err_gptq", "err_after", "weight_error")


def _first(stats: dict, keys: tuple[str, ...]) -> float | None:
    return next((float(stats[k]) for k in keys if stats.get(k) is not None), None)


def format_layer_line(event) -> str:
    """``layer  3/30   4.1s  error 0.0123 -> 0.0045  worst down_proj 0.0090``: under 80 columns for any
    number of linears (the mean over the layer's linears; ``--save-stats`` keeps each one)."""
    befores, afters = [], []
    worst_name, worst = "", -1.0
    for name, stats in event.result.stats.items():
        before, after = _first(stats, _BEFORE_KEYS), _first(stats, _AFTER_KEYS)
        if after is None:
            continue
        afters.append(after)
        if before is not None:
            befores.append(before)
        if after > worst:
            worst_name, worst = name.split(".")[-1], after
    width = len(str(event.n_layers))
    line = f"layer {event.index + 1:>{width}}/{event.n_layers}  {event.seconds:5.1f}s"
    if afters:
        mean_after = sum(afters) / len(afters)
        if len(befores) == len(afters):
            line += f"  error {sum(befores) / len(befores):.4f} -> {mean_after:.4f}"
        else:
            line += f"  error {mean_after:.4f}"
        line += f"  worst {worst_name[:16]} {worst:.4f}"
    return line


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class LogProgress:
    """Callbacks for ``api.quantize`` that log each layer, and calibration every ~10 % with an ETA."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.logger = logger
        self._calib_started: float | None = None
        self._calib_next_report = 0.0

    def on_layer(self, event) -> None:
        self.logger.info("%s", format_layer_line(event))

    def on_calibration(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self._calib_started is None:
            self._calib_started = now
        if total <= 0 or done / total < self._calib_next_report:
            return
        elapsed = now - self._calib_started
        eta = elapsed / done * (total - done) if done else float("nan")
        self.logger.info("self-calibration: %d / %d tokens, %s elapsed, about %s left", done, total,
                         format_duration(elapsed), format_duration(eta) if done else "?")
        self._calib_next_report = done / total + 0.1


def is_interactive() -> bool:
    """A person is watching: an interactive interpreter, a notebook, or stderr on a terminal."""
    return hasattr(sys, "ps1") or "ipykernel" in sys.modules or bool(getattr(sys.stderr, "isatty", lambda: False)())


@contextlib.contextmanager
def quantkit_logs_to(handler: logging.Handler) -> Iterator[None]:
    """Send quantkit's INFO lines (and above) to ``handler`` for the duration of the block."""
    logger = logging.getLogger("quantkit")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@contextlib.contextmanager
def visible_logs(enabled: bool) -> Iterator[None]:
    """While ``enabled`` and no handler would show quantkit's INFO lines, add a stderr handler."""
    if not enabled or logging.getLogger("quantkit").handlers or logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    with quantkit_logs_to(handler):
        yield
