"""A/B of the small-M W4A16 paths on one GPU: the direct GEMV (one launch), the split-K GEMV (zeroing,
atomics, cast), the Gluon kernel and PyTorch's int4 kernel, graph-timed over rotating weights.

    python3 bench/debug/ab_gemv_direct.py [--shapes 4096x4096,14336x4096] [--ms 1,2,4] [--each]

Prints one line per (shape, M) with each variant's microseconds and relative error against float32;
``--each`` adds a line with every direct-GEMV config that fits (BLOCK_N x BLOCK_K / pipe / warps: us).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_w4a16 import (  # noqa: E402
    GROUP,
    bench_graph,
    dequant_f32,
    make_weights,
    packed_bytes,
    rotating_weights,
    rotations,
    torch_int4_weights,
)

from quantkit.kernels import w4a16 as kw  # noqa: E402


def variants(gluon: bool):
    out = {
        "default": lambda x, w: kw.w4a16_matmul(x, w),
        "gemv_direct": lambda x, w: kw._gemv_matmul(x, w, None, True, direct=True),
        "gemv_split": lambda x, w: kw._gemv_matmul(x, w, None, True, direct=False),
    }
    if gluon:
        out["gluon"] = lambda x, w: kw.w4a16_matmul(x, w, path="gluon")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--each", action="store_true")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w0 = make_weights(n, k)
        w_kn = dequant_f32(w0)
        ws = rotating_weights(w0, n, k)
        i4 = [torch_int4_weights(n, k) for _ in range(rotations(packed_bytes(w0)))]
        fns = variants(kw.gluon_available(torch.empty(1, k, device="cuda", dtype=torch.bfloat16), w0))
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(max(len(ws), len(i4)))]
            ref = xs[0].float() @ w_kn
            cells = []
            for name, fn in fns.items():
                if name.startswith("gemv") and m > 16:
                    continue
                err = ((fn(xs[0], w0).float() - ref).norm() / ref.norm()).item()
                us = bench_graph([lambda x=x, w=w, f=fn: f(x, w) for x, w in zip(xs, ws)])
                cells.append(f"{name} {us:6.1f} ({err:.0e})")
            us = bench_graph([lambda x=x, p=p: torch._weight_int4pack_mm(x, p[0], GROUP, p[1]) for x, p in zip(xs, i4)])
            cells.append(f"int4 {us:6.1f}")
            print(f"{shape} M={m}: " + " | ".join(cells), flush=True)
            if args.each:
                block_m = max(1, triton.next_power_of_2(m))
                each = []
                for c in kw.GEMV_DIRECT_CONFIGS:
                    meta = c.all_kwargs()
                    if not kw._gemv_config_ok(meta, block_m, w0.group_size):
                        continue
                    cfg = dict(meta, SPLIT_K=1)
                    us = bench_graph([lambda x=x, w=w, c=cfg: kw._gemv_matmul(x, w, c, True, direct=True)
                                      for x, w in zip(xs, ws)])
                    each.append(f"{meta['BLOCK_N']}x{meta['BLOCK_K']}/{meta['PIPE']}/w{meta['num_warps']} {us:5.1f}")
                print("  direct configs: " + " | ".join(each), flush=True)


if __name__ == "__main__":
    main()
