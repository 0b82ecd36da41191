"""Which part of the Gluon W4A16 decode kernel sets its time: the kernel with parts of its consumer
loop removed, on one Hopper GPU (runs 24-25, bench/NOTES_w4a16.md).

    python3 bench/debug/bottleneck_w4a16.py --variant {full,stream,nodequant} [--shapes 28672x8192] [--ms 1,16]

* full: the kernel as shipped;
* stream: each consumer unit only waits for its stage and releases it (no shared-memory reads, no math):
  the weight stream through the kernel's own ring, producer, grid and launch;
* nodequant: the packed words go to the tensor cores as they are (bit-cast, no shift or lop3), and the
  scales, zero points and activation sums are not read: shared-memory reads and MMAs without dequantization
  (the wgmma prefill path too, with ``--configs``);
* --no-x, --no-flush, --no-gather take the activation boxes out of the producer, the output (atomics,
  stores) out of the consumers, and the gather launch out of the call. Careful: with no output, the
  compiler also drops every computation that only fed it, so ``full --no-flush`` runs no math at all
  (it times like ``stream --no-flush``).

Each variant replaces ``w4a16_gluon._unit`` before anything compiles, so run one variant per process.
The results are wrong on purpose except for ``full``; the script prints graph-timed microseconds over
rotating weights (L2 clean), the same timing as bench_w4a16.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_w4a16 import bench_graph, make_weights, rotating_weights  # noqa: E402

from quantkit.kernels import w4a16_gluon as kg  # noqa: E402

_MOV = gl.constexpr("mov.b32 $0, $1;")


@gluon.jit
def _unit_stream(acc, a_prev, scale, zero, w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, xsum_ptr, M, N, k_tiles,
                 stride_sg, stride_zg, u, lo, hi, tn, tm, kt_base, offs_n, offs_w, GROUP_SIZE: gl.constexpr,
                 HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr,
                 WGMMA: gl.constexpr, SCALE_ACC: gl.constexpr, acc_layout: gl.constexpr):
    stage = u % NUM_BUF
    mbarrier.wait(ready.index(stage), (u // NUM_BUF) & 1)
    if WGMMA:  # as the real unit: the previous stage is released here, the segment's last one after its loop
        mbarrier.arrive(empty.index((u + NUM_BUF - 1) % NUM_BUF), pred=u > lo)
    else:
        mbarrier.arrive(empty.index(stage))
    return acc, a_prev, scale, zero


@gluon.jit
def _unit_nodequant(acc, a_prev, scale, zero, w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, xsum_ptr, M, N,
                    k_tiles, stride_sg, stride_zg, u, lo, hi, tn, tm, kt_base, offs_n, offs_w,
                    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                    NUM_BUF: gl.constexpr, WGMMA: gl.constexpr, SCALE_ACC: gl.constexpr, acc_layout: gl.constexpr):
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
    stage = u % NUM_BUF
    mbarrier.wait(ready.index(stage), (u // NUM_BUF) & 1)
    words = w_smem.index(stage).load(w_layout)
    if WGMMA:
        for j in gl.static_range(4):
            a = gl.inline_asm_elementwise(_MOV, "=r,r,r", [kg._pairs_of(words, a_layout, BLOCK_N)],
                                          dtype=gl.bfloat16, is_pure=True, pack=2)
            acc = warpgroup_mma(a, x_smem.index(stage * 4 + j).permute((1, 0)), acc, is_async=True)
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
            if j == 0:
                mbarrier.arrive(empty.index((u + NUM_BUF - 1) % NUM_BUF), pred=u > lo)
            a_prev = a
    else:
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_layout, k_width=2)
        b0 = x_smem.index(stage * 4 + 0).permute((1, 0)).load(b_layout)
        b1 = x_smem.index(stage * 4 + 1).permute((1, 0)).load(b_layout)
        b2 = x_smem.index(stage * 4 + 2).permute((1, 0)).load(b_layout)
        b3 = x_smem.index(stage * 4 + 3).permute((1, 0)).load(b_layout)
        mbarrier.arrive(empty.index(stage))
        # the words' bits as the A operand: the registers the dequantization would produce, minus its work
        a = gl.inline_asm_elementwise(_MOV, "=r,r,r", [kg._pairs_of(words, a_layout, BLOCK_N)], dtype=gl.bfloat16,
                                      is_pure=True, pack=2)  # (bf16 activations only)
        acc = mma_v2(a, b0, acc)
        acc = mma_v2(a, b1, acc)
        acc = mma_v2(a, b2, acc)
        acc = mma_v2(a, b3, acc)
    return acc, a_prev, scale, zero


@gluon.jit
def _load_partition_no_x(desc_w, desc_x, w_smem, x_smem, ready, empty, u0, count, pid, n_progs, k_tiles, tiles_n,
                         tiles_m, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_N: gl.constexpr,
                         NUM_BUF: gl.constexpr, PERSISTENT: gl.constexpr):
    """The producer without the activation boxes: the weight words alone."""
    for i in range(count):
        stage = i % NUM_BUF
        tn, tm, kt = kg._unit_coords(i, u0, pid, n_progs, k_tiles, tiles_n, tiles_m, GROUP_N, PERSISTENT)
        if i >= NUM_BUF:
            mbarrier.wait(empty.index(stage), ((i // NUM_BUF) + 1) & 1)
        kg._load_weights(desc_w, w_smem, ready, stage, tn, kt, 0, BLOCK_N)


@gluon.jit
def _flush_none(acc, c_ptr, ws_ptr, tile_units_ptr, tn, tm, M, N, seg_units, k_tiles, BLOCK_N: gl.constexpr,
                BLOCK_M: gl.constexpr, ATOMIC_OUT: gl.constexpr, acc_layout: gl.constexpr, RESET: gl.constexpr):
    pass


VARIANTS = {"full": None, "stream": _unit_stream, "nodequant": _unit_nodequant}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="full")
    ap.add_argument("--shapes", default="28672x8192,8192x28672")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--configs", default=None, help="';'-separated GluonConfig fields (default: the decode configs)")
    ap.add_argument("--no-x", action="store_true", help="the producer loads no activations")
    ap.add_argument("--no-flush", action="store_true", help="no output: no atomics, no stores")
    ap.add_argument("--no-gather", action="store_true", help="no gather launch before the kernel")
    args = ap.parse_args()
    if VARIANTS[args.variant] is not None:
        kg._unit = VARIANTS[args.variant]
    if args.no_x:
        kg._load_partition = _load_partition_no_x
    if args.no_flush:
        kg._flush = _flush_none
    if args.no_gather:
        kg.gather_columns = lambda x, index, zero=None, tile_sums=None: x
    configs = kg.DECODE_GLUON_CONFIGS
    if args.configs:
        from ncu_w4a16 import parse_config

        configs = [parse_config(text) for text in args.configs.split(";") if text]
    label = "+".join([args.variant] + [f for f in ("no_x", "no_flush", "no_gather") if getattr(args, f)])
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w0 = make_weights(n, k)
        ws = rotating_weights(w0, n, k)
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in ws]
            cells = []
            for cfg in configs:
                if not cfg.fits(m, w0.group_size):
                    continue
                us = bench_graph([lambda x=x, w=w, c=cfg: kg._launch(x, w, c) for x, w in zip(xs, ws)])
                cells.append(f"{cfg.BLOCK_N}x{cfg.BLOCK_M}/{cfg.NUM_BUF}/{cfg.num_warps}w/x{cfg.CTAS_PER_SM}"
                             f"{'/wgmma' if cfg.WGMMA else ''} {us:5.1f}")
            print(f"{label:30s} {shape} M={m:2d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
