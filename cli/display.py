"""Human output: live layer progress, summary tables, the per-layer error plot."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quantkit.cli.progress_view import ProgressView
from quantkit.progress import format_layer_line, quantkit_logs_to

# Width of a console that is not a terminal (a log file, a pipe) when COLUMNS does not set one: wide
# enough that tables keep whole numbers and names instead of cutting them at rich's default 80.
REDIRECTED_WIDTH = 240


def console(stderr: bool = False) -> Console:
    con = Console(stderr=stderr)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = Console(stderr=stderr, width=REDIRECTED_WIDTH)
    return con


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@contextlib.contextmanager
def library_logs(target: Console | ProgressView) -> Iterator[None]:
    """Show quantkit's warnings and info lines while a command runs: above the progress bar on a
    terminal, as plain lines otherwise (through ``target``'s view, which its heartbeat then knows)."""
    view = target if isinstance(target, ProgressView) else ProgressView(target)
    with quantkit_logs_to(view.log_handler()):
        yield


class LayerProgress:
    """Progress over decoder layers (layer k of n, ETA, peak memory) and self-calibration, with one
    line per layer: a rich bar on a terminal, throttled plain lines otherwise (``ProgressView``)."""

    def __init__(self, con: Console, method: str, view: ProgressView | None = None) -> None:
        self.console = con
        self.method = method
        self.view = view or ProgressView(con)
        self.task = None
        self.calib_task = None

    def __enter__(self) -> LayerProgress:
        self.view.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.view.__exit__(*exc)

    def on_calibration(self, done: int, total: int) -> None:
        """Self-generated calibration: tokens generated so far."""
        if self.calib_task is None:
            self.calib_task = self.view.phase("self-calibration", total, "tokens")
        self.view.update(self.calib_task, done)

    def on_layer(self, event) -> None:
        if self.task is None:
            self.task = self.view.phase(self.method, event.n_layers, "layers")
        self.view.print(format_layer_line(event))
        for note in event.result.notes:
            self.view.print(f"  note: {note}", style="yellow")
        peak = f"peak {human_bytes(event.peak_memory_bytes)}" if event.peak_memory_bytes else ""
        self.view.update(self.task, event.index + 1, extra=peak)
        if event.index + 1 == event.n_layers:
            self.view.sink.announce("writing the checkpoint")  # what a heartbeat names until the next line


def print_quantize_summary(con: Console, report) -> None:
    table = Table(title=f"quantkit {report.method}: {report.output}", show_header=False)
    table.add_row("scheme", f"W{report.scheme.bits} g{report.scheme.group_size} {'sym' if report.scheme.sym else 'asym'}")
    flags = [name.replace("_", "-") for name, value in report.options.items() if value is True]
    if flags:
        table.add_row("options", ", ".join(flags))
    table.add_row("quantized linears", str(report.n_quantized))
    if getattr(report, "compression_ratio", 0):
        table.add_row("compression (all weights)", f"{report.compression_ratio:.2f}x")
    from quantkit.moe.stats import expert_tokens

    experts = expert_tokens(report.layer_stats)
    if experts:
        routed = sorted(t for r in experts.values() for t in r["routed"])
        rtn = sum(len(r["rtn_fallback"]) for r in experts.values())
        table.add_row("experts", f"{len(routed)} in {len(experts)} layers; routed calibration tokens min {routed[0]}, "
                      f"median {routed[len(routed) // 2]}, max {routed[-1]}; {rtn} rounded to nearest (too few tokens)")
    if getattr(report, "unquantized", None):
        shown = ", ".join(report.unquantized[:4]) + (" ..." if len(report.unquantized) > 4 else "")
        table.add_row("NOT quantized", f"{len(report.unquantized)} weights stay 16-bit: {shown}", style="red")
    table.add_row("time", f"{report.seconds_total:.1f} s (load {report.seconds_load:.1f}, calibration "
                  f"{report.seconds_calibration:.1f}, layers {report.seconds_quantize:.1f}, save {report.seconds_save:.1f})")
    table.add_row("loading", "streamed from disk, layer by layer" if report.streamed else "whole model in memory")
    table.add_row("peak host memory", human_bytes(report.peak_host_memory_bytes))
    table.add_row("peak accelerator memory", human_bytes(report.peak_memory_bytes) if report.peak_memory_bytes else "-")
    if report.partial_group_layers:
        table.add_row("partial last group", f"{len(report.partial_group_layers)} linears (stored through g_idx)")
    for engine, kernel in report.engine_kernels.items():
        table.add_row(f"{engine} kernel", kernel)
    con.print(table)


def save_layer_stats(report, path: Path, con: Console) -> None:
    """Per-layer errors as JSON, and a PNG plot of them beside it when matplotlib is installed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from quantkit.moe.stats import expert_tokens

    experts = expert_tokens(report.layer_stats)
    record = {"summary": report.to_dict(), "layers": report.layer_stats}
    if experts:
        record["expert_tokens"] = experts
    path.write_text(json.dumps(record, indent=2))
    try:
        from quantkit.moe.stats import plot_expert_tokens
        from quantkit.plots import plot_layer_errors
    except ImportError as exc:  # matplotlib is optional
        con.print(f"wrote {path}; no plot ({exc})")
        return
    png = plot_layer_errors(report.layer_stats, path.with_suffix(".png"), title=f"{report.method} per-layer error")
    heat = plot_expert_tokens(report.layer_stats, path.with_suffix(".experts.png"), title=report.method)
    con.print(f"wrote {path} and {png}" + (f" and {heat}" if heat else ""))
