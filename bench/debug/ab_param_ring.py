"""A/B of the Gluon decode kernel's parameter ring (``GluonConfig.PARAM_RING``) on one Hopper GPU.

Every decode candidate config runs twice per (shape, M), with the scales, zero points and activation
sums loaded by the consumers one unit ahead (the default until the seventh session) and through the
TMA ring with the weights; both graph-timed over rotating weights (L2 clean, as a served model sees
it), interleaved and each timed twice, so that drift between the two shows as spread.

    python3 bench/debug/ab_param_ring.py [--shapes 28672x8192,8192x28672] [--ms 1,4,16] [--json out.json]

Prints one line per (shape, M, config) and the best of each side per (shape, M).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_w4a16 import bench_graph, dequant_f32, make_weights, rotations  # noqa: E402

from quantkit.kernels import w4a16_gluon as kg  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="28672x8192,8192x28672,14336x4096,4096x14336,4096x4096")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = [c for c in kg.DECODE_GLUON_CONFIGS if not c.PARAM_RING]
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w0 = make_weights(n, k)
        w_kn = dequant_f32(w0)
        packed = w0.qweight.numel() * 4 + w0.scales.numel() * 2
        ws = [w0] + [make_weights(n, k) for _ in range(rotations(packed) - 1)]
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in ws]
            ref = xs[0].float() @ w_kn
            best = {False: float("inf"), True: float("inf")}
            for cfg in base:
                if not cfg.fits(m, w0.group_size):
                    continue
                cell = {}
                for ring in (False, True, False, True):
                    c = dataclasses.replace(cfg, PARAM_RING=ring)
                    out = kg._launch(xs[0], w0, c)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = bench_graph([lambda x=x, w=w, c=c: kg._launch(x, w, c) for x, w in zip(xs, ws)])
                    cell.setdefault(ring, []).append(us)
                    cell[f"err_{ring}"] = err
                    best[ring] = min(best[ring], us)
                rows.append(dict(shape=shape, m=m, config=dataclasses.asdict(cfg), us_loads=cell[False],
                                 us_ring=cell[True], err_loads=cell["err_False"], err_ring=cell["err_True"]))
                print(f"{shape} M={m:2d} {cfg.BLOCK_N}x{cfg.BLOCK_M} buf{cfg.NUM_BUF} w{cfg.num_warps} "
                      f"x{cfg.CTAS_PER_SM}: loads {cell[False][0]:6.1f} {cell[False][1]:6.1f} | ring "
                      f"{cell[True][0]:6.1f} {cell[True][1]:6.1f}  err {cell['err_False']:.1e} / "
                      f"{cell['err_True']:.1e}", flush=True)
            print(f"== {shape} M={m}: best loads {best[False]:.1f} us, best ring {best[True]:.1f} us "
                  f"({best[False] / best[True]:.3f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
