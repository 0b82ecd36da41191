"""Launch the small-layer M = 1 kernels side by side, for Nsight Compute to compare (one Hopper GPU).

    ncu --clock-control none -k "regex:_w4a16_gemv_kernel|tinygemm|int4" --launch-skip 4 -c 4 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python3 bench/debug/ncu_small_layer.py --shape 4096x4096

Runs our direct GEMV with one fixed config (so no tuning launches) and PyTorch's int4 kernel
(``torch._weight_int4pack_mm``) on the same shape, alternately, ``--launches`` times each: 4096 x 4096 at
M = 1 is the one cell where PyTorch's kernel is faster (bench/NOTES_w4a16.md, runs 19-33).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_w4a16 import GROUP, make_weights, torch_int4_weights  # noqa: E402

from quantkit.kernels import w4a16 as kw  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x4096", help="NxK")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--config", default="BLOCK_N=8,BLOCK_K=512,PIPE=3,num_warps=4,num_stages=3")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    cfg = {key: int(v) for key, v in (item.split("=") for item in args.config.split(","))} | {"SPLIT_K": 1}
    w = make_weights(n, k)
    packed, scales_zeros = torch_int4_weights(n, k)
    x = torch.randn(args.m, k, device="cuda").bfloat16()
    for _ in range(args.launches):
        kw._gemv_matmul(x, w, cfg, True, direct=True)
        torch._weight_int4pack_mm(x, packed, GROUP, scales_zeros)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
