"""Progress when the output is not a terminal: throttled k/n lines, a heartbeat, no bar fragments (issue #37)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys

from quantkit.progress_lines import Heartbeat, LineSink, ThrottledPhase

# A rich bar's pieces: carriage returns, ANSI sequences, block glyphs, and runs of ━ outside a table's
# heavy header rule (┏━━┳━━┓ and ┡━━╇━━┩ are table borders, not bars).
BAR_GLYPHS = re.compile("[\r\x1b█▏▎▍▌▋▊▉╸╺]|^[^┏┡\n]*━", re.MULTILINE)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sink() -> tuple[LineSink, list[str], FakeClock]:
    clock, lines = FakeClock(), []
    return LineSink(lines.append, clock), lines, clock


def test_a_phase_writes_at_most_every_interval_and_closes_once():
    sink, lines, clock = _sink()
    phase = ThrottledPhase(sink, "gptq", 30, "layers", interval=20)
    for k in range(1, 30):  # one layer every 3 s: 87 s of work
        clock.now += 3
        phase.update(k)
    assert len(lines) == 4  # at 21, 42, 63 and 84 s: never more often than every 20 s
    assert lines[0] == "gptq: 7/30 layers (23%), 21 s elapsed, about 1 min 09 s left"
    clock.now += 3
    phase.update(30, extra="peak 1.0 GiB")
    assert lines[-1] == "gptq: 30/30 layers in 1 min 30 s, peak 1.0 GiB"
    phase.update(30)
    phase.close()
    assert len(lines) == 5


def test_a_short_phase_writes_only_its_closing_line_and_close_ends_a_phase_early():
    sink, lines, clock = _sink()
    phase = ThrottledPhase(sink, "perplexity", 40, "windows", interval=20)
    clock.now += 5
    phase.update(3)
    phase.close()
    assert lines == ["perplexity: 3/40 windows in 5 s"]


def test_heartbeat_names_the_running_phase_after_silence():
    sink, lines, clock = _sink()
    beat = Heartbeat(sink, every=30)
    sink.announce("loading")
    clock.now += 29
    assert not beat.beat()
    clock.now += 1
    assert beat.beat() and lines == ["loading: still running, 30 s elapsed"]
    assert not beat.beat()  # the line just written resets the silence
    phase = ThrottledPhase(sink, "self-calibration", 1000, "tokens", interval=20)
    clock.now += 10
    phase.update(100)  # not yet 20 s since the phase began: no line
    clock.now += 30
    assert beat.beat()
    assert lines[-1] == "self-calibration: 100/1000 tokens (10%), 40 s elapsed, about 6 min 00 s left"


def test_plain_view_logs_and_phases_without_bar_fragments():
    from rich.console import Console

    from quantkit.cli.display import library_logs
    from quantkit.cli.progress_view import ProgressView

    buffer = io.StringIO()
    con = Console(file=buffer, width=80)
    clock = FakeClock()
    view = ProgressView(con, clock=clock, interval=20, heartbeat=30)
    assert view.plain  # a StringIO is no terminal
    with view, library_logs(view):
        logging.getLogger("quantkit.test").info("loading: whole model in memory")
        logging.getLogger("quantkit.test").warning("a partial group")
        task = view.phase("gptq", 4, "layers")
        for k in range(1, 5):
            clock.now += 15
            view.update(task, k, extra="peak 2.0 GiB")
    text = buffer.getvalue()
    assert not BAR_GLYPHS.search(text), repr(text)
    assert text.splitlines() == [
        "loading: whole model in memory",
        "warning: a partial group",
        "gptq: 2/4 layers (50%), 30 s elapsed, about 30 s left, peak 2.0 GiB",
        "gptq: 4/4 layers in 1 min 00 s, peak 2.0 GiB",
    ]


def test_redirected_quantize_and_eval_logs_hold_plain_lines(tiny_llama_dir, tiny_text_file, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TERM="xterm-256color")
    log = tmp_path / "run.log"
    out = tmp_path / "q"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "gptq", str(tiny_llama_dir), "-o", str(out),
                               "--calib", str(tiny_text_file), "--nsamples", "4", "--seqlen", "32"],
                              stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600)
        assert proc.returncode == 0, log.read_text()
        proc = subprocess.run([sys.executable, "-m", "quantkit.cli.app", "eval", "perplexity", str(out), "--data",
                               str(tiny_text_file), "--seqlen", "32", "--max-windows", "3"],
                              stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600)
        assert proc.returncode == 0, log.read_text()
    text = log.read_text()
    assert not BAR_GLYPHS.search(text), repr(text)
    lines = text.splitlines()
    assert lines[0] == "threads: 1 (OMP_NUM_THREADS)"
    assert "layers: 2 decoder layers to quantize on cpu" in lines  # a heartbeat during layer 1 names it
    assert any(re.fullmatch(r"gptq: 2/2 layers in \d+ s", line) for line in lines), text
    assert any(re.fullmatch(r"perplexity: 3/3 windows in \d+ s, ppl [\d.]+", line) for line in lines), text
    assert sum(line.startswith("layer ") for line in lines) == 2


def test_terminal_view_draws_rich_bars_with_the_same_calls():
    from rich.console import Console

    from quantkit.cli.display import library_logs
    from quantkit.cli.progress_view import ProgressView

    buffer = io.StringIO()
    con = Console(file=buffer, width=100, force_terminal=True)
    view = ProgressView(con)
    assert not view.plain
    with view, library_logs(view):
        logging.getLogger("quantkit.test").info("loading: a model")
        task = view.phase("gptq", 2, "layers")
        view.print("layer 1/2    0.1s")
        view.update(task, 2, extra="peak 1.0 GiB")
        view.close(task)
    text = buffer.getvalue()
    assert "━" in text and "2/2" in text and "layer 1/2" in text and "loading: a model" in text
