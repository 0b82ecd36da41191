"""How long does quantizing a Llama-3-8B-shaped model take on one GPU? (GPTQ, AWQ or RTN)

Builds a model with Llama-3-8B's shapes from a ``LlamaConfig`` (random bf16 weights, no download),
128 x 2048 random calibration tokens, walks it with the chosen method on one device and reports the
total time, the time per layer split into Hessian accumulation / GPTQ solve / the rest (forward
passes, moving the layer), and peak device memory, next to the arithmetic of bench/NOTES_gptq.md
and the matmul rate measured in the same run. Writes JSON under bench/runs/.

    python bench/bench_quantize_8b.py --method gptq               # the whole 8B shape on cuda
    python bench/bench_quantize_8b.py --method gptq --layers 4    # fewer layers
    python bench/bench_quantize_8b.py --method gptq --layers 4 --solver torch   # the column loop, for comparison
    python bench/bench_quantize_8b.py --tiny                      # CPU smoke run (tiny shapes)
    python bench/bench_quantize_8b.py --method gptq --gpus 2      # 2 ranks through torchrun (one GPU each)
    python bench/bench_quantize_8b.py --tiny --gpus 2 --batch-size 2   # 2 gloo ranks on the CPU (smoke run)

``--gpus 1`` (the default) is the single-process path: no torchrun, the walker's no-op communicator.
With ``--gpus N`` the script relaunches itself through torchrun; every rank builds the same random
model (same seed) and rank 0 prints and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "runs"

LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                 "rope_theta": 500000.0, "tie_word_embeddings": False}
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "tie_word_embeddings": False}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=("gptq", "awq", "rtn"), default="gptq")
    p.add_argument("--layers", type=int, default=None, help="decoder layers to build and time (default: all)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a smoke test of this script")
    p.add_argument("--nsamples", type=int, default=None, help="calibration windows (default 128; tiny 8)")
    p.add_argument("--seqlen", type=int, default=None, help="tokens per window (default 2048; tiny 64)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--desc-act", action="store_true")
    p.add_argument("--cli-defaults", action="store_true",
                   help="GPTQ with `quantkit gptq`'s default options (act-order, static groups, Hessian-weighted mse "
                        "search) instead of the options given here (issue 37: the CLI against this path)")
    p.add_argument("--solver", choices=("auto", "torch", "triton"), default="auto",
                   help="GPTQ column solve: auto (the Triton block kernel on CUDA), torch (the column loop), triton")
    p.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    p.add_argument("--batch-size", type=int, default=8, help="calibration windows per forward (each rank needs one)")
    p.add_argument("--gpus", type=int, default=1, help="ranks sharing the work (torchrun; gloo on the CPU)")
    p.add_argument("--activations", choices=("auto", "device", "host"), default="auto",
                   help="where the hidden states between layers live (walk's activations=)")
    p.add_argument("--single-pass-tokens", type=int, default=None,
                   help="GPTQ single_pass_max_tokens (default: the method's; 524288 forces the old single pass here)")
    p.add_argument("--no-overlap", action="store_true",
                   help="move layers and packed weights in line, not in the walker's worker thread (A/B)")
    p.add_argument("--out", default=None, help="JSON path (default bench/runs/quantize_8b_<method>_<date>.json)")
    return p.parse_args()


def build_model(shape: dict, n_layers: int | None, dtype: torch.dtype, fill_device: torch.device):
    """A random LlamaForCausalLM in host memory, in ``dtype``.

    The skeleton is made on the meta device and its weights drawn on ``fill_device`` (the GPU makes
    8B normal samples in well under a second; the CPU's default initialisation takes minutes), then
    copied to host memory, where the walker expects an unquantized model to live.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    params = dict(shape)
    if n_layers is not None:
        params["num_hidden_layers"] = n_layers
    config = LlamaConfig(**params)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # dtype first, on the meta device: to_empty then allocates the bf16 tensors only, no float32 copy of all
    # weights made and converted on the host (the 8B build still took 16-19 s in session 17: the copies from
    # the GPU into fresh host pages dominate; it is not part of the timed walk)
    model = model.to(dtype).to_empty(device="cpu")
    gen = torch.Generator(device=fill_device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, device=fill_device, dtype=dtype).mul_(0.02))
        # Non-persistent buffers (the rotary frequencies) are not parameters: rebuild them.
        rotary = type(model.model.rotary_emb)(config=config)
        model.model.rotary_emb = rotary
    model.eval()
    model.config.use_cache = False
    return model


