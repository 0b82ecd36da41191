"""Plots of what a person would rather look at than read (matplotlib, imported lazily by callers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A bare Figure (no pyplot) renders to files with Agg and touches no global backend state.
from matplotlib.figure import Figure

_ERROR_KEYS = (("err_rtn", "err_gptq"), ("err_before", "err_after"), (None, "weight_error"))


def _series(layer_stats: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{linear short name: {"before"/"after": [(layer, error)]}} from the walker's per-layer stats."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in layer_stats:
        for name, stats in row.get("linears", {}).items():
            for before_key, after_key in _ERROR_KEYS:
                if after_key in stats:
                    entry = out.setdefault(name.split(".")[-1], {"before": [], "after": []})
                    entry["after"].append((row["layer"], float(stats[after_key])))
                    if before_key and before_key in stats:
                        entry["before"].append((row["layer"], float(stats[before_key])))
                    break
    return out


def plot_layer_errors(layer_stats: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """One line per linear kind (q_proj, ..., down_proj): relative error by layer; dashed = before (RTN)."""
    path = Path(path)
    series = _series(layer_stats)
    fig = Figure(figsize=(9, 4.5), dpi=120)
    ax = fig.subplots()
    for i, (name, data) in enumerate(sorted(series.items())):
        color = f"C{i % 10}"
        if data["after"]:
            xs, ys = zip(*data["after"])
            ax.plot(xs, ys, "-o", color=color, markersize=3, label=name)
        if data["before"]:
            xs, ys = zip(*data["before"])
            ax.plot(xs, ys, "--", color=color, alpha=0.5)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("relative output error")
    ax.set_yscale("log")
    ax.set_title(title + ("  (dashed: round-to-nearest)" if any(d["before"] for d in series.values()) else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    return path
