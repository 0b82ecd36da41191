"""Plot a kernel benchmark's JSON (no GPU needed): the W4A16 GEMM or the attention table.

    python bench/plot_results.py bench/results/w4a16_h200_run19.json [more.json ...]

Writes a PNG beside each JSON (same name, ``.png``). The benchmarks call the same functions at the
end of a run when matplotlib is installed (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plot_file(json_path: str | Path) -> Path:
    from quantkit.plots import plot_attention_bench, plot_w4a16_bench

    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    png = json_path.with_suffix(".png")
    if "rows" in result and result["rows"] and "cublas_us" in result["rows"][0]:
        return plot_w4a16_bench(result, png)
    if result.get("prefill"):
        return plot_attention_bench(result, png)
    raise ValueError(f"{json_path}: neither a bench_w4a16 result (rows) nor a bench_attention one (prefill)")


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
