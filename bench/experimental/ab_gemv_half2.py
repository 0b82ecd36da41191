"""A/B of the packed 16-bit GEMV experiment (``gemv_half2.py``) against the default W4A16 path at M = 1.

    python3 bench/debug/ab_gemv_half2.py [--shapes 28672x8192,...] [--out FILE.json]

First a correctness table (bf16/fp16, sym/asym, N not a multiple of the tile, activations with outlier
columns; the workspace must be zero after each call), then graph-timed microseconds over rotating weights
for each config and the default path, same process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_w4a16 import bench_graph, make_weights, packed_bytes, rotating_weights  # noqa: E402
from gemv_half2 import gemv_half2  # noqa: E402

from quantkit.kernels import w4a16 as kw  # noqa: E402
from quantkit.kernels.w4a16_weights import w4a16_matmul_ref  # noqa: E402

# (BLOCK_N, num_warps, programs per SM, K tiles loaded per wait)
CONFIGS = [(64, 4, 8, 1), (64, 4, 8, 2), (64, 4, 4, 2), (64, 4, 16, 2), (128, 8, 8, 2), (128, 4, 8, 2), (128, 8, 8, 1),
           (32, 4, 16, 2)]


def correctness():
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for sym in (True, False):
            for n, k in ((4096 + 96, 4096), (1000, 1024), (28672, 8192)):
                w = make_weights(n, k, sym)
                for outliers in (False, True):
                    x = torch.randn(1, k, device="cuda")
                    if outliers:
                        x[:, torch.randperm(k, device="cuda")[:8]] *= 200.0
                    x = x.to(dtype)
                    ref = w4a16_matmul_ref(x.float(), w).float()  # float32 all the way
                    for cfg in CONFIGS[:3] + CONFIGS[-1:]:
                        for _ in range(2):  # the second call finds the workspace the first left
                            y = gemv_half2(x, w, *cfg)
                        torch.cuda.synchronize()
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        clean = bool((w.partial_sums == 0).all() and (w.tile_counters == 0).all())
                        y0 = kw.w4a16_matmul(x, w)
                        err0 = ((y0.float() - ref).norm() / ref.norm()).item()
                        rows.append(dict(dtype=str(dtype), sym=sym, n=n, k=k, outliers=outliers, config=cfg, err=err,
                                         err_default=err0, workspace_clean=clean, finite=bool(y.isfinite().all())))
                        print(f"{str(dtype):15s} sym={sym!s:5s} {n}x{k} outliers={outliers!s:5s} {cfg}: "
                              f"err {err:.2e} (default {err0:.2e}) clean={clean} finite={rows[-1]['finite']}",
                              flush=True)
    return rows


def timing(shapes):
    rows = []
    for n, k in shapes:
        w0 = make_weights(n, k)
        ws = rotating_weights(w0, n, k)
        xs = [torch.randn(1, k, device="cuda").bfloat16() for _ in ws]
        cells = {"default": bench_graph([lambda x=x, w=w: kw.w4a16_matmul(x, w) for x, w in zip(xs, ws)])}
        for cfg in CONFIGS:
            cells[str(cfg)] = bench_graph([lambda x=x, w=w, c=cfg: gemv_half2(x, w, *c) for x, w in zip(xs, ws)])
        best = min((v, c) for c, v in cells.items() if c != "default")
        gbs = packed_bytes(w0) / best[0] / 1e3
        print(f"{n}x{k} M=1: default {cells['default']:.1f} us | best half2 {best[0]:.1f} {best[1]} ({gbs:.2f} TB/s) | "
              + " ".join(f"{c}={v:.1f}" for c, v in cells.items() if c != "default"), flush=True)
        rows.append(dict(n=n, k=k, us=cells))
        del ws
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="28672x8192,8192x28672,14336x4096,4096x14336,4096x4096")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    result = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, correctness=correctness(),
                  timing=timing(shapes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
