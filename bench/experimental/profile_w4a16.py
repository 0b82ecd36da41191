"""Where the Gluon W4A16 kernel's time goes, per config and per launched kernel (one Hopper GPU).

    python bench/profile_w4a16.py [--shapes 4096x4096,28672x8192] [--ms 4,32] [--out DIR]

For each shape and M it prints
* every fitting Gluon config timed as bench_w4a16.py times the default path (CUDA-graph replays over
  rotating weights, L2 cold), next to the config the tuner picks, so a wrong pick shows;
* the kernels one default call launches (the activation gather, the float32 zeroing, the GEMM, the
  cast), each with its GPU time from the profiler over graph replays: the fixed cost per call that
  the GEMM's streaming rate does not explain.
The rows also go to ``DIR/w4a16_profile_<date>.json`` with the card, versions and date.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_w4a16 import bench_graph, capture_graph, make_weights, rotating_weights  # noqa: E402

from quantkit.kernels import w4a16 as kw  # noqa: E402
from quantkit.kernels import w4a16_gluon as kg  # noqa: E402


def config_times(ws, xs, m: int) -> list[dict]:
    """Every fitting candidate, graph-timed over the rotating weights, with its relative error."""
    rows = []
    w0 = ws[0]
    for cfg in kg.GLUON_TUNER.candidates(m, w0.group_size):
        ref = kw.w4a16_matmul_ref(xs[0], w0).float()
        err = ((kg._launch(xs[0], w0, cfg).float() - ref).norm() / ref.norm()).item()
        us = bench_graph([lambda x=x, w=w, c=cfg: kg._launch(x, w, c) for x, w in zip(xs, ws)])
        rows.append(dict(config=str(cfg), us=us, relerr=err))
    return rows


def kernel_breakdown(ws, xs, replays: int = 20) -> list[dict]:
    """GPU time of each kernel that one default call launches (profiler over CUDA-graph replays)."""
    fns = [lambda x=x, w=w: kw.w4a16_matmul(x, w) for x, w in zip(xs, ws)]
    graph = capture_graph(fns)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    count = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += getattr(ev, "device_time", None) or ev.cuda_time
            count[ev.name] += 1
    calls = replays * len(fns)
    return [dict(kernel=name[:90], per_call_us=total[name] / calls, launches_per_call=count[name] / calls)
            for name in sorted(total, key=total.get, reverse=True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,28672x8192")
    ap.add_argument("--ms", default="4,32")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=now.isoformat(timespec="seconds"), rows=[])
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w0 = make_weights(n, k)
        ws = rotating_weights(w0, n, k)
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in ws]
            kw.w4a16_matmul(xs[0], w0)  # tunes (graph-timed, see ConfigTuner)
            key = (kg.GLUON_TUNER.m_bucket(m), n, k, w0.group_size, False, torch.bfloat16)
            pick = kg.GLUON_TUNER.cache.get(key)
            configs = config_times(ws, xs, m)
            breakdown = kernel_breakdown(ws, xs)
            default_us = bench_graph([lambda x=x, w=w: kw.w4a16_matmul(x, w) for x, w in zip(xs, ws)])
            print(f"\nN={n} K={k} M={m}: default path {kw.choose_path(m, w0, True)} {default_us:.1f} us, "
                  f"tuner pick {pick}")
            for r in sorted(configs, key=lambda r: r["us"]):
                mark = "*" if pick is not None and r["config"] == str(pick) else " "
                print(f"  {mark} {r['us']:8.1f} us  err {r['relerr']:.1e}  {r['config']}")
            for r in breakdown:
                print(f"    {r['per_call_us']:8.2f} us x{r['launches_per_call']:.0f}  {r['kernel']}")
            result["rows"].append(dict(N=n, K=k, M=m, default_us=default_us, pick=str(pick), configs=configs,
                                       kernels=breakdown))
            del xs
        del ws, w0
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"w4a16_profile_{now:%Y%m%d_%H%M}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
