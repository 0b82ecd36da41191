"""A/B of fixed Gluon W4A16 configs against cuBLAS on one Hopper GPU, same process, same inputs.

    python3 bench/debug/ab_gluon_configs.py --shapes 4096x4096,28672x8192 --ms 1024,4096 \\
        --configs "BLOCK_N=256,BLOCK_M=128,NUM_BUF=4,num_warps=8,WGMMA=1,STREAM_K=0;..." [--repeat 2] [--json F] \\
        [--variants "X_BOX_K=64;NUM_BUF=6"] [--decode]

Every config (``;``-separated, the fields of ``GluonConfig``) is checked against the float32 product and
graph-timed over rotating weights (L2 clean), like bench_w4a16.py; each config is timed ``--repeat``
times, interleaved, so that drift shows as spread. ``--variants``: each config is also run with each
variant's fields replaced (``;``-separated), right after it; ``--decode`` adds the decode candidates
(DECODE_GLUON_CONFIGS) to ``--configs``, ``--direct`` the direct-load ones (DIRECT_GLUON_CONFIGS). Prints one line per (shape, M) with cuBLAS bf16
and every config's microseconds and ratio to cuBLAS.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_w4a16 import bench_graph, dequant_f32, make_weights, rotating_weights, rotations  # noqa: E402
from ncu_w4a16 import parse_config, parse_fields  # noqa: E402

from quantkit.kernels import w4a16_gluon as kg  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096")
    ap.add_argument("--ms", default="4096")
    ap.add_argument("--configs", default="")
    ap.add_argument("--variants", default="")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--direct", action="store_true", help="add the direct-load candidates (DIRECT_GLUON_CONFIGS)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = [parse_config(text) for text in args.configs.split(";") if text]
    base += list(kg.DECODE_GLUON_CONFIGS) if args.decode else []
    base += list(kg.DIRECT_GLUON_CONFIGS) if args.direct else []
    variants = [parse_fields(text) for text in args.variants.split(";") if text]
    configs = []
    for cfg in base:
        configs.append(cfg)
        for v in variants:
            try:
                configs.append(dataclasses.replace(cfg, **v))
            except ValueError:  # a variant that does not apply to this kind of config
                pass
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w0 = make_weights(n, k)
        w_kn = dequant_f32(w0)
        ws = rotating_weights(w0, n, k)
        bf16 = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(rotations(2 * n * k))]
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(max(len(ws), len(bf16)))]
            ref = xs[0].float() @ w_kn
            cublas = bench_graph([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, bf16)])
            cells = [f"cuBLAS {cublas:8.1f}"]
            for cfg in configs:
                if not cfg.fits(m, w0.group_size):
                    continue
                err = ((kg._launch(xs[0], w0, cfg).float() - ref).norm() / ref.norm()).item()
                times = [bench_graph([lambda x=x, w=w, c=cfg: kg._launch(x, w, c) for x, w in zip(xs, ws)])
                         for _ in range(args.repeat)]
                rows.append(dict(shape=shape, m=m, config=str(cfg), us=times, cublas_us=cublas, rel_err=err))
                name = (f"{cfg.BLOCK_N}x{cfg.BLOCK_M}/{cfg.NUM_BUF}/w{cfg.num_warps}c{cfg.CTAS_PER_SM}"
                        f"{'/P' if cfg.PERSISTENT else ''}{'/K' if cfg.STREAM_K else ''}"
                        + (("/direct" + ("/gx" if cfg.GATHER_X else "")) if cfg.DIRECT else f"/x{cfg.X_BOX_K}"))
                cells.append(f"{name} {' '.join(f'{t:.1f}' for t in times)} ({cublas / min(times):.2f}x, {err:.0e})")
            print(f"{shape} M={m}: " + " | ".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           date=datetime.datetime.now().isoformat(timespec="seconds"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
