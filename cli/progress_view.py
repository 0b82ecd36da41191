"""One progress display for every command: a rich bar on a terminal, throttled plain lines otherwise.

``ProgressView(console)`` decides once: on a terminal it draws rich bars (k/n, elapsed, ETA, a free
field such as peak memory) with lines printed above them; anywhere else (a log file, a pipe, CliRunner)
it writes :mod:`quantkit.progress_lines`' plain lines: a phase's k/n with its ETA at most every 20 s,
a closing line per phase, and a heartbeat naming what still runs after 30 s of silence. Never a
carriage return, an ANSI sequence or a bar glyph in redirected output.
"""

from __future__ import annotations

import logging
import time

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from quantkit.progress_lines import HEARTBEAT_S, PROGRESS_INTERVAL_S, Heartbeat, LineSink, ThrottledPhase


def is_live(con: Console) -> bool:
    """A person watches a terminal that can redraw a bar."""
    return con.is_terminal and not con.is_dumb_terminal


class _PlainLogHandler(logging.Handler):
    """Library log lines as plain text through the view (a heartbeat then names the step they announce)."""

    def __init__(self, view: ProgressView) -> None:
        super().__init__(level=logging.INFO)
        self.view = view

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record must not stop the run
            self.handleError(record)
            return
        head = message.split(":", 1)[0]
        if ":" in message and len(head) <= 32:  # "loading: ...", "calibration: ..."
            self.view.sink.announce(head)
        prefix = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        self.view.print(prefix + message)


class ProgressView:
    """Phases with k/n progress and lines between them; ``plain=None`` picks by the console."""

    def __init__(self, con: Console, *, plain: bool | None = None, clock=time.monotonic,
                 interval: float = PROGRESS_INTERVAL_S, heartbeat: float = HEARTBEAT_S) -> None:
        self.console = con
        self.plain = not is_live(con) if plain is None else plain
        self.interval = interval
        self._phases: dict[int, ThrottledPhase] = {}
        self.sink = LineSink(self._write_plain, clock)
        self.heartbeat = Heartbeat(self.sink, every=heartbeat)
        self.progress = None if self.plain else Progress(
            TextColumn("[bold]{task.description}[/bold]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            TextColumn("{task.fields[extra]}"), console=con, transient=False,
        )

    def _write_plain(self, text: str) -> None:
        # Wrapped at the console's width (COLUMNS when set; else a wide log width), never cut.
        self.console.print(text, markup=False, highlight=False, overflow="fold")

    def __enter__(self) -> ProgressView:
        if self.progress is not None:
            self.progress.__enter__()
        else:
            self.heartbeat.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)
        else:
            self.heartbeat.stop()

    def phase(self, name: str, total: int | None, unit: str = "") -> int:
        """Start a phase; returns the key :meth:`update` takes."""
        if self.progress is not None:
            return self.progress.add_task(name, total=total, unit=unit, extra="")
        key = len(self._phases)
        self._phases[key] = ThrottledPhase(self.sink, name, total, unit, interval=self.interval)
        return key

    def update(self, key: int, done: int, *, total: int | None = None, extra: str | None = None) -> None:
        if self.progress is not None:
            fields = {} if extra is None else {"extra": extra}
            self.progress.update(key, completed=done, **({"total": total} if total is not None else {}), **fields)
        else:
            self._phases[key].update(done, total, extra)

    def close(self, key: int) -> None:
        """End a phase that may stop short of its total (the plain closing line)."""
        if self.progress is None:
            self._phases[key].close()

    def print(self, text: str, style: str | None = None) -> None:
        """A line of output above the bars (plain: as it is, and it counts for the heartbeat)."""
        if self.progress is not None:
            self.progress.console.print(text, style=style, highlight=False, markup=False, overflow="ellipsis",
                                        no_wrap=True)
        else:
            self.sink.emit(text)

    def log_handler(self) -> logging.Handler:
        """A handler that shows quantkit's log lines in this view."""
        if self.progress is not None:
            handler = RichHandler(console=self.console, show_time=False, show_path=False, markup=False)
            handler.setLevel(logging.INFO)
            return handler
        return _PlainLogHandler(self)
