"""Per-tile check of the Gluon W4A16 kernel's stream-K path (one Hopper GPU).

    python bench/debug/stream_k_tiles.py [--shape 28672x8192] [--m 16] [--reps 4]

A race in the stream-K fixup shows as a few wrong output tiles that change from call to call, which an
error norm over the whole output can hide. For every decode config this runs the kernel ``--reps`` times
on one input and prints, per call, how many weight tiles have an error above 1e-2 (relative to the
output's largest magnitude) against the plain-PyTorch reference. Run 13 found this way that a
per-thread ``fence.acq_rel.gpu`` before the fixup's barrier broke 10-60 of 224 tiles per call.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_w4a16 import make_weights  # noqa: E402

from quantkit.kernels import w4a16_gluon as kg  # noqa: E402
from quantkit.kernels.w4a16_weights import w4a16_matmul_ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="28672x8192")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    w = make_weights(n, k)
    x = torch.randn(args.m, k, device="cuda").bfloat16()
    ref = w4a16_matmul_ref(x, w).float()
    scale = ref.abs().max()
    for cfg in kg.GLUON_TUNER.candidates(args.m, w.group_size):
        bad = []
        for _ in range(args.reps):
            out = kg.w4a16_gluon_matmul(x, w, cfg).float()
            tile_err = (out - ref).abs().view(args.m, -1, cfg.BLOCK_N).amax(dim=(0, 2)) / scale
            bad.append(int((tile_err > 1e-2).sum()))
        print(f"{cfg}: wrong tiles per call {bad}", flush=True)


if __name__ == "__main__":
    main()
