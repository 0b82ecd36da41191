"""How long quantkit takes to unfuse one MoE layer's experts (transformers 5's fused ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` into per-expert linears, which every quantizing method does before the walk on a model
held in memory), beside the same split with linears built the default way (each drawing kaiming-uniform weights
that the copy then overwrites: quantkit did that until 2026-12-07).

The layer is the Qwen3-30B-A3B shape's (128 experts, hidden 2048, expert intermediate 768; ``--experts``,
``--hidden``, ``--inter`` for another), bf16, on the CPU (``--device``), with uninitialised fused weights. The
two ways alternate, ``--repeat`` times each; prints a table and writes JSON (machine, versions, date, threads).

    OMP_NUM_THREADS=2 python bench/moe_unfuse_time.py --out bench/results/moe_unfuse_time_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch
from torch import nn

from quantkit.moe.experts import split_fused

NAMES = ("gate_proj", "up_proj", "down_proj")


class FusedExperts(nn.Module):
    """The attributes ``split_fused`` reads from transformers' fused experts module."""

    def __init__(self, experts: int, hidden: int, inter: int, device: str) -> None:
        super().__init__()
        kw = dict(dtype=torch.bfloat16, device=device)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter, **kw), requires_grad=False)
        self.act_fn = nn.SiLU()


@torch.no_grad()
def split_with_default_init(module: FusedExperts) -> list[nn.Linear]:
    """The baseline: the same copies into linears built by ``nn.Linear`` itself (initialised first)."""
    gu, down = module.gate_up_proj, module.down_proj
    n, two_inter, hidden = gu.shape
    inter = two_inter // 2
    out = []
    for e in range(n):
        kw = dict(bias=False, dtype=gu.dtype, device=gu.device)
        gate, up, dn = nn.Linear(hidden, inter, **kw), nn.Linear(hidden, inter, **kw), nn.Linear(inter, hidden, **kw)
        gate.weight.copy_(gu[e, :inter])
        up.weight.copy_(gu[e, inter:])
        dn.weight.copy_(down[e])
        out += [gate, up, dn]
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--layers", type=int, default=48, help="layers of the whole model, for the projected total")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON path (default: bench/runs/moe_unfuse_time_<date>.json)")
    args = p.parse_args()

    module = FusedExperts(args.experts, args.hidden, args.inter, args.device)
    ways = {"quantkit (split_fused)": lambda: split_fused(module, NAMES),
            "default nn.Linear init, then copy": lambda: split_with_default_init(module)}
    seconds: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeat):
        for name, fn in ways.items():
            seconds[name].append(timed(fn))

    print(f"| one layer: {args.experts} experts, {args.hidden} x {args.inter}, bf16, {args.device}, "
          f"{torch.get_num_threads()} threads | best s | all runs s | x {args.layers} layers |")
    print("|---|---|---|---|")
    for name, runs in seconds.items():
        print(f"| {name} | {min(runs):.2f} | {', '.join(f'{s:.2f}' for s in runs)} | {min(runs) * args.layers:.0f} s |")

    record = {
        "shape": {"experts": args.experts, "hidden": args.hidden, "inter": args.inter, "dtype": "bfloat16"},
        "device": args.device, "threads": torch.get_num_threads(), "layers": args.layers,
        "seconds": seconds, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    out = args.out or f"bench/runs/moe_unfuse_time_{datetime.date.today()}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
