"""Why bench/tune_w4a16.py and bench/bench_w4a16.py disagree on one config (issue #23: 28672 x 8192 at M = 1, the
table's config: 39.3-39.8 us by the tuner's first timing, 42.4 by its second, 45.8 by the benchmark).

One process, one config, every way the two scripts time it (bench/NOTES_w4a16.md, session 16):

* ``tuner_gpu_time``: ``gpu_timing.gpu_time_us`` (the tuner's first timing: the best of CUDA-graph replays of
  8 x (read 128 MB to evict L2, call), less the same graph without the call);
* ``graph_tuner_order`` / ``graph_bench_order``: ``bench_w4a16.bench_graph`` (the median of 20 replays of one graph
  over 2 rotating weight copies; the tuner's second timing and the benchmark's), with the copies made as the tuner
  makes them (the float32 reference of the first still allocated) and as the benchmark does (after freeing it);
  three times each, alternating, explicit config and through the layer's plan;
* ``graph_8_copies``: the same with 8 copies a replay, so a replay's start-up is shared by 8 calls, not 2;
* ``replay_overhead``: the median replay time of a graph of one tiny kernel (what each replay adds);
* ``alt_*``: the same for the runner-up (the M = 2-8 entries' config: 128-column tiles, 4 CTAs an SM), which the
  run-time tuner of main before the table picked (41.4 us in the benchmark of the 2026-12-02 A/B).

    python bench/experimental/w4a16_timing_gap.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_w4a16 import bench_graph, capture_graph, dequant_f32, make_weights, rotating_weights  # noqa: E402
from gpu_timing import gpu_time_us, l2_evict_buffer, replay_us  # noqa: E402

from quantkit.kernels import w4a16 as kw  # noqa: E402
from quantkit.kernels.w4a16_configs import config_from_dict  # noqa: E402
from quantkit.kernels.w4a16_select import load_table  # noqa: E402

N, K, M = 28672, 8192, 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    entry = next(e for e in load_table() if (e["n"], e["k"], e["m"]) == (N, K, M))
    cfg = entry["config"]  # load_table builds the config
    alt = config_from_dict("gluon", dict(BLOCK_N=128, BLOCK_M=16, NUM_BUF=4, CTAS_PER_SM=4, X_BOX_K=64))
    res = {"shape": [N, K, M], "config": str(cfg), "table_us": entry.get("us"),
           "card": torch.cuda.get_device_name(), "runs": {}}

    def add(name, value):
        res["runs"].setdefault(name, []).append(round(value, 2))
        print(name, round(value, 2), flush=True)

    w = make_weights(N, K)
    ref_w = dequant_f32(w)  # alive while the tuner makes its copies
    x = torch.randn(M, K, device="cuda").bfloat16()
    err = ((kw.w4a16_matmul(x, w, config=cfg).float() - x.float() @ ref_w).norm()
           / (x.float() @ ref_w).norm()).item()
    res["rel_err"] = err
    evict = l2_evict_buffer("cuda")
    for _ in range(2):
        add("alt_tuner_gpu_time", gpu_time_us(lambda: kw.w4a16_matmul(x, w, config=alt), evict,
                                              replays=20))
        add("tuner_gpu_time", gpu_time_us(lambda: kw.w4a16_matmul(x, w, config=cfg), evict,
                                          replays=20))
    tuner_ws = rotating_weights(w, N, K)
    del ref_w, evict
    torch.cuda.empty_cache()
    bench_ws = rotating_weights(make_weights(N, K), N, K)
    xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(8)]
    for _ in range(3):
        for name, ws in (("graph_tuner_order", tuner_ws), ("graph_bench_order", bench_ws)):
            add(name, bench_graph([lambda x=x, w=w: kw.w4a16_matmul(x, w, config=cfg)
                                   for x, w in zip(xs, ws)]))
            add(name + "_planned", bench_graph([lambda x=x, w=w: kw.w4a16_matmul(x, w) for x, w in zip(xs, ws)]))
            add("alt_" + name, bench_graph([lambda x=x, w=w: kw.w4a16_matmul(x, w, config=alt)
                                            for x, w in zip(xs, ws)]))
    eight = bench_ws + [make_weights(N, K) for _ in range(8 - len(bench_ws))]
    for _ in range(2):
        add("alt_graph_8_copies", bench_graph([lambda x=x, w=w: kw.w4a16_matmul(x, w, config=alt)
                                               for x, w in zip(xs, eight)]))
        add("graph_8_copies", bench_graph([lambda x=x, w=w: kw.w4a16_matmul(x, w, config=cfg)
                                           for x, w in zip(xs, eight)]))
    tiny = torch.zeros(1, device="cuda")
    graph = capture_graph([lambda: tiny.add_(1)])
    add("replay_overhead", statistics.median(replay_us(graph, 20)))
    res["medians"] = {k: statistics.median(v) for k, v in res["runs"].items()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w4a16_timing_gap.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["medians"]))


if __name__ == "__main__":
    main()
