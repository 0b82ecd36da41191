"""Summarize where a kernel's warps stall, from Nsight Compute's per-instruction source page.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python3 bench/debug/ncu_stalls.py source.csv [--top 30] [--range 640:1060]

Prints the stall reasons summed over all instructions (or over the SASS line range given, e.g. one
loop's body), then the instructions with the most samples, each with its three largest reasons. Plain
Python (csv only), so it runs on the CPU machine on a report fetched from the GPU one.

Reading it: with warp specialization the idle warps of a partition's warpgroup sit at
``USETMAXREG.DEALLOC`` for the whole kernel and show up as "barrier" samples; they issue nothing, so leave
them out (``--range``) before calling a kernel barrier-bound.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def load(path: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path)))
    header_at = next(i for i, row in enumerate(rows) if SAMPLES in row)
    return rows[header_at], rows[header_at + 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source_csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--range", default=None, help="first:last SASS line (0-based, as printed) to sum over")
    args = ap.parse_args()
    header, data = load(args.source_csv)
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def count(row, name):
        value = row[col[name]].replace(",", "")
        return int(value) if value.isdigit() else 0

    lo, hi = (int(v) for v in args.range.split(":")) if args.range else (0, len(data))
    picked = list(enumerate(data))[lo:hi]
    totals = collections.Counter()
    for _, row in picked:
        for name in reasons:
            totals[name] += count(row, name)
    all_samples = sum(totals.values()) or 1
    print(f"{sum(count(row, SAMPLES) for _, row in picked)} samples over lines {lo}:{hi}")
    for name, n in totals.most_common(12):
        print(f"  {name:26s} {n:7d} {100 * n / all_samples:5.1f} %")
    print("top instructions (line, samples, SASS, executions, largest reasons):")
    ranked = sorted(picked, key=lambda item: count(item[1], SAMPLES), reverse=True)
    for line, row in ranked[:args.top]:
        top = sorted(((count(row, name), name) for name in reasons), reverse=True)[:3]
        why = ", ".join(f"{name[6:]} {n}" for n, name in top if n)
        print(f"{line:5d} {count(row, SAMPLES):6d}  {row[col['Source']].strip()[:58]:58s} "
              f"x{row[col['Instructions Executed']]:>8s}  {why}")


if __name__ == "__main__":
    main()
