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


def run_cells(result: dict, out: str, items: list, run_item, label=str, candidates=None) -> None:
    """A benchmark's cells into ``result["cells"]``, item by item: a ``[k/n]`` line for each (``label(item)``), the
    cells ``run_item(item)`` returns, and the JSON rewritten after it, so a run cut by a time limit keeps the finished
    items; then ``complete``, and where ``candidates(cells, card)`` is given, the table entries it proposes (logged:
    candidates for a whole-step A/B, never defaults by themselves)."""
    import json

    def write():
        with open(out, "w") as f:
            json.dump(result, f, indent=1)

    result.update(cells=[], complete=False)
    for i, item in enumerate(items):
        log(f"[{i + 1}/{len(items)}] {label(item)}")
        result["cells"] += run_item(item)
        torch.cuda.empty_cache()
        write()
    result["complete"] = True
    if candidates is not None:
        result["candidate_entries"] = candidates(result["cells"], result["card"])
        log("candidate table entries (each only after a whole-step A/B):")
        for entry in result["candidate_entries"]:
            log("  " + json.dumps(entry))
    write()
    log(f"wrote {out}")


def beats_today(cell: dict, time_key: str, eligible, margin_us: float, margin: float):
    """``(today, best)``: a cell's row for today's pick (named "today...") and its fastest ``eligible`` row by
    ``time_key``, where that row beat today's by more than ``max(margin_us, margin x today)`` (rows without
    ``time_key`` were not timed); None otherwise. The benches' rule for proposing a table entry."""
    timed = [v for v in cell["variants"] if time_key in v]
    today = next((v for v in timed if v["name"].startswith("today")), None)
    best = min((v for v in timed if eligible(v)), key=lambda v: v[time_key], default=None)
    if today is None or best is None or today[time_key] - best[time_key] <= max(margin_us, margin * today[time_key]):
        return None
    return today, best


def proposed_entries(cells: list[dict], card: str, time_key: str, eligible, margin_us: float, margin: float,
                     entry) -> list[dict]:
    """Table entries (``kernels/w4a16_h200.json`` form, naming ``card``) for the cells where :func:`beats_today`
    found a winning row; ``entry(cell, today, best)`` gives each one's ``(kernel, config, us, source)``."""
    out = []
    for cell in cells:
        won = beats_today(cell, time_key, eligible, margin_us, margin)
        if won is not None:
            kernel, config, us, source = entry(cell, *won)
            out.append({"n": cell["N"], "k": cell["K"], "m": cell["M"], "kernel": kernel, "config": config,
                        "us": round(us, 1), "card": card, "source": source})
    return out


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
