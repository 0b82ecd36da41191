"""A/B of the bf16 decode GEMV (kernels/gemv.py) against cuBLAS (issue 22), in one process on one H200:

1. the GEMV against ``F.linear`` and a float32 product at Llama-3-8B's linear shapes, M = 1, 2, 4 (relative errors);
2. each 8B linear at M = 1 (and the default config at M = 4): cuBLAS and every GEMV candidate config, GPU time under
   CUDA-graph replay with L2 evicted (``kernels/gpu_timing.gpu_time_us``), the best config per shape;
3. the runtime's bf16 decode at batch 1 (``--shape``, ``--steps``) on one model: cuBLAS (``QUANTKIT_BF16_GEMV=0``)
   and the GEMV with the configs kernels/gemv.py ships, tok/s (median of ``--repeats``), the per-part time split, and
   a greedy check of the graph decode against the prefill path. Part 2 prints the fastest candidate of each shape as
   a ``TUNED_M1`` table; to time a new table in the runtime, paste it into kernels/gemv.py and run again.

The candidates are passed to ``gemv(..., config=...)``; nothing in the library is patched.

    python bench/ab_bf16_gemv.py --out bench/results/ab_bf16_gemv_<date>.json
    python bench/ab_bf16_gemv.py --tiny --shape smollm2-135m --steps 2 --repeats 1 --out /tmp/ab.json  # CPU smoke

Prints tables; writes JSON (card, versions, date) after every part.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Llama-3-8B's decode linears [N, K] and how often a token runs each
SHAPES_8B = {"qkv": (6144, 4096, 32), "o": (4096, 4096, 32), "gate_up": (28672, 4096, 32), "down": (4096, 14336, 32),
             "lm_head": (128256, 4096, 1)}
SHAPES_TINY = {"qkv": (96, 80, 2), "o": (64, 64, 2), "lm_head": (300, 64, 1)}
ENV_SWITCH = "QUANTKIT_BF16_GEMV"
# Configs timed at M = 1 (BLOCK_N, BLOCK_K, NUM_WARPS); the first is the reference column. Registers (sm_90, M = 1):
# 4 x 2048 / 8 warps 72, 8 x 1024 / 4 127.
CANDIDATES = ((4, 2048, 8), (8, 1024, 4), (2, 2048, 8), (4, 1024, 4), (2, 1024, 4), (8, 2048, 8))


def _weights(shapes: dict, dtype, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    return {name: (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
            for name, (n, k, _) in shapes.items()}


def check(weights: dict, ms: tuple[int, ...]) -> list[dict]:
    """Relative errors of the GEMV (default config) against cuBLAS and the float32 product."""
    from quantkit.kernels.gemv import gemv

    rows = []
    for name, w in weights.items():
        for m in ms:
            x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)
            bias = torch.randn(w.shape[0], device=w.device, dtype=w.dtype) if m == 2 else None
            y, ref16 = gemv(x, w, bias), F.linear(x, w, bias)
            ref32 = x.float() @ w.float().T + (0 if bias is None else bias.float())
            rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
            rows.append({"linear": name, "N": w.shape[0], "K": w.shape[1], "M": m, "bias": bias is not None,
                         "rel_err_vs_cublas": rel(y, ref16), "rel_err_vs_fp32": rel(y, ref32),
                         "cublas_rel_err_vs_fp32": rel(ref16, ref32)})
            logging.info("check %s M=%d: rel err vs cuBLAS %.2e, vs fp32 %.2e (cuBLAS vs fp32 %.2e)", name, m,
                         rows[-1]["rel_err_vs_cublas"], rows[-1]["rel_err_vs_fp32"], rows[-1]["cublas_rel_err_vs_fp32"])
    return rows


def _timer(device):
    if torch.device(device).type == "cuda":
        from gpu_timing import gpu_time_us, l2_evict_buffer  # bench/, this script's folder

        flush = l2_evict_buffer(device)
        return lambda fn: gpu_time_us(fn, flush, calls=8, replays=5)

    def cpu_us(fn):  # the smoke run: wall time of one call, to exercise the code only
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    return cpu_us


def time_linears(weights: dict, shapes: dict) -> dict:
    """us per call at M = 1: cuBLAS and each candidate; at M = 4: cuBLAS and the default config."""
    from quantkit.kernels.gemv import DenseGemvConfig, gemv

    timer = _timer(next(iter(weights.values())).device)
    out = {"m1": {}, "m4": {}}
    for name, w in weights.items():
        n, k = w.shape
        x1 = torch.randn(1, k, device=w.device, dtype=w.dtype)
        row = {"cublas": timer(lambda: F.linear(x1, w))}
        for block_n, block_k, warps in CANDIDATES:
            cfg = DenseGemvConfig(block_n, block_k, warps)
            row[_label(cfg)] = timer(lambda c=cfg: gemv(x1, w, None, c))
        best = min((key for key in row if key != "cublas"), key=row.get)
        row["best"], row["gbs_best"] = best, n * k * w.element_size() / row[best] / 1e3
        out["m1"][name] = row
        logging.info("M=1 %s %dx%d: %s", name, n, k, ", ".join(f"{key} {v:.1f}" for key, v in row.items()
                                                              if isinstance(v, float)) + f"; best {best}")
        x4 = torch.randn(4, k, device=w.device, dtype=w.dtype)
        out["m4"][name] = {"cublas": timer(lambda: F.linear(x4, w)), "gemv_default": timer(lambda: gemv(x4, w))}
    keys = [key for key in next(iter(out["m1"].values())) if key not in ("best", "gbs_best")]
    per_token = {key: sum(out["m1"][name][key] * shapes[name][2] for name in out["m1"]) for key in keys}
    per_token["per_shape_best"] = sum(out["m1"][name][out["m1"][name]["best"]] * shapes[name][2] for name in out["m1"])
    out["per_token_linears_us"] = per_token
    out["best_single_config"] = min((key for key in keys if key != "cublas"), key=per_token.get)
    out["tuned"] = {f"{w.shape[0]}x{w.shape[1]}": out["m1"][name]["best"] for name, w in weights.items()}
    return out


def _label(cfg) -> str:
    return f"{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}w"


def _engine(model, cuda: bool):
    from quantkit.runtime.engine import Engine

    return Engine(model, None, max_batch=1, max_seq_len=2049, cuda_graphs=cuda, graph_buckets=(1,))


def runtime_ab(shape: str, steps: int, repeats: int, device) -> dict:
    """The runtime's bf16 decode at batch 1 with the GEMV off and on (its shipped configs)."""
    from quantkit.tools import bench

    cuda = torch.device(device).type == "cuda"
    hf = bench.random_hf_model(shape, device, dtype=torch.bfloat16 if cuda else torch.float32)
    model = bench.runtime_from_hf(hf, None, backend="kernels" if cuda else "reference")
    del hf
    gc.collect()
    variants = {"cublas": {ENV_SWITCH: "0"}, "gemv": {ENV_SWITCH: "1"}}
    engines, out = {}, {}
    for name, env in variants.items():  # the selection is made at capture: each engine captures under its setting
        with _env(env):
            engines[name] = _engine(model, cuda)
            out[name] = {"env": env, "runs": []}
    for _ in range(repeats):  # interleaved, so drift hits every variant alike
        for name, env in variants.items():
            with _env(env):
                out[name]["runs"].append(bench.decode_tps(engines[name], 1, steps))
    for name, env in variants.items():
        out[name]["decode_tps_b1"] = statistics.median(out[name]["runs"])
        if cuda:
            with _env(env):
                out[name]["time_split_ms"] = bench.time_split(engines[name])
                out[name]["greedy_check"] = bench.greedy_agreement(_engine(model, cuda))
        logging.info("%s: %.1f tok/s (%s) %s", name, out[name]["decode_tps_b1"],
                     ", ".join(f"{t:.1f}" for t in out[name]["runs"]), out[name].get("time_split_ms", ""))
    return out


