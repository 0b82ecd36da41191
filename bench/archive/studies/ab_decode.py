"""A/B of the batch-1 decode step's host and launch overheads (issue 22), in one process on one model:
programmatic dependent launch of the small kernels on/off (``QUANTKIT_PDL``) x the greedy pipeline (the next
step launched before the host reads this one) on/off, int4 and bf16, plus the per-part time split and a
greedy check of the pipelined graph decode against the prefill path on the same weights.

    python bench/ab_decode.py --shape llama3-8b --steps 64 [--out bench/results/ab_decode_<date>.json]

Prints a table; writes JSON (card, versions, date) after every model.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import statistics
from pathlib import Path

import torch

VARIANTS = (("pdl+pipeline", "1", True), ("pdl", "1", False), ("pipeline", "0", True), ("neither", "0", False))


def _engine(model, steps: int, pipeline: bool):
    from quantkit.runtime.engine import Engine

    engine = Engine(model, None, max_batch=1, max_seq_len=2049, cuda_graphs=True, graph_buckets=(1,))
    if not pipeline:
        engine._can_chain = lambda *args: False  # every step read before the next is launched
    return engine


def measure(model, steps: int, repeats: int, split: bool) -> dict:
    from quantkit.tools import bench

    out = {}
    for name, pdl, pipeline in VARIANTS:
        os.environ["QUANTKIT_PDL"] = pdl
        engine = _engine(model, steps, pipeline)
        tps = [bench.decode_tps(engine, 1, steps) for _ in range(repeats)]
        out[name] = {"decode_tps_b1": statistics.median(tps), "runs": tps}
        if split and name == VARIANTS[0][0]:
            out["time_split_ms"] = bench.time_split(engine)
            out["time_split_ms"]["engine_step_wall"] = 1e3 / out[name]["decode_tps_b1"]
        logging.info("%s: %.1f tok/s (%s)", name, out[name]["decode_tps_b1"], ", ".join(f"{t:.1f}" for t in tps))
        del engine
        gc.collect()
    os.environ["QUANTKIT_PDL"] = "1"
    return out


def main() -> None:
    from quantkit.tools import bench, bench_run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=f"bench/results/ab_decode_{datetime.date.today()}.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"shape": args.shape, "card": bench_run._card(), "steps": args.steps,
              "copy_bandwidth_gbs": bench.copy_bandwidth("cuda")}
    for kind in ("int4", "bf16"):
        hf = bench.random_hf_model(args.shape, "cuda")
        quant = bench.quantize_randomly(hf) if kind == "int4" else None
        model = bench.runtime_from_hf(hf, quant)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        record[kind] = measure(model, args.steps, args.repeats, split=True)
        record[kind]["greedy_check"] = bench.greedy_agreement(_engine(model, 24, True))
        logging.info("%s greedy check: %s", kind, record[kind]["greedy_check"])
        out.write_text(json.dumps(record, indent=2))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    print("| model | " + " | ".join(v[0] for v in VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for kind in ("int4", "bf16"):
        print(f"| {kind} b=1 tok/s | " + " | ".join(f"{record[kind][v[0]]['decode_tps_b1']:.1f}" for v in VARIANTS)
              + " |")
    for kind in ("int4", "bf16"):
        print(f"{kind} split (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in record[kind]["time_split_ms"].items()))
        print(f"{kind} greedy check: {record[kind]['greedy_check']}")


if __name__ == "__main__":
    main()
