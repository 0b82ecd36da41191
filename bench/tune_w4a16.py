"""The opt-in W4A16 tuner: times candidate configs on this GPU and writes the selection table.

    python bench/tune_w4a16.py [--shapes 4096x4096,...] [--ms 1,16,2048] [--deadline S] [--replays 20] \\
        [--confirm 3] [--out kernels/w4a16_h200.json]

For each (N, K, M bucket) it runs the kernel family the selection rules give on Hopper (the Gluon kernels, or
the GEMV at one row on small layers: ``w4a16_select._small_for_gluon``) with every candidate below that fits,
checks each against a float32 reference, times it as a served model runs it (CUDA-graph replays with L2
evicted before each call: ``gpu_timing.gpu_time_us``, the best of ``--replays`` replays), then times the
``--confirm`` fastest of those again as bench/bench_w4a16.py does (the median of 20 CUDA-graph replays over
rotating copies of the weights, >3x L2) together with the table's current config, and keeps the fastest by that
second timing. (The first timing alone picked a config for 28672 x 8192 at M = 1 that it read as 39.3 us and
the benchmark as 45.8: the second one is what the README tables report.) Jobs run in priority order (the Llama-3-8B shapes at M = 1, 16, 2048 first) and the table is rewritten
after each, so a deadline leaves a valid table: entries not re-measured keep their earlier value and source.
The candidates are the run-time tuners' lists as they stood when tuning moved here; only configs this script
picks are shipped (kernels/w4a16_h200.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import triton

from quantkit.kernels import w4a16 as kw
from quantkit.kernels.w4a16_configs import GemvConfig, GluonConfig, config_to_dict
from quantkit.kernels.w4a16_select import TABLE_PATH, _small_for_gluon, facts_of, m_bucket

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_w4a16 import bench_graph, dequant_f32, make_weights, rotating_weights  # noqa: E402
from gpu_timing import gpu_time_us, l2_evict_buffer  # noqa: E402

GROUP = 128
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
BENCH = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672)]
SMALL = [(576, 1536), (2048, 1024)]  # one row goes to the GEMV here

G = GluonConfig
DIRECT = [G(128, 16, 1, 4, 4, DIRECT=True), G(256, 16, 1, 8, 2, DIRECT=True), G(128, 16, 1, 4, 3, DIRECT=True),
          G(256, 16, 1, 8, 2, DIRECT=True, GATHER_X=True), G(128, 16, 1, 4, 4, DIRECT=True, GATHER_X=True),
          G(128, 16, 1, 4, 4, DIRECT=True, UNROLL=2)]
DECODE = [G(128, 16, 6, 4, 3, X_BOX_K=64), G(128, 16, 4, 4, 4, X_BOX_K=64), G(128, 16, 4, 4, 2, X_BOX_K=64),
          G(128, 16, 6, 4, 2, X_BOX_K=64), G(256, 16, 4, 4, 2, X_BOX_K=64), G(256, 16, 5, 8, 2, X_BOX_K=64),
          G(128, 16, 8, 4, 2, X_BOX_K=64), G(64, 16, 8, 4, 3, X_BOX_K=64)] + DIRECT
MID = [G(128, 32, 6, 4, 2), G(64, 32, 8, 4, 2), G(64, 64, 4, 4, 2)]
PREFILL = [G(256, 128, 4, 8, WGMMA=True, STREAM_K=False), G(128, 128, 5, 8, WGMMA=True, STREAM_K=False),
           G(128, 64, 6, 8, WGMMA=True, STREAM_K=False),
           G(256, 128, 4, 8, WGMMA=True, STREAM_K=False, PERSISTENT=True),
           G(128, 128, 5, 8, WGMMA=True, STREAM_K=False, PERSISTENT=True),
           G(128, 64, 6, 8, WGMMA=True, STREAM_K=False, PERSISTENT=True),
           G(128, 64, 6, 8, WGMMA=True, STREAM_K=True), G(128, 128, 5, 8, WGMMA=True, STREAM_K=True)]
GEMV_DIRECT = [GemvConfig(8, 512, 4, PIPE=3, SPLIT_K=1), GemvConfig(16, 512, 4, PIPE=3, SPLIT_K=1),
               GemvConfig(16, 512, 4, PIPE=6, SPLIT_K=1), GemvConfig(8, 512, 4, PIPE=8, SPLIT_K=1),
               GemvConfig(16, 256, 4, PIPE=8, SPLIT_K=1), GemvConfig(32, 256, 4, PIPE=4, SPLIT_K=1),
               GemvConfig(8, 256, 2, PIPE=8, SPLIT_K=1), GemvConfig(8, 1024, 4, PIPE=4, SPLIT_K=1)]


def candidates(m: int, w) -> tuple[str, list]:
    """The family and its fitting candidates for ``m`` rows of the prepared layer ``w``."""
    if _small_for_gluon(m_bucket(m), w.facts()):
        return "gemv", [c for c in GEMV_DIRECT if c.fits(m, w.group_size)]
    pool = DECODE if m <= 16 else MID + PREFILL if m <= 64 else PREFILL
    return "gluon", [c for c in pool if c.fits(m, w.group_size) and (not c.DIRECT or w.partial_sums is not None)]


def tune(n: int, k: int, m: int, evict, replays: int, confirm: int, incumbent: dict | None) -> dict:
    """The fastest correct candidate for (N, K, M) by the benchmark's timing, and its times. incumbent: the
    table's current entry (its config is confirmed beside the new leaders when it is still a candidate)."""
    w = make_weights(n, k)
    ref_w = dequant_f32(w)
    x = torch.randn(m, k, device="cuda").bfloat16()
    ref = x.float() @ ref_w
    kernel, pool = candidates(m, w)
    times = {}
    for cfg in pool:
        out = kw.w4a16_matmul(x, w, config=cfg)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            print(f"  WRONG {n}x{k} M={m} {cfg}: rel. err {err:.3g}", flush=True)
            continue
        times[cfg] = gpu_time_us(lambda c=cfg: kw.w4a16_matmul(x, w, config=c), evict,
                                 replays=replays)
    leaders = sorted(times, key=times.get)[:confirm]
    old = None
    if incumbent is not None and incumbent.get("kernel") == kernel:
        old = next((c for c in times if config_to_dict(c) == incumbent["config"]), None)
        if old is not None and old not in leaders:
            leaders.append(old)
    ws = rotating_weights(w, n, k)
    xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in ws]
    bench_us = {c: bench_graph([lambda x=x, w=w, c=c: kw.w4a16_matmul(x, w, config=c)
                                for x, w in zip(xs, ws)]) for c in leaders}
    for c in leaders:
        print(f"  {config_to_dict(c)}: tuner {times[c]:.1f} us, bench {bench_us[c]:.1f} us"
              + (" (the table's)" if c == old else ""), flush=True)
    best = min(bench_us, key=bench_us.get)
    entry = dict(n=n, k=k, m=m_bucket(m), kernel=kernel, config=config_to_dict(best), us=round(bench_us[best], 1),
                 tuner_us=round(times[best], 1), candidates=len(times))
    if old is not None:
        entry["previous"] = dict(config=incumbent["config"], us=round(bench_us[old], 1))
    del ws, xs
    return entry