class _env:
    """Set environment variables for a block (the GEMV switch is read at every call)."""

    def __init__(self, values: dict):
        self.values, self.saved = values, {}

    def __enter__(self):
        for key, value in self.values.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _interpreter_for_tiny() -> None:
    """The smoke run executes the kernel in Triton's interpreter, whose run-time loop bounds NumPy >= 2.4 rejects
    (the same fix as tests/kernels/conftest.py); set before any kernel module is imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _card(device) -> dict:
    if torch.device(device).type == "cuda":
        from quantkit.tools import bench, bench_run

        return bench_run._card() | {"copy_bandwidth_gbs": bench.copy_bandwidth(device)}
    return {"gpu": None, "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def _print_tables(record: dict) -> None:
    timing = record["linears"]
    keys = [key for key in next(iter(timing["m1"].values())) if key not in ("best", "gbs_best")]
    print("\nM = 1, us per call (graph replays, L2 evicted)")
    print("| linear | " + " | ".join(keys) + " | best | best GB/s |")
    print("|---|" + "---|" * (len(keys) + 2))
    for name, row in timing["m1"].items():
        print(f"| {name} | " + " | ".join(f"{row[key]:.1f}" for key in keys) + f" | {row['best']} | "
              f"{row['gbs_best']:.0f} |")
    print("| per token | " + " | ".join(f"{timing['per_token_linears_us'][key]:.0f}" for key in keys)
          + f" | per-shape best {timing['per_token_linears_us']['per_shape_best']:.0f} | |")
    print("\nTUNED_M1 = {" + ", ".join(
        f"({shape.replace('x', ', ')}): DenseGemvConfig({best.replace('x', ', ').replace('/', ', ').rstrip('w')})"
        for shape, best in timing["tuned"].items()) + "}")
    print("\nM = 4: " + ", ".join(f"{name} cuBLAS {row['cublas']:.1f} / GEMV {row['gemv_default']:.1f} us"
                                 for name, row in timing["m4"].items()))
    if "runtime" in record:
        print("\n| runtime bf16 b=1 | tok/s | runs | linears ms | graph step ms |")
        print("|---|---|---|---|---|")
        for name, row in record["runtime"].items():
            split = row.get("time_split_ms", {})
            linears, step = split.get("linears", float("nan")), split.get("decode_step_graph", float("nan"))
            print(f"| {name} {row['env']} | {row['decode_tps_b1']:.1f} | "
                  + ", ".join(f"{t:.1f}" for t in row["runs"]) + f" | {linears:.3f} | {step:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: Triton interpreter, tiny shapes")
    parser.add_argument("--out", default=f"bench/results/ab_bf16_gemv_{datetime.date.today()}.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.tiny:
        _interpreter_for_tiny()
    device = "cpu" if args.tiny else "cuda"
    shapes, dtype = (SHAPES_TINY, torch.float32) if args.tiny else (SHAPES_8B, torch.bfloat16)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"card": _card(device), "shape": args.shape, "steps": args.steps, "tiny": args.tiny}
    weights = _weights(shapes, dtype, device)
    record["check"] = check(weights, (1, 2, 4))
    out.write_text(json.dumps(record, indent=2))
    record["linears"] = time_linears(weights, shapes)
    out.write_text(json.dumps(record, indent=2))
    del weights
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    record["runtime"] = runtime_ab(args.shape, args.steps, args.repeats, device)
    out.write_text(json.dumps(record, indent=2))
    _print_tables(record)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
