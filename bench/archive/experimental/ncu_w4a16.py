"""Launch the Gluon W4A16 kernel with one fixed config, for a profiler to read (one Hopper GPU).

    ncu --clock-control none -k regex:_w4a16_gluon_kernel --launch-skip 2 -c 1 --set full \
        -o w4a16 python3 bench/debug/ncu_w4a16.py --shape 28672x8192 --m 1 \
        --config BLOCK_N=256,BLOCK_M=16,NUM_BUF=4,num_warps=4,CTAS_PER_SM=2

The config is passed explicitly so that no tuning launches run; the first two launches compile and
warm up, the profiler reads the third. Without a profiler the script prints the relative error and
the graph-timed microseconds of the config (L2 evicted), which is a quick check by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_w4a16 import make_weights  # noqa: E402
from gpu_timing import gpu_time_us, l2_evict_buffer  # noqa: E402  (bench/)

from quantkit.kernels import w4a16 as kw  # noqa: E402
from quantkit.kernels import w4a16_gluon as kg  # noqa: E402


def parse_fields(text: str) -> dict:
    """``"BLOCK_N=256,WGMMA=1"`` -> GluonConfig fields (the boolean ones, those with a bool default, from 0/1)."""
    flags = {f.name for f in dataclasses.fields(kg.GluonConfig) if isinstance(f.default, bool)}
    fields = {}
    for item in text.split(","):
        key, value = item.split("=")
        fields[key] = value in ("True", "true", "1") if key in flags else int(value)
    return fields


def parse_config(text: str) -> kg.GluonConfig:
    return kg.GluonConfig(**parse_fields(text))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="28672x8192", help="NxK")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--config", default="BLOCK_N=256,BLOCK_M=16,NUM_BUF=4,num_warps=4,CTAS_PER_SM=2")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--time", action="store_true", help="also graph-time the config (not under a profiler)")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    cfg = parse_config(args.config)
    w = make_weights(n, k)
    x = torch.randn(args.m, k, device="cuda").bfloat16()
    for _ in range(args.launches):
        out = kg.w4a16_gluon_matmul(x, w, cfg)
    torch.cuda.synchronize()
    ref = kw.w4a16_matmul_ref(x, w).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    line = f"{args.shape} M={args.m} {cfg}: rel err {err:.2e}"
    if args.time:
        line += f", {gpu_time_us(lambda: kg._launch(x, w, cfg), l2_evict_buffer(x.device)):.1f} us"
    print(line)


if __name__ == "__main__":
    main()
