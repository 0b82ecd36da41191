"""Runs the quantkit command line with the FP8 GEMV-on-codes table (``kernels/gemv.py``'s ``TUNED_FP8_CODES``)
extended, in this process only, by the M = 1 picks of a ``bench/tune_fp8_gemv.py --path codes`` run: the whole
decode step is timed with a tuner's picks before any of them goes into the shipped table (gpu_check.sh's
``fp8-codes`` mode runs it beside the command without them).

    python3 bench/lib/with_fp8_codes_table.py TUNE_JSON bench --shape llama3-8b --formats fp8 ...
"""

from __future__ import annotations

import json
import sys


def picks(tune: dict) -> dict:
    """``{(card, N, K): DenseGemvConfig}`` from the tuner's JSON: each M = 1 cell's confirmed fastest config."""
    from quantkit.kernels.gemv import DenseGemvConfig

    if tune.get("path") != "codes":
        raise SystemExit(f"with_fp8_codes_table: the JSON is a --path {tune.get('path')} run, not --path codes")
    out = {}
    for cell in tune["cells"]:
        if cell["M"] == 1 and "best" in cell:
            bn, bk, warps, prefetch = cell["best"]["cfg"]
            out[(tune["card"], cell["N"], cell["K"])] = DenseGemvConfig(bn, bk, warps, prefetch=bool(prefetch))
    return out


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    with open(argv[0]) as f:
        entries = picks(json.load(f))
    from quantkit.kernels import gemv

    gemv.TUNED_FP8_CODES.update(entries)
    for key, cfg in entries.items():
        print(f"with_fp8_codes_table: {key} -> {cfg}", flush=True)
    from quantkit.cli.app import main as cli_main

    sys.argv = ["quantkit", *argv[1:]]
    cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])
