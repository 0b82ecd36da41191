"""What GPTQ's ``--mse`` adds to a run on SmolLM2-135M: the range search of every group's scale.

``--mse`` changes nothing else in GPTQ (the Hessian and the solve are the same), so its cost is the
time of ``group_qparams`` with the search minus without, over every group of every quantized linear
of the model (30 layers of q/k/v/o/gate/up/down at SmolLM2's shapes). Measured as CPU time of this
process (robust to other jobs on a shared machine) and wall time, one torch thread.

    python bench/mse_cost_smollm2.py [--group-size 64] [--repeats 3]

Prints a table and writes bench/runs/mse_cost_smollm2_<date>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from quantkit.config import QuantScheme
from quantkit.methods.gptq import GPTQConfig, group_qparams

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query heads and 3 KV heads of 64. (out, in) per linear.
LAYER_SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
                "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}
N_LAYERS = 30


def time_all_groups(weights: dict[str, torch.Tensor], scheme: QuantScheme, config: GPTQConfig) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of group_qparams over every group of ``weights``."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for w in weights.values():
        for start in range(0, w.shape[1], scheme.group_size):
            group_qparams(w[:, start:start + scheme.group_size], scheme, config)
    return time.process_time() - cpu0, time.perf_counter() - wall0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in LAYER_SHAPES.items()}
    rows = []
    for sym in (True, False):
        scheme = QuantScheme(4, args.group_size, sym)
        per_layer = {}
        for mse in (False, True):
            runs = [time_all_groups(weights, scheme, GPTQConfig(mse=mse)) for _ in range(args.repeats)]
            per_layer[mse] = min(runs)  # least disturbed run
        added_cpu = (per_layer[True][0] - per_layer[False][0]) * N_LAYERS
        added_wall = (per_layer[True][1] - per_layer[False][1]) * N_LAYERS
        rows.append({"sym": sym, "group_size": args.group_size,
                     "layer_cpu_s_minmax": per_layer[False][0], "layer_cpu_s_mse": per_layer[True][0],
                     "model_added_cpu_s": added_cpu, "model_added_wall_s": added_wall})
    print(f"{'grid':<6}{'g':>4}{'minmax/layer':>14}{'mse/layer':>11}{'added, 30 layers':>18}")
    for r in rows:
        print(f"{'sym' if r['sym'] else 'asym':<6}{r['group_size']:>4}{r['layer_cpu_s_minmax']:>13.3f}s"
              f"{r['layer_cpu_s_mse']:>10.3f}s{r['model_added_cpu_s']:>16.1f} s CPU")
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = Path(__file__).parent / "runs" / f"mse_cost_smollm2_{date}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "what": "CPU time GPTQ --mse adds on SmolLM2-135M shapes: group_qparams with vs without the range search "
                "over every group of the 30 decoder layers (the rest of GPTQ is unchanged by --mse)",
        "machine": f"{platform.machine()} {platform.processor() or ''} (shared CPU, 1 torch thread)".strip(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": f"python bench/mse_cost_smollm2.py --group-size {args.group_size} --repeats {args.repeats}",
        "rows": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
