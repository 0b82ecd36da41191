"""Plot a kernel benchmark's JSON (no GPU needed): the W4A16 GEMM or the attention table.

    python bench/plot_results.py bench/results/w4a16_gemm_h200.json [more.json ...]

Writes a PNG beside each JSON (same name, ``.png``). The benchmarks call the same functions at the
end of a run when matplotlib is installed (``pip install -e ".[plot]"``). The benchmarks' JSON schemas are
known here only, not in the library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def plot_file(json_path: str | Path) -> Path:
    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    png = json_path.with_suffix(".png")
    if "rows" in result and result["rows"] and "cublas_us" in result["rows"][0]:
        return plot_w4a16_bench(result, png)
    if result.get("prefill"):
        return plot_attention_bench(result, png)
    raise ValueError(f"{json_path}: neither a bench_w4a16 result (rows) nor a bench_attention one (prefill)")


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
    from matplotlib.figure import Figure  # a bare Figure renders with Agg, no pyplot state

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
    from matplotlib.figure import Figure

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


def plot_after_run(json_path: str | Path) -> None:
    """For the benchmarks: the plot if matplotlib is there, else a line saying how to get it."""
    try:
        print("wrote", plot_file(json_path))
    except ImportError:
        print(f"no plot (matplotlib is not installed); later: python bench/plot_results.py {json_path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="bench_w4a16.py or bench_attention.py result files")
    args = ap.parse_args(argv)
    for path in args.json:
        try:
            print("wrote", plot_file(path))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
