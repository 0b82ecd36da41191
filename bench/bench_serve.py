"""Serving benchmark of the runtime (issue 22): decode tokens/s at batch 1, 8, 32 and prefill of 2048 tokens,
int4 (W4A16 kernels) against the same model in bf16 in one run, with transformers ``generate`` on the same
weights as the baseline, the copy bandwidth and the weight bytes per token.

    python bench/bench_serve.py --shape llama3-8b [--out bench/runs/serve_llama3-8b_<date>.json]
    python bench/bench_serve.py CHECKPOINT_DIR

``quantkit bench`` runs the same code (quantkit.tools.bench_run). The JSON is rewritten after every phase;
a PNG plot is written beside it at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from pathlib import Path


def main() -> None:
    from quantkit.tools import bench_run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", help="a quantized checkpoint folder")
    parser.add_argument("--shape", help="random weights of a known shape (llama3-8b, smollm2-135m)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=128, help="decode steps at batch 1 (half at larger batches)")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--no-baselines", action="store_true", help="skip transformers generate")
    parser.add_argument("--out", help="JSON path (default bench/runs/serve_<target>_<date>.json)")
    args = parser.parse_args()
    if bool(args.target) == bool(args.shape):
        parser.error("give a checkpoint folder or --shape, not both")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    name = args.shape or Path(args.target).name
    out = Path(args.out or f"bench/runs/serve_{name}_{datetime.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(record: dict) -> None:
        out.write_text(json.dumps(record, indent=2))

    record = bench_run.run(args.shape or args.target, shape=bool(args.shape),
                           batches=tuple(int(b) for b in args.batches.split(",")), steps=args.steps,
                           prefill_tokens=args.prefill_tokens, baselines=not args.no_baselines, on_result=save)
    save(record)
    print(bench_run.format_table(record))
    try:
        bench_run.plot(record, out.with_suffix(".png"))
    except ImportError:
        logging.warning("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
