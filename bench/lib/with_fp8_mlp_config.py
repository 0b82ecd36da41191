"""Runs the quantkit command line with the one-launch FP8 MLP on (``QUANTKIT_FP8_MLP=fused``) and its config
table (``kernels/fp8_mlp.py``'s ``TUNED_FP8_MLP``) given, in this process only, the fastest config of a
``bench/bench_fp8_mlp.py`` run for its card and shape: the whole decode step is timed with it before it goes into
the shipped table (gpu_check.sh's ``fp8-mlp`` mode runs it beside the command without it).

    python3 bench/lib/with_fp8_mlp_config.py MLP_JSON bench --shape llama3-8b --formats fp8 ...
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    with open(argv[0]) as f:
        run = json.load(f)
    if not run.get("best"):
        raise SystemExit(f"with_fp8_mlp_config: {argv[0]} has no config that ran")
    from quantkit.kernels import fp8_mlp

    key = (run["card"]["gpu"], run["shape"]["K"], run["shape"]["I"])
    fp8_mlp.TUNED_FP8_MLP[key] = fp8_mlp.FP8MlpConfig(**run["best"])
    print(f"with_fp8_mlp_config: {key} -> {fp8_mlp.TUNED_FP8_MLP[key]}", flush=True)
    os.environ["QUANTKIT_FP8_MLP"] = "fused"
    from quantkit.cli.app import main as cli_main

    sys.argv = ["quantkit", *argv[1:]]
    cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])