def write_table(path: str, entries: dict, meta: dict) -> None:
    """The table: a header and one entry per line (readable and diffable)."""
    rows = sorted(entries.values(), key=lambda e: (e["n"] * e["k"], e["n"], e["m"]))
    head = json.dumps(meta, indent=1)[:-2]
    body = ",\n".join("  " + json.dumps(e) for e in rows)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(head + ',\n "entries": [\n' + body + "\n ]\n}\n")
    os.replace(tmp, path)  # never a half-written table


def jobs(shapes, ms):
    first = [(n, k, m) for (n, k) in LLAMA3_8B for m in (1, 16, 2048) if (n, k) in shapes and m in ms]
    rest = [(n, k, m) for (n, k) in shapes for m in ms if (n, k, m) not in first]
    return first + rest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="NxK list (default: Llama-3-8B, the bench grid, two small)")
    ap.add_argument("--ms", default="1,4,16,32,64,256,1024,2048,4096")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds; later jobs are skipped")
    ap.add_argument("--replays", type=int, default=20, help="CUDA-graph replays of the first timing (best of)")
    ap.add_argument("--confirm", type=int, default=3, help="leaders re-timed as the benchmark times (median)")
    ap.add_argument("--out", default=str(TABLE_PATH))
    ap.add_argument("--base", default=str(TABLE_PATH), help="table whose entries are kept where not re-measured")
    args = ap.parse_args()
    t0 = time.time()
    shapes = list(dict.fromkeys(LLAMA3_8B + BENCH + SMALL))
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    with open(args.base) as f:
        base = json.load(f)
    entries = {(e["n"], e["k"], e["m"]): e for e in base["entries"]}
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {key: value for key, value in base.items() if key != "entries"}
    meta.update(card=torch.cuda.get_device_name(), dtype="bfloat16", group_size=GROUP, sym=True,
                made_by=f"bench/tune_w4a16.py on {now:%Y-%m-%d %H:%M} UTC (torch {torch.__version__}, triton "
                        f"{triton.__version__}); entries whose source is not 'tuned' come from --base")
    evict = l2_evict_buffer("cuda")
    done = 0
    for n, k, m in jobs(shapes, ms):
        if time.time() - t0 > args.deadline:
            print(f"deadline: {n}x{k} M={m} not tuned", flush=True)
            continue
        facts = facts_of(n, k, 4, GROUP, True, False)
        assert facts.paired, f"{n}x{k}: the tuner covers the paired layout (K a multiple of 128)"
        entry = tune(n, k, m, evict, args.replays, args.confirm, entries.get((n, k, m_bucket(m))))
        entry["source"] = f"tuned {now:%Y-%m-%d}"
        entries[(n, k, entry["m"])] = entry
        done += 1
        print(f"{n}x{k} M={m}: {entry['kernel']} {entry['config']} {entry['us']} us "
              f"({entry['candidates']} candidates, {time.time() - t0:.0f} s)", flush=True)
        write_table(args.out, entries, meta)
    print(f"{done} entries tuned in {time.time() - t0:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
