"""GPU time of a call as a served model sees it: CUDA-graph replays (no host launch cost), L2 evicted
before each call (weights not resident). Used by the kernels' tuners and the benchmarks."""

from __future__ import annotations

import sys

import torch

# Twice the H200's 50 MB L2 (60 MB on some Hopper parts): reading it evicts the weights of the call before.
L2_EVICT_BYTES = 128 * 2**20


def l2_evict_buffer(device) -> torch.Tensor:
    """The buffer :func:`gpu_time_us` reads (or writes) between calls to evict L2."""
    return torch.empty(L2_EVICT_BYTES, dtype=torch.uint8, device=device)


def gpu_time_us(fn, flush: torch.Tensor | None = None, calls: int = 8, replays: int = 3) -> float:
    """Microseconds of GPU time per ``fn()`` with a cold L2 and no host overhead: the best of
    ``replays`` replays of a CUDA graph of ``calls`` x (evict L2, fn), less the same graph without fn.

    L2 is evicted by reading ``flush`` (twice its size; :func:`l2_evict_buffer` when None), which leaves
    it full of clean lines, as the previous layer's weights leave it in a served model. (Writing it, the
    usual cache flush, leaves L2 dirty and the first reads of ``fn`` wait on the write-back: ~3.3 against
    4.3 TB/s for a 121 MB read-only stream on the H200, bench/NOTES_w4a16.md.)

    ``fn`` runs once eagerly first (compilation, allocator warm-up), so it must not be called inside
    another CUDA-graph capture."""
    if flush is None:
        flush = l2_evict_buffer(torch.cuda.current_device())
    fn()  # compile and allocator warm-up outside the capture
    torch.cuda.synchronize()
    words = flush.view(torch.int64)
    sink = torch.empty((), dtype=torch.int64, device=flush.device)
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                torch.sum(words, dim=0, out=sink)
                if with_fn:
                    fn()
        graphs.append(graph)
    best = []
    for graph in graphs:
        graph.replay()  # first replay uploads the graph
        best.append(min(replay_us(graph, replays)))
    return max(best[0] - best[1], 0.0) / calls


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Microseconds of each of ``replays`` replays of ``graph``, timed by CUDA events around each one."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def gpu_run(script: str, out: str | None) -> tuple[dict, str] | None:
    """The start of a GPU benchmark's run: None, after one line on stderr, where torch sees no GPU; else the record
    its JSON starts with (card, torch, Triton, nvcc, date) and where to write it (``out``, or
    ``bench/runs/<script>_<date>.json``), the folder made."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return None
    import datetime
    import os

    import triton

    from quantkit.kernels.w4a16_cuda import _nvcc_version, nvcc_path

    now = datetime.datetime.now(datetime.timezone.utc)
    path = out or f"bench/runs/{script}_{now:%Y%m%d_%H%M}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    nvcc = nvcc_path()
    record = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  nvcc=_nvcc_version(nvcc) if nvcc else None, date=now.isoformat(timespec="seconds"))
    return record, path


def log(line: str) -> None:
    """A benchmark's progress line, flushed (a device call's log tail keeps it if the run is cut)."""
    print(line, flush=True)


def main(argv=None) -> int:
    """Time one bf16 matmul the way the benchmarks time a kernel (a check of this machine's timing)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__ + " Run alone, it times one bf16 matmul (M x K) @ (K x N).")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_timing: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.k, args.n, device="cuda", dtype=torch.bfloat16)
    us = gpu_time_us(lambda: a @ b)
    gbs = (a.numel() + b.numel() + args.m * args.n) * 2 / us / 1e3
    print(f"{torch.cuda.get_device_name()}: bf16 {args.m}x{args.k} @ {args.k}x{args.n}: {us:.1f} us, {gbs:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
