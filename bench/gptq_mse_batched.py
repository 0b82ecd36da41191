"""The static-group MSE range search, one group at a time (before) against every group at once (after).

On the Llama-3-8B linears of one layer (q/k/v stacked [6144, 4096], o [4096, 4096], gate/up stacked
[28672, 4096], down [4096, 14336]) with the GPTQ defaults' search (sym g128, shrink grid 100 up to 20 %,
Hessian-weighted, norm 2): seconds of each and whether the scales and zeros are bitwise equal (how many
(row, group) entries differ if not). Random bf16 weights N(0, 0.02) with outlier columns; column weights
shaped like a Hessian diagonal (a few large). Prints a table and writes JSON.

    python bench/gptq_mse_batched.py --out bench/results/gptq_mse_batched_h200.json     # on the GPU
    python bench/gptq_mse_batched.py --tiny                                             # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from quantkit.config import QuantScheme
from quantkit.methods.gptq import GPTQConfig, _static_params_loop
from quantkit.methods.gptq_mse import static_group_qparams

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SHAPES_TINY = {"qkv": (96, 256), "down": (64, 512)}


def problem(rows: int, cols: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g, device=device) * 0.02).bfloat16().float()
    w[:, :: max(1, cols // 16)] *= 8  # outlier columns
    diag = torch.rand(cols, generator=g, device=device).pow(6) * 100 + 0.01
    return w, (diag / diag.mean()).float()


def timed(fn, device: torch.device) -> tuple[float, tuple]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shapes = SHAPES_TINY if args.tiny else SHAPES_8B
    rows = []
    for sym in (True, False):
        scheme = QuantScheme(4, 128, sym)
        config = GPTQConfig(desc_act=True, static_groups=True, mse=True, mse_weight="hessian")
        for i, (name, (n, k)) in enumerate(shapes.items()):
            w, cw = problem(n, k, device, seed=i)
            static_group_qparams(w[:256], scheme, config, 128, cw)  # warm-up
            t_old, (s0, z0) = timed(lambda: _static_params_loop(w, scheme, config, 128, cw), device)
            t_new, (s1, z1) = timed(lambda: static_group_qparams(w, scheme, config, 128, cw), device)
            differ = int(((s0 != s1) | (z0 != z1)).sum())
            rows.append({"linear": name, "shape": [n, k], "sym": sym, "seconds_loop": round(t_old, 4),
                         "seconds_batched": round(t_new, 4), "bitwise_equal": differ == 0,
                         "entries_differing": differ, "entries": s0.numel()})
            print(f"{name:8s} {str([n, k]):14s} {'sym ' if sym else 'asym'} loop {t_old:7.3f} s  batched {t_new:7.3f} s"
                  f"  equal {differ == 0} ({differ} of {s0.numel()} differ)", flush=True)
    layer = {sym: (sum(r["seconds_loop"] for r in rows if r["sym"] == sym),
                   sum(r["seconds_batched"] for r in rows if r["sym"] == sym)) for sym in (True, False)}
    print(f"one layer, sym: loop {layer[True][0]:.2f} s -> batched {layer[True][1]:.3f} s")
    record = {"what": "static-group MSE search per 8B layer, loop vs batched (quantkit.methods.gptq_mse)",
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "config": "GPTQ defaults: sym g128 (and asym g128), desc_act, static_groups, mse hessian, grid 100",
              "rows": rows, "layer_seconds_sym": {"loop": layer[True][0], "batched": layer[True][1]}}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