def measure_ceilings(device: torch.device) -> dict:
    """Dense bf16 and fp32 matmul rates and the cost of one tiny op (the GPTQ column loop's unit)."""
    n = 8192 if device.type == "cuda" else 512

    def rate(dtype) -> float:
        a = torch.randn(n, n, device=device, dtype=dtype)
        torch.matmul(a, a)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            torch.matmul(a, a)
        sync(device)
        return 5 * 2 * n**3 / (time.perf_counter() - t0) / 1e12

    v = torch.randn(4096, device=device)
    for _ in range(10):  # warm up the allocator and the kernel
        v = v.mul(1.0)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(1000):
        v = v.mul(1.0)
    sync(device)
    small_op_us = (time.perf_counter() - t0) * 1e3  # 1000 ops: seconds * 1e6 / 1000
    return {"bf16_tflops": rate(torch.bfloat16), "fp32_tflops": rate(torch.float32), "small_op_us": small_op_us}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def expected(method: str, shape: dict, nsamples: int, seqlen: int, n_layers: int, ceilings: dict) -> dict:
    """The arithmetic of NOTES_gptq.md for these shapes (per layer unless said otherwise).

    GPTQ: the Hessians, one forward of the layer (the single pass propagates while it calibrates), and
    the sequential column steps at ~12 small ops each. AWQ: the full-precision forward that records,
    the scale search (``grid`` block forwards on ``search_samples`` windows), and the forward of the
    quantized layer that makes the next layer's inputs. Compute at the measured bf16 rate; launches excluded.
    """
    h, f = shape["hidden_size"], shape["intermediate_size"]
    n_tokens = nsamples * seqlen
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    params = h * (h + 2 * kv) + h * h + 3 * h * f
    forward = 2 * n_tokens * params + 2 * n_tokens * seqlen * h  # linears + causal attention (QK^T, PV)
    bf16 = ceilings["bf16_tflops"] * 1e12
    if method == "awq":
        grid, search_tokens = 20, min(8, nsamples) * seqlen  # AWQConfig defaults: grid 20, search_samples 8
        # per grid point: the attention block, the MLP block, down alone, o alone
        search = grid * 2 * search_tokens * (params + 2 * seqlen * h + h * f + h * h)
        return {"forward_flop": 2 * forward, "search_flop": search, "forward_s": 2 * forward / bf16,
                "search_s": search / bf16, "total_s": n_layers * (2 * forward + search) / bf16}
    hessian = 2 * n_tokens * (3 * h * h + f * f)  # inputs of q/k/v, o, gate/up (h wide) and down (f wide)
    columns = 3 * h + f  # sequential column steps: stacked qkv, o, stacked gate/up (h each), down (f)
    column_s = columns * 12 * ceilings["small_op_us"] * 1e-6
    return {"hessian_flop": hessian, "forward_flop": forward, "column_steps": columns,
            "hessian_s": hessian / bf16, "forward_s": forward / bf16, "columns_s_at_12_ops": column_s,
            "total_s": n_layers * (hessian / bf16 + forward / bf16 + column_s)}


