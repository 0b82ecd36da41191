"""Where one GPTQ layer's seconds go on a GPU: torch.profiler over one steady decoder layer of the 8B shape.

Builds a Llama-3-8B-shaped model with a few layers (random bf16, as bench_quantize_8b.py), walks it with the CLI's
GPTQ options on 128 x 2048 random tokens, and profiles the third layer (the first compiles kernels) from the
moment the second one is finished: capture passes, Hessians, solves, install, propagation. Prints the top CUDA
kernels and CPU ops and writes the tables and per-layer phases as JSON. ``--single-pass-tokens`` as in
bench_quantize_8b.py, to compare the walker's two GPTQ paths on the same card.

    python bench/profile_gptq_layer.py --out prof.json [--single-pass-tokens 524288] [--layers 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize_8b import LLAMA3_8B, build_model, versions  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--single-pass-tokens", type=int, default=None)
    p.add_argument("--no-profile", action="store_true", help="per-layer phases only")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from quantkit.api import build_method
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme

    device = torch.device("cuda")
    model = build_model(LLAMA3_8B, args.layers, torch.bfloat16, device)
    method = build_method("gptq", QuantScheme(4, 128, True), {"single_pass_max_tokens": args.single_pass_tokens})
    tokens = torch.randint(0, LLAMA3_8B["vocab_size"], (args.nsamples, args.seqlen),
                           generator=torch.Generator().manual_seed(0))
    target = min(2, args.layers - 1)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    rows = []

    def on_layer(event) -> None:
        stats = event.result.stats.values()
        rows.append({"layer": event.index, "seconds": event.seconds, "peak_gib": event.peak_memory_bytes / 2**30,
                     "hessian_s": sum(s.get("hessian_seconds", 0.0) for s in stats),
                     "solve_s": sum(s.get("seconds", 0.0) for s in stats), "phases": dict(event.phases)})
        print(json.dumps(rows[-1]), flush=True)
        if args.no_profile:
            return
        if event.index == target - 1:
            torch.cuda.synchronize()
            prof.start()
        elif event.index == target:
            torch.cuda.synchronize()
            prof.stop()

    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    walk(model, method, device=device, token_ids=tokens, batch_size=8, on_layer=on_layer)
    torch.cuda.synchronize()
    record = {"card": torch.cuda.get_device_name(device), "versions": versions(), "date": time.strftime("%Y-%m-%d"),
              "layers": rows, "walk_s": time.perf_counter() - t0, "single_pass_tokens": args.single_pass_tokens,
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    if not args.no_profile:
        avg = prof.key_averages()
        cuda = avg.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90)
        cpu = avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90)
        print(cuda)
        print(cpu)
        record["cuda_table"], record["cpu_table"] = cuda, cpu
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
