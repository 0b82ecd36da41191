"""How fast can TMA stream packed weights into shared memory on this GPU, by box shape and layout?

    python bench/debug/tma_stream.py [--sweep] [--out DIR]

The Gluon W4A16 decode kernel streams its 121 MB weights at ~78 % of the device-copy bandwidth
(H200 run 12). This separates the memory side from the dequantizing warps: the same producer warp and
ring of mbarriers as the kernel, but consumers that only wait for a stage and release it. A layout or
box shape that streams much faster here than the kernel's is worth a repack; if the kernel's own box
already streams near copy speed here, the consumers are what limits it.

Variants: the kernel's box (128 rows x 16 words: 64 bytes of each of 128 rows 4-57 KB apart), wider
boxes (128 B per row), and a tile-contiguous layout (each unit one contiguous 8 or 16 KB block, as a
load-time repack would store it); each with 1-4 programs per SM and 4-8 ring stages. Also a plain
Triton read-only kernel and the device copy. Timed as the W4A16 tuner times configs (CUDA graph,
L2 flushed before each call); prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import gpu_time_us, l2_evict_buffer, replay_us  # noqa: E402  (bench/)

from quantkit.kernels.w4a16_gluon import LOAD_WARP_REGS, _even_run, _invalidate_ring, _ring_barriers


@gluon.jit
def _release_partition(ready, empty, count, NUM_BUF: gl.constexpr):
    for i in range(count):
        stage = i % NUM_BUF
        mbarrier.wait(ready.index(stage), (i // NUM_BUF) & 1)
        mbarrier.arrive(empty.index(stage))


@gluon.jit
def _stream_partition(desc, smem, ready, empty, u0, count, col_tiles, NUM_BUF: gl.constexpr):
    BR: gl.constexpr = desc.block_type.shape[0]
    BC: gl.constexpr = desc.block_type.shape[1]
    for i in range(count):
        stage = i % NUM_BUF
        u = u0 + i
        mbarrier.wait(empty.index(stage), ((i // NUM_BUF) + 1) & 1, pred=i >= NUM_BUF)
        bar = ready.index(stage)
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [(u // col_tiles) * BR, (u % col_tiles) * BC], bar, smem.index(stage))


@gluon.jit
def _tma_stream_kernel(desc, n_units, col_tiles, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    # the W4A16 kernel's run split and ring (kernels/w4a16_gluon.py)
    u0, count = _even_run(gl.program_id(0), gl.num_programs(0), n_units)
    smem = gl.allocate_shared_memory(desc.dtype, [NUM_BUF] + desc.block_type.shape, desc.layout)
    ready, empty = _ring_barriers(NUM_BUF)
    gl.warp_specialize([
        (_release_partition, (ready, empty, count, NUM_BUF)),
        (_stream_partition, (desc, smem, ready, empty, u0, count, col_tiles, NUM_BUF)),
    ], [1], [LOAD_WARP_REGS])
    _invalidate_ring(ready, empty, NUM_BUF)


@triton.jit
def _read_sum_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Read-only ceiling without TMA: each program sums strided BLOCK-word chunks (xor keeps the loads)."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def tma_time(buf: torch.Tensor, rows: int, cols: int, box: tuple[int, int], num_buf: int, ctas: int,
             flush: torch.Tensor, evict_by_writing: bool = False) -> float:
    view = buf.view(rows, cols)
    inner = box[1] * 4  # a swizzled box's rows may not be longer than the swizzle span
    layout = gl.NVMMASharedLayout(swizzle_byte_width=inner if inner in (32, 64, 128) else 0, element_bitwidth=32,
                                  rank=2)
    desc = TensorDescriptor(view, [rows, cols], [cols, 1], list(box), layout)
    col_tiles = cols // box[1]
    n_units = (rows // box[0]) * col_tiles
    grid = (torch.cuda.get_device_properties(buf.device).multi_processor_count * ctas,)
    return _time_us(lambda: _tma_stream_kernel[grid](desc, n_units, col_tiles, NUM_BUF=num_buf, num_warps=4),
                    flush, evict_by_writing)


def _time_us(fn, flush, evict_by_writing=False, calls=8, replays=3):
    """gpu_timing.gpu_time_us, with the option of evicting L2 by writing ``flush`` (the library only reads it)."""
    if not evict_by_writing:
        return gpu_time_us(fn, flush, calls, replays)
    fn()
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(graph)
    best = []
    for graph in graphs:
        graph.replay()
        best.append(min(replay_us(graph, replays)))
    return max(best[0] - best[1], 0.0) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=28672, help="rows of the strided layout (N)")
    parser.add_argument("--words", type=int, default=1024, help="int32 words per row (K / 8)")
    parser.add_argument("--sweep", action="store_true",
                        help="every layout x 1-4 programs per SM x 4-12 stages (default: the best few of run 15)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    dev = torch.device("cuda")
    buf = torch.randint(-2**31, 2**31 - 1, (args.rows * args.words,), dtype=torch.int32, device=dev)
    nbytes = buf.numel() * 4
    flush = l2_evict_buffer(dev)
    rows = []

    def add(name, us, moved=nbytes):
        rows.append(dict(variant=name, us=us, tbs=moved / us / 1e6))
        print(f"{name:<44} {us:8.2f} us {moved / us / 1e6:6.2f} TB/s", flush=True)

    dst = torch.empty_like(buf)
    sink = torch.empty(132 * 16, dtype=torch.int32, device=dev)
    # L2 evicted by reading a 128 MB buffer (clean lines, as in a served model), and for comparison by
    # writing it (dirty lines that the timed kernel's reads must wait to write back)
    for by_writing in (False, True):
        how = "evict by writing" if by_writing else "evict by reading"
        add(f"device copy (read + write), {how}",
            _time_us(lambda: dst.copy_(buf), flush, by_writing), 2 * nbytes)
        for progs in (132 * 8, 132 * 16):
            add(f"triton read-only, {progs} programs x 4096 words, {how}",
                gpu_time_us(lambda p=progs: _read_sum_kernel[(p,)](buf, sink, buf.numel(), BLOCK=4096, num_warps=8),
                             flush, by_writing))
        add(f"TMA strided 128x16 (the kernel's), 1 CTA/SM, 8 stages, {how}",
            tma_time(buf, args.rows, args.words, (128, 16), 8, 1, flush, by_writing))
    del dst
    words = args.words
    layouts = [  # (name, view rows, view cols, box)
        ("strided 128x16 (the kernel's)", args.rows, words, (128, 16)),
        ("strided 256x16", args.rows, words, (256, 16)),
        ("strided 128x32", args.rows, words, (128, 32)),
        ("strided 64x32", args.rows, words, (64, 32)),
        ("strided 64x64", args.rows, words, (64, 64)),
        ("contiguous 8 KB (128x16 tiles)", args.rows * words // 16, 16, (128, 16)),
        ("contiguous 16 KB (128x32 tiles)", args.rows * words // 32, 32, (128, 32)),
        ("contiguous 16 KB (64x64 tiles)", args.rows * words // 64, 64, (64, 64)),
    ]
    short = {layouts[0][0]: [(1, 8), (2, 8), (3, 6)], layouts[2][0]: [(1, 6)], layouts[5][0]: [(1, 8)],
             layouts[7][0]: [(1, 4)]}
    for name, r, c, box in layouts:
        stage_bytes = box[0] * box[1] * 4
        for ctas in (1, 2, 3, 4):
            for num_buf in (4, 6, 8, 12):
                if ctas * (num_buf * stage_bytes + 1024) > 227 * 1024:
                    continue
                if ctas * num_buf * stage_bytes < 32 * 1024:  # too little in flight to be interesting
                    continue
                if not args.sweep and (ctas, num_buf) not in short.get(name, []):
                    continue
                add(f"{name}, {ctas} CTA/SM, {num_buf} stages", tma_time(buf, r, c, box, num_buf, ctas, flush))
    now = datetime.datetime.now(datetime.timezone.utc)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tma_stream_{now:%Y%m%d-%H%M%S}.json")
    with open(path, "w") as f:
        json.dump(dict(card=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                       date=now.isoformat(timespec="seconds"), bytes=nbytes, rows=rows,
                       timing="best of 3 CUDA-graph replays of 8 x (128 MB L2 flush + call), less the flushes"),
                  f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
