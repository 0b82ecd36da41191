"""The comparison of a batch: one row per job (and per unquantized model) as markdown, CSV and JSON,
and a PNG of perplexity and KL divergence against bits per weight and size on disk.

Pareto front: a job is on it when no other finished job of the same model is at least as good on both
axes (fewer bits per weight, lower perplexity or KL) and better on one. The table marks the fronts
against bits per weight; the plot draws them for each pair of axes.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from quantkit.batch.pareto import SAME_X_REL, pareto_front, quality_columns  # noqa: F401  (re-exported)
from quantkit.batch.records import read_record, read_results, write_json_atomic
from quantkit.config import QuantkitError

ORDER_FILE = "jobs.json"
# Columns that differ from run to run for the same jobs; left out when tables are compared.
VOLATILE = ("seconds", "peak_host_mib", "peak_device_mib")


def ppl_column(source: str) -> str:
    return f"ppl {Path(source).name}"


def _row(result, model_label: str) -> dict[str, Any]:
    s = result.settings
    kld = result.kld or {}
    row = {
        "job": result.name, "model": model_label, "method": s.get("method"), "bits": s.get("bits"),
        "group_size": s.get("group_size"), "sym": s.get("sym"), "bits_per_weight": result.bits_per_weight,
        "size_mib": result.size_bytes / 2**20 if result.size_bytes else None,
    }
    row.update({ppl_column(k): v for k, v in result.perplexity.items()})
    row.update({"kl_mean": kld.get("mean_kld"), "kl_p99": kld.get("p99_kld"),
                "top1_changed_pct": 100 * kld["top1_changed"] if "top1_changed" in kld else None,
                "seconds": result.seconds,
                "peak_host_mib": result.peak_host_bytes / 2**20 if result.peak_host_bytes else None,
                "peak_device_mib": result.peak_device_bytes / 2**20 if result.peak_device_bytes else None,
                "status": "ok" if result.ok else f"failed: {result.error}", "pareto": ""})
    return row


def _model_label(model: str) -> str:
    return Path(model).name.removesuffix(".gguf")


def table_rows(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of a batch folder: unquantized baselines first, then jobs in the batch's order."""
    output_dir = Path(output_dir)
    baselines, results = read_results(output_dir)
    if not results and not baselines:
        raise QuantkitError(f"{output_dir} holds no batch results (no records/*.json); run `quantkit batch` first")
    order = read_record(output_dir / ORDER_FILE) or []
    rank = {name: i for i, name in enumerate(order)}
    results.sort(key=lambda r: (rank.get(r.name, len(rank)), r.name))
    rows = []
    for base in baselines:
        row = {"job": "unquantized", "model": _model_label(base["model"]), "method": "none", "bits": None,
               "group_size": None, "sym": None, "bits_per_weight": None, "size_mib": None}
        row.update({ppl_column(k): v for k, v in base["perplexity"].items()})
        row.update({"kl_mean": 0.0, "kl_p99": 0.0, "top1_changed_pct": 0.0, "status": "ok", "pareto": ""})
        rows.append(row)
    rows += [_row(r, _model_label(r.settings.get("model", "?"))) for r in results]
    _mark_pareto(rows)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    tail = [k for k in ("seconds", "peak_host_mib", "peak_device_mib", "status", "pareto") if k in keys]
    columns = [k for k in keys if k not in tail] + tail
    return [{c: row.get(c) for c in columns} for row in rows]


def _mark_pareto(rows: list[dict[str, Any]]) -> None:
    for model in {r["model"] for r in rows}:
        jobs = [r for r in rows if r["model"] == model and r["status"] == "ok" and r["bits_per_weight"] is not None]
        for column in [c for c in rows[0] if c.startswith("ppl ")][:1] + ["kl_mean"]:
            usable = [r for r in jobs if r.get(column) is not None]
            for i in pareto_front([(r["bits_per_weight"], r[column]) for r in usable]):
                tag = "kl" if column == "kl_mean" else "ppl"
                usable[i]["pareto"] = ",".join(filter(None, [usable[i]["pareto"], tag]))


def _cell(value: Any, column: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if column in ("kl_mean", "kl_p99"):
            return f"{value:.5f}"
        if column == "bits_per_weight":
            return f"{value:.3f}"
        return f"{value:.2f}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]], *, volatile: bool = True) -> str:
    columns = [c for c in rows[0] if volatile or c not in VOLATILE] if rows else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c], c) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def csv_table(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else [])
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_report(output_dir: str | Path, *, plot: bool = True) -> dict[str, Path]:
    """``report.md``, ``report.csv``, ``report.json`` and (with matplotlib) ``report.png`` in ``output_dir``."""
    output_dir = Path(output_dir)
    rows = table_rows(output_dir)
    paths = {"md": output_dir / "report.md", "csv": output_dir / "report.csv", "json": output_dir / "report.json"}
    for kind, text in (("md", markdown_table(rows) + "\n"), ("csv", csv_table(rows))):
        partial = paths[kind].with_name(paths[kind].name + ".partial")
        partial.write_text(text)
        partial.replace(paths[kind])
    write_json_atomic(paths["json"], rows)
    if plot:
        try:
            from quantkit.batch.plot import plot_report
        except ImportError:  # matplotlib is optional
            return paths
        paths["png"] = plot_report(rows, output_dir / "report.png")
    return paths


def write_order(output_dir: Path, names: list[str]) -> None:
    write_json_atomic(Path(output_dir) / ORDER_FILE, names)


def rows_as_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=2)
