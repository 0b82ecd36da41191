"""W4A16 at prefill sizes (M >= 256) on the Llama-3-8B layers: today's pick beside the CUTLASS mixed-input GEMM's
configs, dequantize-then-cuBLAS, and cuBLAS on 16-bit weights (one Hopper GPU).

    python bench/bench_w4a16_prefill.py [--shapes 6144x4096,...] [--ms 256,1024,2048,4096] [--deadline 300]
                                        [--out PATH]

Every variant is first checked against the plain-PyTorch reference (float32) at M = 333 (a partial tile) and at each
timed M: the error's norm relative to the reference's; a variant above ``--max-err`` is not timed. The CUTLASS
configs (``kernels/w4a16_cutlass.py``) are built with nvcc first, in parallel; without nvcc or CUTLASS's headers
they are left out, saying why. They are timed on the operands the runtime makes at load (the layer's codes in
place, bf16 scales and zero terms); one more row makes those small tensors on every call, and one times the first
build (signed codes: a copy of the weights with every nibble XOR 8, scales alone) at the leading tile. Where a
config beats today's pick, the JSON's ``candidate_entries`` hold a card-specific table entry: candidates for a
whole-prefill A/B, not defaults. cuBLAS runs twice: on random bf16 weights (what a 16-bit model's layer costs) and
on the quantized layer's dequantized weights (the same GEMM on low-entropy values: tensor cores draw less power on
them, and at 4096 rows that showed as a faster cuBLAS, docs/kernels.md). Timing: ``gpu_timing.gpu_time_us`` (CUDA
graphs, L2 evicted by reading before each call, best of 5 replays). Writes JSON (card, versions, nvcc, date, every
cell) to ``--out`` after every cell.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B: q/k/v, o, gate/up, down
MS = [256, 1024, 2048, 4096]


def cutlass_configs():
    from quantkit.kernels.w4a16_configs import CutlassConfig as C

    return [C(128, 128), C(128, 128, 2), C(128, 256), C(128, 256, 2), C(256, 128), C(64, 128, 1, True),
            C(64, 256, 2, True)]


# the first build's codes: GPTQ's unsigned code c as the two's complement c - 8 (every nibble XOR 8)
SIGN_FLIP = -0x77777778  # 0x88888888 as an int32
LEAD = 2  # index of the leading config in cutlass_configs() (128x256 cooperative, H100 2026-12-07)


def prebuild(log, jobs=None) -> dict:
    """The CUTLASS builds ``jobs`` ((config, signed) pairs; default: every build the run times), in parallel:
    {(config, signed): built}."""
    import torch

    from quantkit.kernels import w4a16_cutlass

    cap = torch.cuda.get_device_capability()
    if jobs is None:
        jobs = [(c, False) for c in cutlass_configs()] + [(cutlass_configs()[LEAD], True)]
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 4)) as pool:
        futs = {pool.submit(w4a16_cutlass.library, c, cap, signed): (c, signed) for c, signed in jobs}
        built = {futs[f]: f.result() is not None for f in concurrent.futures.as_completed(futs)}
    log(f"CUTLASS builds: {sum(built.values())} of {len(built)} in {time.time() - t0:.1f} s "
        f"(headers {w4a16_cutlass.include_dirs()})")
    return built


def build_table(path: str, log) -> int:
    """Builds the CUTLASS configs the entries of the W4A16 table at ``path`` name; 1 where one fails."""
    from quantkit.kernels.w4a16_configs import config_from_dict

    with open(path) as f:
        entries = json.load(f)["entries"]
    configs = {config_from_dict("cutlass", e["config"]) for e in entries if e["kernel"] == "cutlass"}
    built = prebuild(log, [(c, False) for c in sorted(configs, key=str)])
    for (c, _), ok in built.items():
        log(f"{c}: {'built' if ok else 'FAILED'}")
    return 0 if all(built.values()) else 1


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_shape(n, k, ms, built, args, log) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from bench_w4a16 import dequant_f32, make_weights
    from gpu_timing import gpu_time_us, l2_evict_buffer

    from quantkit.kernels import w4a16, w4a16_cutlass
    from quantkit.kernels.w4a16_configs import DequantConfig, config_label, config_to_dict
    from quantkit.kernels.w4a16_weights import w4a16_matmul_ref

    flush = l2_evict_buffer("cuda")

    def timed(fn):
        return gpu_time_us(fn, flush, calls=5, replays=5)

    w, w_asym = make_weights(n, k), make_weights(n, k, sym=False)  # asymmetric: checked once, not timed
    operands = w4a16_cutlass.prepare(w)
    signed = dataclasses.replace(operands, codes=torch.bitwise_xor(w.qweight, SIGN_FLIP), zero_terms=None)
    w_dq = dequant_f32(w).t().contiguous().bfloat16()  # [N, K]
    w_random = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    variants = [("today", lambda x: w4a16.w4a16_matmul(x, w), None),
                ("dequant+cuBLAS", lambda x: w4a16.w4a16_matmul(x, w, config=DequantConfig()), None)]
    variants += [(f"cutlass {config_label(c)}", lambda x, c=c: w4a16_cutlass.w4a16_cutlass_matmul(x, w, c, operands),
                  c) for c in cutlass_configs() if built.get((c, False))]
    lead = cutlass_configs()[LEAD]
    bare = dataclasses.replace(w, cutlass=None)
    if built.get((lead, False)):  # scales and zero terms made on every call, as without the load-time operands
        variants.append((f"cutlass {config_label(lead)}, operands made per call",
                         lambda x: w4a16_cutlass.w4a16_cutlass_matmul(x, bare, lead), None))
    if built.get((lead, True)):
        variants.append((f"cutlass {config_label(lead)}, signed-code build",
                         lambda x: w4a16_cutlass.w4a16_cutlass_matmul(x, w, lead, signed), None))
    x333 = torch.randn(333, k, device="cuda", dtype=torch.bfloat16)
    ref333 = w4a16_matmul_ref(x333, w)
    asym_err = None
    if built.get((lead, False)):
        asym_err = rel_err(w4a16_cutlass.w4a16_cutlass_matmul(x333, w_asym, lead), w4a16_matmul_ref(x333, w_asym))
    errs333 = {}
    for name, fn, _ in variants:
        try:
            errs333[name] = rel_err(fn(x333), ref333)
        except Exception as e:  # a config this shape cannot take
            errs333[name] = f"{type(e).__name__}: {e}"[:300]
    cells = []
    for m in ms:
        if time.time() > args.t_end:
            log(f"deadline: skipping {n}x{k} M={m}")
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = w4a16_matmul_ref(x, w)
        cell = dict(N=n, K=k, M=m, today=w.plan.choice(m).label(), cutlass_asym_err_m333=asym_err,
                    cublas_us=timed(lambda: F.linear(x, w_random)),
                    cublas_dequantized_us=timed(lambda: F.linear(x, w_dq)), variants=[])
        for name, fn, config in variants:
            row = dict(name=name, err_m333=errs333[name])
            if config is not None:
                row["config"] = config_to_dict(config)
            if isinstance(errs333[name], float):
                try:
                    row["err"] = rel_err(fn(x), ref)
                    if row["err"] <= args.max_err and errs333[name] <= args.max_err:
                        row["us"] = timed(lambda fn=fn: fn(x))
                        row["x_cublas"] = cell["cublas_us"] / row["us"]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
            cell["variants"].append(row)
        print_cell(cell, log)
        cells.append(cell)
    return cells


def print_cell(cell, log):
    log(f"\n{cell['N']}x{cell['K']} M={cell['M']}: cuBLAS {cell['cublas_us']:.1f} us (on dequantized weights "
        f"{cell['cublas_dequantized_us']:.1f}); today {cell['today']}")
    log(f"  {'variant':<60} {'err':>9} {'us':>8} {'x cuBLAS':>8}")
    for r in sorted(cell["variants"], key=lambda r: r.get("us", float("inf"))):
        note = r.get("error", "") or ("" if "us" in r else f"  not timed ({r.get('err_m333')})")
        log(f"  {r['name'][:60]:<60} {r.get('err', float('nan')):>9.2e} {r.get('us', float('nan')):>8.1f} "
            f"{r.get('x_cublas', float('nan')):>8.2f}{note[:120]}")


def candidate_entries(cells: list[dict], card: str, margin_us: float = 1.0, margin: float = 0.05) -> list[dict]:
    """Table entries (``kernels/w4a16_h200.json`` form, ``"kernel": "cutlass"``, naming ``card``) for the cells where
    the best CUTLASS config beat today's pick by more than ``max(margin_us, margin x today)``: candidates for a
    whole-prefill A/B."""
    from gpu_timing import proposed_entries

    return proposed_entries(cells, card, "us", lambda v: "config" in v, margin_us, margin, lambda cell, today, best: (
        "cutlass", best["config"], best["us"],
        f"bench_w4a16_prefill.py: today's pick {today['us']:.1f} us, cuBLAS {cell['cublas_us']:.1f}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK list")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="activation rows list")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds: cells not started by then are skipped")
    ap.add_argument("--max-err", type=float, default=1e-2, help="largest relative error a timed variant may have")
    ap.add_argument("--out", default=None)
    ap.add_argument("--build-table", metavar="TABLE", default=None,
                    help="only build the CUTLASS configs this W4A16 table's entries name (before timing with it)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_timing import gpu_run, log, run_cells

    if args.build_table:
        return build_table(args.build_table, log)
    started = gpu_run("w4a16_prefill", args.out)
    if started is None:
        return 2
    result, out = started

    args.t_end = time.time() + args.deadline
    built = prebuild(log)
    result.update(timing="gpu_timing.gpu_time_us: 5 calls a graph, L2 evicted by reading, best of 5",
                  builds={f"{c} signed={signed}": ok for (c, signed), ok in built.items()})
    # row counts outer, in --ms order: a run cut by the deadline keeps the first rows' cells for every layer
    items = [(n, k, m) for m in ms for n, k in shapes]
    run_cells(result, out, items, lambda it: run_shape(it[0], it[1], [it[2]], built, args, log),
              lambda it: f"{it[0]}x{it[1]} M={it[2]}", candidate_entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
