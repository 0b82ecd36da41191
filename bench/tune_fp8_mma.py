"""The tensor-core FP8 decode GEMM (kernels/gemv_fp8_mma.py) on this GPU: its configs at Llama-3-8B's linears and
decode batch sizes, each checked against the float32 reference, then timed beside what the runtime runs today.

    python bench/tune_fp8_mma.py [--shapes 6144x4096,...] [--ms 1,8,32] [--deadline 120] [--jobs 12] [--out PATH]

Candidates: BLOCK_N 64 or 128 (the FP8 warpgroup MMA's side), BLOCK_K 128 or 256, 3 or 4 stages, K split 1, 2, 4
or 8, where each split keeps a pipeline's depth of K steps and the pipeline fits 112 KB of shared memory (two
programs an SM), plus ``mma_config``'s rule. Compiled first in ``--jobs`` spawned processes (Triton's disk cache
then serves this process). Each (shape, M) cell times, as a served model runs them (``gpu_timing.gpu_time_us``:
CUDA-graph replays, L2 evicted by reading before each call):

* every candidate's kernel alone on codes quantized once (``us``), after checking its output against
  ``gemv_fp8_mma_ref`` (relative error; bf16 output rounding is ~4e-3);
* ``quant_us``: the per-token quantization kernel alone, which every path but the fused GEMV runs first;
* what the FP8 linear runs today (``fp8_linear`` as prepared by default, the quantization kernel first: the
  CUDA-core GEMV at one row, this GEMM with the rule's config at 2..64), the same linear with
  ``QUANTKIT_FP8_GEMV=mma`` (this GEMM from one row), and the bf16 linear on the bf16 weight
  (``dispatch.dense_linear``), all with their input preparation.

GB/s and "% copy" count the weight codes and scales read, against a device-to-device copy of the same bytes in the
same run. Block-level picks have mis-ranked configs in whole steps before (docs/moe.md): the closing table is for
choosing candidates; ``quantkit bench --shape llama3-8b --formats fp8,bf16`` under the switches decides
(``bash bench/gpu_check.sh fp8-step``). Writes JSON (card, versions, date, every cell) to ``--out`` after every cell.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from tuning import interpreter_fix, precompile_in_workers, timer  # bench/tuning.py, beside this script

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
SMEM_LIMIT = 112 * 1024


def candidates(m: int, n: int, k: int) -> list:
    from quantkit.kernels.gemv_fp8_mma import Fp8MmaConfig, mma_config, smem_bytes

    out = [mma_config(m, n, k)]
    for bn in (64, 128):
        for bk in (128, 256):
            for stages in (3, 4):
                for split in (1, 2, 4, 8):
                    cfg = Fp8MmaConfig(bn, min(bk, max(16, 1 << (k - 1).bit_length())), split, 4, stages)
                    if (smem_bytes(cfg, m) <= SMEM_LIMIT and k // cfg.block_k // split >= stages
                            and cfg not in out):
                        out.append(cfg)
    return out


def label(cfg) -> str:
    return f"{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} k{cfg.split_k}"


def _compile(tasks: list, device: str) -> int:
    """In a worker process: run each (n, k, m, config) once so that Triton compiles it into its disk cache."""
    if device == "cpu":
        interpreter_fix()
    import torch

    from quantkit.kernels.gemv_fp8_mma import Fp8MmaConfig, gemv_fp8_mma

    weights, done = {}, 0
    for n, k, m, cfg in tasks:
        if (n, k) not in weights:  # tasks come sorted by shape: one weight a shape
            weights[(n, k)] = (torch.zeros(n, k, device=device, dtype=torch.float8_e4m3fn),
                               torch.ones(1, n, device=device))
        w, ws = weights[(n, k)]
        x = torch.zeros(m, k, device=device, dtype=torch.float8_e4m3fn)
        try:
            gemv_fp8_mma(x, torch.ones(m, 1, device=device), w, ws, config=Fp8MmaConfig(*cfg))
            done += 1
        except Exception:  # reported when the cell checks it
            pass
    return done


def precompile(cells, jobs: int, until: float, device: str, log) -> None:
    """Compile every candidate of every cell in ``jobs`` spawned processes (``tuning.precompile_in_workers``)."""
    tasks = sorted({(n, k, m, (c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages))
                    for n, k, m in cells for c in candidates(m, n, k)})
    precompile_in_workers(tasks, _compile, jobs, until, device, log)


def run_cell(n: int, k: int, m: int, args, time_us, device: str, copy_tbs: float, log) -> dict:
    import torch

    from quantkit.fp8_linear import fp8_linear, prepare_fp8_linear
    from quantkit.kernels.dispatch import dense_linear
    from quantkit.kernels.fp8_quant import quantize_per_token
    from quantkit.kernels.gemv_fp8_mma import gemv_fp8_mma, gemv_fp8_mma_ref

    gen = torch.Generator(device=device).manual_seed(n + k + m)
    w16 = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16()
    ws = w16.float().abs().amax(dim=1) / 448
    wq = (w16.float() / ws[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=gen, device=device).bfloat16()
    qx, xs = quantize_per_token(x)
    ref = gemv_fp8_mma_ref(qx, xs, wq, ws.reshape(1, n), out_dtype=torch.float32)
    nbytes = n * k + 4 * n
    rows = []
    for cfg in candidates(m, n, k):
        if time.time() > args.t_end:
            log("  deadline: no more candidates in this cell")
            break
        row = {"config": label(cfg), "cfg": cfg.__dict__}
        try:
            y = gemv_fp8_mma(qx, xs, wq, ws, config=cfg)
            row["err"] = ((y.float() - ref).norm() / ref.norm()).item()
            if row["err"] <= args.max_err:
                row["us"] = time_us(lambda cfg=cfg: gemv_fp8_mma(qx, xs, wq, ws, config=cfg), args.replays)
        except Exception as e:  # a config this Triton cannot build: reported, not timed
            row["error"] = repr(e)[:200]
        rows.append(row)
    timed = [r for r in rows if "us" in r]
    cell = {"N": n, "K": k, "M": m, "rows": rows, "rule": rows[0]["config"] if rows else None}
    cell["quant_us"] = time_us(lambda: quantize_per_token(x), args.replays)
    today = prepare_fp8_linear(wq, ws, "channel", device=device)
    os.environ["QUANTKIT_FP8_GEMV"] = "mma"
    try:
        mma = prepare_fp8_linear(wq, ws, "channel", device=device)
    finally:
        del os.environ["QUANTKIT_FP8_GEMV"]
    cell["fp8_today_us"] = time_us(lambda: fp8_linear(x, today), args.replays)
    cell["fp8_mma_rule_us"] = time_us(lambda: fp8_linear(x, mma), args.replays)
    cell["bf16_us"] = time_us(lambda: dense_linear(x, w16), args.replays)
    if timed:
        best = min(timed, key=lambda r: r["us"])
        cell["best"] = {"config": best["config"], "us": best["us"], "with_quant_us": best["us"] + cell["quant_us"],
                        "gbs": nbytes / best["us"] / 1e3, "copy_share": nbytes / best["us"] / 1e6 / copy_tbs}
    for r in sorted(timed, key=lambda r: r["us"])[:5]:
        log(f"  {r['config']:<18} {r['us']:7.1f} us  {nbytes / r['us'] / 1e3:6.0f} GB/s  err {r['err']:.1e}")
    log(f"  quantization {cell['quant_us']:.1f} us; fp8 today {cell['fp8_today_us']:.1f} us, fp8 mma (rule) "
        f"{cell['fp8_mma_rule_us']:.1f} us, bf16 {cell['bf16_us']:.1f} us")
    return cell






def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK list")
    ap.add_argument("--ms", default="1,8,32", help="activation rows list (1-64)")
    ap.add_argument("--deadline", type=float, default=120.0,
                    help="seconds from the start: compiling stops waiting at 40%% of it, a cell past it times no "
                         "further candidates and later cells are skipped")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU cores - 2, at most 12)")
    ap.add_argument("--replays", type=int, default=3, help="CUDA-graph replays per timing")
    ap.add_argument("--max-err", type=float, default=1e-2, help="largest relative error a timed config may have")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a CPU check of this script (Triton's interpreter, --shapes 64x512, wall-clock timing): "
                         "exercises every step, measures nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        args.shapes, args.max_err = "64x512", 0.5  # the interpreter rounds to e4m3 its own way
        args.jobs = 0 if args.jobs is None else args.jobs
        interpreter_fix()
    elif args.jobs is None:
        args.jobs = min(12, max(1, (os.cpu_count() or 2) - 2))
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        ap.error("--shapes takes NxK,NxK and --ms 1,8,32")
    if any(not 1 <= m <= 64 for m in ms):
        ap.error("--ms: the tensor-core GEMM takes 1 to 64 rows")
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("tune_fp8_mma: needs a CUDA GPU (torch sees none); --smoke checks the script on the CPU",
              file=sys.stderr)
        return 2
    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    device, time_us = timer(args.smoke)
    t0 = time.time()
    args.t_end = t0 + args.deadline
    now = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or f"bench/runs/fp8_mma_{now:%Y%m%d_%H%M}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    def log(line):
        print(line, flush=True)

    cells = [(n, k, m) for m in ms for n, k in shapes]
    precompile(cells, args.jobs, t0 + 0.4 * args.deadline, device, log)
    result = dict(card="CPU smoke run" if args.smoke else torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=now.isoformat(timespec="seconds"), deadline_s=args.deadline,
                  timing=f"gpu_timing.gpu_time_us: 10 calls a graph, L2 evicted by reading, best of {args.replays} "
                         "replays", cells=[], copy_tbs={}, complete=False)
    for i, (n, k, m) in enumerate(cells):
        if time.time() > args.t_end:
            log(f"deadline: {n}x{k} M={m} and {len(cells) - i - 1} more cells not run")
            break
        log(f"[{i + 1}/{len(cells)}] {n}x{k} M={m} ({time.time() - t0:.0f} s)")
        key = f"{n}x{k}"
        if key not in result["copy_tbs"]:
            src = torch.empty(n * k + 4 * n, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            result["copy_tbs"][key] = 2 * src.numel() / time_us(lambda: dst.copy_(src), 5) / 1e6
        result["cells"].append(run_cell(n, k, m, args, time_us, device, result["copy_tbs"][key], log))
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    log("| N x K | M | best config | us | % copy | + quant | fp8 today | fp8 mma (rule) | bf16 |")
    log("|---|---|---|---|---|---|---|---|---|")
    for c in result["cells"]:
        b = c.get("best")
        log(f"| {c['N']}x{c['K']} | {c['M']} | {b['config'] if b else '-'} | {b['us'] if b else 0:.1f} | "
            f"{100 * b['copy_share'] if b else 0:.0f} | {b['with_quant_us'] if b else 0:.1f} | "
            f"{c['fp8_today_us']:.1f} | {c['fp8_mma_rule_us']:.1f} | {c['bf16_us']:.1f} |")
    result["complete"] = len(result["cells"]) == len(cells)
    result["seconds"] = time.time() - t0
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