def run(args: argparse.Namespace) -> dict:
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme
    from quantkit.distributed.launch import setup

    shape = TINY if args.tiny else LLAMA3_8B
    # Outside torchrun (--gpus 1) ``setup`` returns the no-op communicator and the device unchanged.
    comm, device_name = setup(args.gpus, args.device or ("cpu" if args.tiny else "cuda"))
    device = torch.device(device_name)
    nsamples = args.nsamples or (8 if args.tiny else 128)
    seqlen = args.seqlen or (64 if args.tiny else 2048)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    model = build_model(shape, args.layers, dtype, device)
    build_s = time.perf_counter() - t0
    n_layers = model.config.num_hidden_layers
    ceilings = measure_ceilings(device)
    scheme = QuantScheme(4, args.group_size, not args.asym)
    from quantkit.api import build_method

    # Explicit GPTQ options: the README's timings were measured without static groups or MSE (since
    # made the defaults of build_method), so a rerun measures the same work.
    gptq_options = {"desc_act": args.desc_act, "static_groups": False, "mse": False, "solver": args.solver,
                    "single_pass_max_tokens": args.single_pass_tokens}
    if args.cli_defaults:  # build_method's defaults are the CLI's (quantkit.defaults)
        gptq_options = {"solver": args.solver, "single_pass_max_tokens": args.single_pass_tokens}
    method = build_method(args.method, scheme, gptq_options if args.method == "gptq" else None)
    tokens = torch.randint(0, shape["vocab_size"], (nsamples, seqlen), generator=torch.Generator().manual_seed(0))

    rows = []

    def on_layer(event) -> None:
        stats = event.result.stats.values()
        solve = sum(s.get("seconds", 0.0) for s in stats)
        hess = sum(s.get("hessian_seconds", 0.0) for s in stats)
        phases = dict(getattr(event, "phases", {}) or {})
        rows.append({"layer": event.index, "seconds": event.seconds, "hessian_s": hess, "solve_s": solve,
                     "forward_other_s": event.seconds - hess - solve,
                     "peak_gib": event.peak_memory_bytes / 2**30, "phases": phases})
        r = rows[-1]
        steps = "  ".join(f"{k} {v:.2f}" for k, v in phases.items())
        print(f"layer {event.index + 1:3d}/{event.n_layers}  {r['seconds']:7.2f} s  hessian {r['hessian_s']:6.2f}  "
              f"solve {r['solve_s']:6.2f}  forward+other {r['forward_other_s']:6.2f}  peak {r['peak_gib']:6.2f} GiB"
              f"  [{steps}]", flush=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    comm.barrier()  # the ranks start the clock together (a no-op in one process)
    t0 = time.perf_counter()
    result = walk(model, method, device=device, token_ids=tokens if method.needs_calibration else None,
                  batch_size=args.batch_size, on_layer=on_layer if comm.rank == 0 else None, comm=comm,
                  activations=args.activations, overlap=False if args.no_overlap else None)
    sync(device)
    total = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "method": args.method, "gpus": comm.world_size, "activations": args.activations,
        "overlap": not args.no_overlap and os.environ.get("QUANTKIT_OVERLAP", "1") != "0",
        "single_pass_tokens": args.single_pass_tokens, "cli_defaults": args.cli_defaults, "argv": sys.argv[1:], "scheme": {"bits": 4, "group_size": args.group_size, "sym": not args.asym,
                                          "desc_act": args.desc_act},
        "solver": args.solver if args.method == "gptq" else None,
        "shape": {**shape, "num_hidden_layers": n_layers}, "nsamples": nsamples, "seqlen": seqlen,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.processor()}",
        "dtype": str(dtype), "build_model_s": build_s, "total_s": total,
        "capture_s": total - sum(r["seconds"] for r in rows), "walk_s": result.seconds,
        "peak_gib": peak / 2**30, "per_layer": rows, "ceilings": ceilings,
        "expected": expected(args.method, shape, nsamples, seqlen, n_layers, ceilings), "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def print_table(rec: dict) -> None:
    rows = rec["per_layer"]
    n = max(1, len(rows))
    exp = rec["expected"]
    mean = {k: sum(r[k] for r in rows) / n for k in ("seconds", "hessian_s", "solve_s", "forward_other_s")}
    print()
    solver = f" (solver {rec['solver']})" if rec.get("solver") else ""
    print(f"{rec['method']}{solver} on {rec['gpus']} x {rec['device']}, {rec['shape']['num_hidden_layers']} layers, "
          f"{rec['nsamples']} x {rec['seqlen']} tokens")
    print(f"ceilings: bf16 {rec['ceilings']['bf16_tflops']:.0f} TFLOP/s, fp32 {rec['ceilings']['fp32_tflops']:.0f} "
          f"TFLOP/s, one small op {rec['ceilings']['small_op_us']:.1f} us")
    print(f"{'per layer':<22}{'measured s':>12}{'expected s':>12}")
    if rec["method"] == "awq":
        print(f"{'two forwards':<22}{'':>12}{exp['forward_s']:>12.3f}")
        print(f"{'scale search':<22}{'':>12}{exp['search_s']:>12.3f}")
    else:
        print(f"{'hessian':<22}{mean['hessian_s']:>12.3f}{exp['hessian_s']:>12.3f}")
        print(f"{'gptq solve':<22}{mean['solve_s']:>12.3f}{exp['columns_s_at_12_ops']:>12.3f}")
        print(f"{'forward + other':<22}{mean['forward_other_s']:>12.3f}{exp['forward_s']:>12.3f}")
    print(f"{'layer total':<22}{mean['seconds']:>12.3f}")
    phase_names = list(dict.fromkeys(k for r in rows for k in r.get("phases", {})))
    steady = rows[1:] or rows  # layer 0 includes warm-up (kernel compilation)
    for k in phase_names:
        print(f"{'  ' + k:<22}{sum(r['phases'].get(k, 0.0) for r in steady) / len(steady):>12.3f}   (layers 2..)")
    print(f"total {rec['total_s']:.1f} s (input capture {rec['capture_s']:.1f} s), expected ~{exp['total_s']:.1f} s; "
          f"peak device memory {rec['peak_gib']:.2f} GiB; model build {rec['build_model_s']:.1f} s (not counted)")


def main() -> None:
    from quantkit.distributed.launch import is_secondary_rank, launch, needs_launch

    args = parse_args()
    if needs_launch(args.gpus):
        launch([str(Path(__file__).resolve())], sys.argv[1:], args.gpus)
        return
    rec = run(args)
    if is_secondary_rank():
        return
    print_table(rec)
    gpus = f"_{rec['gpus']}gpu" if rec["gpus"] > 1 else ""
    out = Path(args.out) if args.out else RESULTS / (
        f"quantize_8b_{rec['method']}{'_tiny' if args.tiny else ''}{gpus}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
