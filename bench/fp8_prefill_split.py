"""Where an FP8 prefill's time goes on the Llama-3-8B shape (issue 42: FP8 prefill >= 1.4x bf16): one prompt of
2048, 4096 and 8192 tokens on the runtime with the FP8 attention as ``fp8="auto"`` picks it and forced off, the
attention of all layers alone in FP8 and in 16 bits, the per-token activation quantization against a copy of the
same bytes, and a profile of one prefill of the first length (the kernels taking the most device time, and the host
synchronizations, which stall the launch queue, and the host's CPU time by op: whether the GPU or the launch queue
sets the pace).

    python bench/fp8_prefill_split.py [--lengths 2048,4096,8192] [--repeat 10] [--out PATH]

Random weights built on the GPU (`quantkit.tools.bench`). Prints a table and writes JSON (card, versions, date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--repeat", type=int, default=10, help="whole prefills timed per variant (median kept)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import transformers
    import triton

    from quantkit.kernels.fp8_quant import quantize_per_token
    from quantkit.runtime.engine import Engine
    from quantkit.tools import bench

    lengths = [int(n) for n in args.lengths.split(",")]
    hf = bench.random_hf_model(args.shape, "cuda")
    bench.quantize_fp8_in_place(hf)
    runtime = bench.runtime_from_hf(hf, None, max_positions=max(lengths) + 1)
    del hf
    torch.cuda.empty_cache()
    engine = Engine(runtime, None, max_batch=1, max_seq_len=max(lengths) + 1, cuda_graphs=False)
    s = runtime.spec
    record = {"card": torch.cuda.get_device_name(), "shape": args.shape,
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "python": platform.python_version()},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "lengths": {}}
    print(f"{'tokens':>7} {'prefill auto':>13} {'prefill 16b-attn':>17} {'attn fp8':>9} {'attn 16b':>9}  (ms)")
    for n in lengths:
        prompt = torch.randint(0, s.vocab_size, (n,)).tolist()
        qkv = torch.randn(n, s.q_size + 2 * s.kv_size, device="cuda", dtype=runtime.dtype)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        row = {}
        for label, fp8 in (("auto", "auto"), ("attention_16bit", False)):
            runtime.prefill_fp8 = fp8
            runtime.prefill([prompt], [0], engine.cache)  # compile / warm
            walls = []
            for _ in range(args.repeat):
                walls.append(1e3 * bench.sync_time(lambda: runtime.prefill([prompt], [0], engine.cache)))
            # wall times of a whole prefill vary run to run by far more than the device time does (the host
            # launches ~480 kernels): the median is the figure, the min and the spread are kept beside it
            row[f"prefill_{label}_ms"] = statistics.median(walls)
            row[f"prefill_{label}_ms_min_max"] = [min(walls), max(walls)]
        for label, fp8 in (("fp8", True), ("16bit", False)):
            runtime.prefill_fp8 = fp8
            attend = runtime.prefill_attend(cu, n, kv_aligned=n % 32 == 0)
            layers = lambda attend=attend: [attend(i, qkv) for i in range(s.num_layers)]  # noqa: E731
            layers()
            row[f"attention_{label}_ms"] = 1e3 * bench.sync_time(layers, 3)
        runtime.prefill_fp8 = "auto"
        record["lengths"][str(n)] = row
        print(f"{n:>7} {row['prefill_auto_ms']:>13.2f} {row['prefill_attention_16bit_ms']:>17.2f} "
              f"{row['attention_fp8_ms']:>9.2f} {row['attention_16bit_ms']:>9.2f}")

    quant = {}
    for k in (s.hidden_size, s.intermediate_size):
        x = torch.randn(2048, k, device="cuda", dtype=runtime.dtype)
        dst = torch.empty_like(x)
        quantize_per_token(x)
        us = 1e6 * bench.sync_time(lambda x=x: [quantize_per_token(x) for _ in range(20)], 3) / 20
        copy_us = 1e6 * bench.sync_time(lambda x=x, dst=dst: [dst.copy_(x) for _ in range(20)], 3) / 20
        quant[f"2048x{k}"] = {"quantize_us": us, "bf16_copy_us": copy_us}
        print(f"quantize_per_token 2048 x {k}: {us:.1f} us (a bf16 copy of x: {copy_us:.1f} us)")
    record["activation_quant"] = quant

    n = lengths[0]
    prompt = torch.randint(0, s.vocab_size, (n,)).tolist()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        runtime.prefill([prompt], [0], engine.cache)
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_time = [(e.key, e.device_time_total / 1e3, e.count) for e in events if e.device_time_total > 0]
    device_time.sort(key=lambda t: -t[1])
    # the host's side: CPU self time by op (the profiler adds its own cost per op, so this overstates the host
    # time; compared with the device total it says whether the launch queue or the GPU sets the pace)
    host_time = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events if e.self_cpu_time_total > 0),
                       key=lambda t: -t[1])
    kernels_ms = sum(ms for key, ms, _ in device_time if not key.startswith(("aten::", "cuLaunch", "cuda")))
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or "Memcpy" in e.key or e.key == "aten::item"}
    record[f"profile_{n}"] = {"top_kernels_ms": [[k, round(ms, 3), c] for k, ms, c in device_time[:25]],
                              "host_syncs": syncs, "device_kernels_total_ms": round(kernels_ms, 3),
                              "host_self_ms_total_profiled": round(sum(ms for _, ms, _ in host_time), 3),
                              "top_host_ops_ms": [[k, round(ms, 3), c] for k, ms, c in host_time[:15]]}
    print(f"{n}-token FP8 prefill, device time by kernel (ms, calls):")
    for key, ms, count in device_time[:25]:
        print(f"  {ms:8.3f} {count:5d}  {key[:110]}")
    print("host synchronizations and copies:", syncs)
    print(f"device time in kernels {kernels_ms:.2f} ms; host CPU self time under the profiler "
          f"{sum(ms for _, ms, _ in host_time):.2f} ms, by op:")
    for key, ms, count in host_time[:15]:
        print(f"  {ms:8.3f} {count:5d}  {key[:110]}")
    out = Path(args.out or Path(__file__).parent / "runs" / "fp8_prefill_split.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
