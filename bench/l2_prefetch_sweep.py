"""The decode step with each next linear's weights requested into L2 ahead of it (``QUANTKIT_L2_PREFETCH_MB``,
kernels/l2_prefetch.py) at several sizes, against none, on one random model per format, in one process.

    python bench/l2_prefetch_sweep.py [--shape llama3-8b] [--formats fp8,int4,bf16] [--mbs 0,16,32]
                                      [--plans each,pairs] [--rounds 2] [--batches 1,8] [--steps 64] [--out PATH]

Each format's model is built once (as ``quantkit bench`` builds it: random weights on the GPU, INT4 or FP8 in
place); then, ``--rounds`` times, for every variant (none, and each size in ``--mbs`` under each plan of
``--plans``, QUANTKIT_L2_PREFETCH_PLAN's: "16" is 16 MB each, "16p" 16 MB in pairs; the order reversed every
other round, so drift does not favour one), the runtime's prefetch is set, an engine captures its CUDA graphs,
and decode tokens/s is measured at each batch size as ``quantkit bench`` measures it (``bench.decode_tps``:
greedy requests of 128 random tokens, the engine's whole step). Before timing, one eager decode step's logits
under each variant are checked bit for bit against none. The table gives each variant's best round and its
ratio to none;
``quantkit bench`` under the switch (``bash bench/gpu_check.sh l2-prefetch``) confirms a pick before it becomes a
default. JSON: card, versions, date, every round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys


def _decode_logits(runtime):
    import torch

    from quantkit.runtime.model import KVCache

    cache = KVCache.allocate(runtime.spec, 2, 256, runtime.dtype, runtime.device)
    runtime.prefill([list(range(1, 129))], [0], cache)
    one = lambda v: torch.tensor([v], device=runtime.device, dtype=torch.int32)  # noqa: E731
    return runtime.decode(torch.tensor([7], device=runtime.device), one(128), one(0), cache)


def sweep_format(fmt: str, args, log) -> dict:
    import torch

    from quantkit.runtime.engine import Engine
    from quantkit.tools import bench

    hf = bench.random_hf_model(args.shape, "cuda")
    quant = None
    if fmt == "int4":
        quant = bench.quantize_randomly(hf)
    elif fmt == "fp8":
        bench.quantize_fp8_in_place(hf)
    torch.cuda.empty_cache()
    runtime = bench.runtime_from_hf(hf, quant)
    del hf
    torch.cuda.empty_cache()
    out = dict(format=fmt, weight_bytes=runtime.weights.nbytes(), rounds=[], bitwise={})

    def set_variant(label: str) -> None:
        runtime.l2_prefetch_bytes = int(label.rstrip("p")) << 20
        runtime.l2_prefetch_pairs = label.endswith("p")

    with torch.inference_mode():
        set_variant("0")
        base = _decode_logits(runtime)
        for label in args.variants[1:]:
            set_variant(label)
            out["bitwise"][label] = bool(torch.equal(_decode_logits(runtime), base))
    log(f"{fmt}: logits bit for bit the same as without: {out['bitwise']}")
    for r in range(args.rounds):
        order = args.variants if r % 2 == 0 else args.variants[::-1]
        row = {}
        for label in order:
            set_variant(label)
            engine = Engine(runtime, None, max_batch=max(args.batches), max_seq_len=128 + args.steps + 2,
                            cuda_graphs=True, graph_buckets=tuple(args.batches))
            row[label] = {str(b): bench.decode_tps(engine, b, args.steps if b == 1 else max(16, args.steps // 2))
                          for b in args.batches}
            del engine
            log(f"{fmt} round {r + 1} prefetch {label:>4}: "
                + ", ".join(f"b{b} {row[label][str(b)]:.1f} tok/s" for b in args.batches))
        out["rounds"].append(row)
    del runtime
    torch.cuda.empty_cache()
    return out


def table(results: list[dict], variants: list[str], batches: list[int]) -> list[str]:
    """Each variant's best round per batch size and its ratio to none ("0")."""
    lines = [f"{'format':<7} {'MB':>4} " + " ".join(f"{'b' + str(b) + ' tok/s':>12} {'x none':>7}" for b in batches)]
    for res in results:
        best = {v: {b: max(r[v][str(b)] for r in res["rounds"]) for b in batches} for v in variants}
        for v in variants:
            cells = " ".join(f"{best[v][b]:>12.1f} {best[v][b] / best['0'][b] if '0' in best else float('nan'):>7.3f}"
                             for b in batches)
            lines.append(f"{res['format']:<7} {v:>4} {cells}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--formats", default="fp8,int4,bf16")
    ap.add_argument("--mbs", default="0,16,32", help="prefetch sizes in MB (QUANTKIT_L2_PREFETCH_MB's choices)")
    ap.add_argument("--plans", default="each", help="QUANTKIT_L2_PREFETCH_PLAN's choices to run: each, pairs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from quantkit.runtime.model import L2_PREFETCH_MB, L2_PREFETCH_PLANS

    try:
        args.mbs = [int(v) for v in args.mbs.split(",")]
        args.batches = [int(v) for v in args.batches.split(",")]
    except ValueError:
        ap.error("--mbs and --batches take comma-separated integers")
    if any(str(mb) not in L2_PREFETCH_MB for mb in args.mbs):
        ap.error(f"--mbs: each among QUANTKIT_L2_PREFETCH_MB's choices {L2_PREFETCH_MB}")
    plans = args.plans.split(",")
    if any(p not in L2_PREFETCH_PLANS for p in plans):
        ap.error(f"--plans: each among QUANTKIT_L2_PREFETCH_PLAN's choices {L2_PREFETCH_PLANS}")
    args.variants = ["0"] + [f"{mb}{'p' if p == 'pairs' else ''}" for mb in args.mbs if mb for p in plans]
    import torch
    import triton

    if not torch.cuda.is_available():
        print("l2_prefetch_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    now = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or f"bench/runs/l2_prefetch_{now:%Y%m%d_%H%M}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    record = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=now.isoformat(timespec="seconds"), shape=args.shape, variants=args.variants, batches=args.batches,
                  steps=args.steps, results=[])

    def log(line):
        print(line, flush=True)

    for fmt in args.formats.split(","):
        record["results"].append(sweep_format(fmt, args, log))
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
    record["table"] = table(record["results"], args.variants, args.batches)
    log("\n".join(record["table"]))
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
