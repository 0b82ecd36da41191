"""Progress for a log file: throttled plain lines with k/n, elapsed time and ETA, and a heartbeat.

When the output is not a terminal, a progress bar cannot redraw itself: its frames end up in the log
as fragments. Instead each phase (self-calibration, layers, evaluation windows, ...) says where it is
at most every ``interval`` seconds and once when it ends, and a :class:`Heartbeat` says which phase is
still running whenever nothing was written for ``heartbeat`` seconds (loading, saving, a slow layer).
So a log gets a line at least every 30 s and, apart from phase ends, at most one every ~20 s per phase.

Torch- and rich-free; the clock is injected so the throttle is tested without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from quantkit.progress import format_duration

PROGRESS_INTERVAL_S = 20.0  # a phase's k/n line at most this often (plus its closing line)
HEARTBEAT_S = 30.0  # after this long without any line, say what is still running

Clock = Callable[[], float]


class LineSink:
    """Where lines go, and when the last one went (the heartbeat's reference)."""

    def __init__(self, emit: Callable[[str], None], clock: Clock = time.monotonic) -> None:
        self._emit = emit
        self.clock = clock
        self.last_line = clock()
        self.current: ThrottledPhase | None = None  # the phase a heartbeat speaks of
        self.current_name = ""  # or the last thing the library announced ("loading", ...)
        self.current_since = self.last_line
        self._lock = threading.Lock()

    def emit(self, text: str) -> None:
        with self._lock:
            self._emit(text)
            self.last_line = self.clock()

    def announce(self, name: str) -> None:
        """A step with no k/n has started (from a library log line): a heartbeat names it."""
        self.current, self.current_name, self.current_since = None, name, self.clock()


class ThrottledPhase:
    """One phase of ``total`` steps: ``update(done)`` writes a line when ``interval`` has passed since
    this phase's last one; the last step (or :meth:`close`) writes the closing line."""

    def __init__(self, sink: LineSink, name: str, total: int | None, unit: str = "",
                 interval: float = PROGRESS_INTERVAL_S) -> None:
        self.sink, self.name, self.total, self.unit, self.interval = sink, name, total, unit, interval
        self.started = sink.clock()
        self.last = self.started
        self.done = 0
        self.extra = ""
        self.closed = False
        sink.current = self

    def status(self, now: float) -> str:
        """``layers 12/30 (40%), 1 min 02 s elapsed, about 1 min 33 s left, peak 3.1 GiB``."""
        elapsed = now - self.started
        unit = f" {self.unit}" if self.unit else ""
        if not self.total:
            text = f"{self.name}: {self.done}{unit}, {format_duration(elapsed)} elapsed"
        else:
            text = f"{self.name}: {self.done}/{self.total}{unit} ({100 * self.done / self.total:.0f}%), " \
                   f"{format_duration(elapsed)} elapsed"
            if 0 < self.done < self.total:
                text += f", about {format_duration(elapsed / self.done * (self.total - self.done))} left"
        return text + (f", {self.extra}" if self.extra else "")

    def update(self, done: int, total: int | None = None, extra: str | None = None) -> None:
        if self.closed:
            return
        self.done = done
        if total is not None:
            self.total = total
        if extra is not None:
            self.extra = extra
        if self.total and done >= self.total:
            self.close()
            return
        now = self.sink.clock()
        if now - self.last >= self.interval:
            self.last = now
            self.sink.emit(self.status(now))

    def close(self) -> None:
        """The closing line: ``layers: 30/30 layers in 5 min 20 s`` (once)."""
        if self.closed:
            return
        self.closed = True
        elapsed = format_duration(self.sink.clock() - self.started)
        unit = f" {self.unit}" if self.unit else ""
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        self.sink.emit(f"{self.name}: {count}{unit} in {elapsed}" + (f", {self.extra}" if self.extra else ""))
        if self.sink.current is self:
            self.sink.announce("")


class Heartbeat:
    """Says what is still running after ``every`` seconds without a line. :meth:`beat` decides once (the
    tests call it); :meth:`start` runs it from a daemon thread until :meth:`stop`."""

    def __init__(self, sink: LineSink, every: float = HEARTBEAT_S, poll: float = 1.0) -> None:
        self.sink, self.every, self.poll = sink, every, poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> bool:
        now = self.sink.clock()
        if now - self.sink.last_line < self.every:
            return False
        phase = self.sink.current
        if phase is not None and not phase.closed:
            text = phase.status(now)
        else:
            name = self.sink.current_name or "working"
            text = f"{name}: still running, {format_duration(now - self.sink.current_since)} elapsed"
        self.sink.emit(text)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.beat()

    def start(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._run, name="quantkit-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
