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


def _number(value) -> float | None:
    """A timing cell of a bench JSON: a float, or a string saying why it did not run (None)."""
    return float(value) if isinstance(value, (int, float)) else None


def plot_w4a16_bench(result: dict[str, Any], path: str | Path) -> Path:
    """``bench/bench_w4a16.py``'s JSON as one panel per weight shape (us per call against M, log-log:
    quantkit, cuBLAS bf16, PyTorch int4) and a last panel of the speedup over cuBLAS for every shape,
    with the issue's lines (3x at M <= 16, 0.8x at M >= 1024)."""
    path = Path(path)
    shapes = sorted({(r["N"], r["K"]) for r in result["rows"]}, key=lambda s: s[0] * s[1])
    peers = (("triton_us", "quantkit", "C0"), ("cublas_us", "cuBLAS bf16", "C1"), ("torch_int4_us", "torch int4", "C2"))
    cols = 3
    rows = -(-(len(shapes) + 1) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows), dpi=110)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (n, k) in zip(axes, shapes):
        cells = sorted((r for r in result["rows"] if (r["N"], r["K"]) == (n, k)), key=lambda r: r["M"])
        for key, label, color in peers:
            pts = [(r["M"], _number(r.get(key))) for r in cells if _number(r.get(key))]
            if pts:
                ax.plot(*zip(*pts), "-o", color=color, markersize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"N x K = {n} x {k}", fontsize=9)
        ax.set_xlabel("M (activation rows)", fontsize=8)
        ax.set_ylabel("us per call", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    ax = axes[len(shapes)]
    for i, (n, k) in enumerate(shapes):
        cells = sorted((r for r in result["rows"] if (r["N"], r["K"]) == (n, k)), key=lambda r: r["M"])
        pts = [(r["M"], r["cublas_us"] / r["triton_us"]) for r in cells
               if _number(r.get("cublas_us")) and _number(r.get("triton_us"))]
        if pts:
            ax.plot(*zip(*pts), "-o", color=f"C{i}", markersize=3, label=f"{n} x {k}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.plot([1, 16], [3, 3], "k--", linewidth=0.8)
    ax.plot([1024, 4096], [0.8, 0.8], "k--", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_title("speedup over cuBLAS bf16 (dashed: targets)", fontsize=9)
    ax.set_xlabel("M (activation rows)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for ax in axes[len(shapes) + 1:]:
        ax.set_visible(False)
    fig.suptitle(f"W4A16 GEMM, group {result.get('group_size', '?')}, {result.get('card', '')} "
                 f"({result.get('date', '')[:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_attention_bench(result: dict[str, Any], path: str | Path) -> Path:
    """``bench/bench_attention.py``'s prefill table as TFLOP/s against sequence length, one panel per
    head configuration; solid non-causal, dashed causal; the issue's 500 TFLOP/s line."""
    path = Path(path)
    rows = result["prefill"]
    heads = sorted({(r["hq"], r["hkv"], r["head_dim"]) for r in rows}, key=lambda h: (h[2], h[0], h[1]))
    series = (("ours_ws", "quantkit bf16", "C0"), ("ours_fp8", "quantkit fp8", "C3"), ("ours", "quantkit auto", "C4"),
              ("cudnn", "SDPA cuDNN", "C1"), ("flash", "SDPA flash", "C2"), ("efficient", "SDPA efficient", "C5"))
    fig = Figure(figsize=(5.0 * max(len(heads), 1), 3.8), dpi=110)
    axes = fig.subplots(1, max(len(heads), 1), squeeze=False).ravel()
    for ax, (hq, hkv, d) in zip(axes, heads):
        for causal, style in ((False, "-o"), (True, "--s")):
            cells = sorted((r for r in rows if (r["hq"], r["hkv"], r["head_dim"], bool(r["causal"])) ==
                            (hq, hkv, d, causal)), key=lambda r: r["seqlen"])
            for key, label, color in series:
                pts = [(r["seqlen"], _number(r.get(key))) for r in cells if _number(r.get(key))]
                if pts:
                    ax.plot(*zip(*pts), style, color=color, markersize=3,
                            label=None if causal else label)
        ax.axhline(500, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{hq} q / {hkv} kv heads, head dim {d}", fontsize=9)
        ax.set_xlabel("sequence length (16384 tokens a batch)", fontsize=8)
        ax.set_ylabel("TFLOP/s (dashed: causal)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"attention forward, {result.get('card', '')} ({str(result.get('date', ''))[:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path
