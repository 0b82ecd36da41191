"""PNG of a batch report: perplexity and KL divergence against bits per weight and size on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from quantkit.batch.pareto import pareto_front, quality_columns  # noqa: E402

_X_AXES = (("bits_per_weight", "bits per weight (quantized linears)"), ("size_mib", "size on disk (MiB)"))
_COLORS = {"rtn": "tab:gray", "gptq": "tab:blue", "awq": "tab:orange"}


def plot_report(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """One subplot per (quality metric, x axis); a point per finished job, the Pareto front drawn
    as a line with ringed points, the unquantized model's perplexity as a dashed line."""
    metrics = quality_columns(rows)
    jobs = [r for r in rows if r["status"] == "ok" and r["method"] != "none"]
    fig, axes = plt.subplots(len(metrics), len(_X_AXES), figsize=(6 * len(_X_AXES), 3.6 * len(metrics)),
                             squeeze=False)
    for i, metric in enumerate(metrics):
        for j, (x_key, x_label) in enumerate(_X_AXES):
            _panel(axes[i][j], rows, jobs, x_key, metric)
            axes[i][j].set_xlabel(x_label)
            axes[i][j].set_ylabel("mean KL divergence (nats)" if metric == "kl_mean" else metric)
    fig.suptitle("quantkit batch: quality against size (Pareto front ringed)")
    fig.tight_layout()
    path = Path(path)
    partial = path.with_name(path.name + ".partial.png")
    fig.savefig(partial, dpi=110)
    plt.close(fig)
    partial.replace(path)
    return path


def _panel(ax, rows, jobs, x_key: str, metric: str) -> None:
    usable = [r for r in jobs if r.get(x_key) is not None and r.get(metric) is not None]
    for method in dict.fromkeys(r["method"] for r in usable):
        points = [r for r in usable if r["method"] == method]
        ax.scatter([r[x_key] for r in points], [r[metric] for r in points], label=method,
                   color=_COLORS.get(method), zorder=3)
    for r in usable:
        label = f"w{r['bits']} g{r['group_size']}"
        ax.annotate(label, (r[x_key], r[metric]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    for model in dict.fromkeys(r["model"] for r in usable):
        mine = [r for r in usable if r["model"] == model]
        front = sorted((mine[i] for i in pareto_front([(r[x_key], r[metric]) for r in mine])), key=lambda r: r[x_key])
        ax.plot([r[x_key] for r in front], [r[metric] for r in front], color="tab:green", lw=1, zorder=2,
                drawstyle="steps-post")
        ax.scatter([r[x_key] for r in front], [r[metric] for r in front], s=160, facecolors="none",
                   edgecolors="tab:green", zorder=4, label="Pareto front" if model == usable[0]["model"] else None)
    if metric != "kl_mean":
        for base in (r for r in rows if r["method"] == "none" and r.get(metric) is not None):
            ax.axhline(base[metric], color="black", ls="--", lw=0.8, label=f"unquantized {base[metric]:.2f}")
    ax.grid(alpha=0.3)
    if usable:
        ax.legend(fontsize=7)
