"""W4A16 decode (M = 1, 4, 16) on the Llama-3-8B layers: every decode variant checked, then timed (one GPU).

    python bench/bench_w4a16_decode.py [--shapes 28672x8192,...] [--ms 1,4,16] [--deadline 270] [--out PATH]

For each shape and M: the kernel the selection table picks today, the CUDA C++ decode GEMM
(``kernels/w4a16_cuda.py``, built with nvcc first, in parallel) at several configs, a few Gluon configs the SASS
analysis suggests (``bench/sass_w4a16_decode.py``), cuBLAS on the bf16 weights and torch's int4 matmul
(``torch.ops.aten._weight_int4pack_mm``). Every W4A16 variant is first checked against the plain-PyTorch reference
(``w4a16_matmul_ref``, float32) on random inputs: the max error relative to the reference's largest value; a variant
above ``--max-err`` is reported and not timed. Timing: ``gpu_timing.gpu_time_us`` (CUDA graphs of 10 calls, L2
evicted by reading 128 MB before each call, less the same graph without the call; best of 5 replays). The copy
bandwidth is measured in the same run on a device-to-device copy of the same bytes as the layer's packed weights
and scales; "% copy" is the variant's read rate of those bytes against it (a copy moves them twice: read + write).

Writes JSON (card, versions, nvcc, date, every cell) to ``--out`` (default ``bench/runs/w4a16_decode_<date>.json``)
after every shape, so a time limit keeps the finished shapes. Where the CUDA kernel's best cell beats today's
pick by more than the run-to-run spread (max(0.5 us, 4 %)) at the same error, the script prints a candidate table
entry naming the card (``candidate_entries``, also in the JSON); each goes into ``kernels/w4a16_h200.json`` only
after a whole-step A/B.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

SHAPES = [(28672, 8192), (8192, 28672), (14336, 4096), (4096, 4096)]
GROUP = 128


def cuda_configs(m: int):
    from quantkit.kernels.w4a16_configs import CudaConfig

    if m <= 8:  # register use in the sm_90a build (bench/sass_w4a16_decode.py): 78-146, no spills
        return [CudaConfig(2, 1, 4), CudaConfig(1, 2, 4), CudaConfig(2, 2, 4), CudaConfig(2, 2, 8),
                CudaConfig(4, 1, 4), CudaConfig(1, 4, 4), CudaConfig(2, 2, 4, L2_256=True),
                CudaConfig(2, 2, 4, SPLITS=1), CudaConfig(2, 1, 4, SPLITS=2)]
    return [CudaConfig(2, 1, 4), CudaConfig(1, 2, 4), CudaConfig(2, 2, 4), CudaConfig(4, 1, 4)]


def gluon_configs(m: int, n: int, k: int):
    """Gluon configs beside today's pick: more resident warps for the direct kernel, and the ring at one CTA per
    SM with a deeper ring (the bare TMA stream's best: bench/archive/NOTES_w4a16.md run 16)."""
    from quantkit.kernels.w4a16_configs import GluonConfig

    out = [GluonConfig(64, 16, 1, 4, CTAS_PER_SM=8, DIRECT=True), GluonConfig(128, 16, 1, 4, CTAS_PER_SM=4, DIRECT=True,
                                                                               UNROLL=2)]
    if n * k >= 1 << 26:
        out += [GluonConfig(128, 16, 8, 4, CTAS_PER_SM=1, X_BOX_K=64), GluonConfig(128, 16, 4, 4, CTAS_PER_SM=4,
                                                                                   X_BOX_K=64)]
    return [c for c in out if c.fits(m, GROUP)]


def make_weights(n: int, k: int, sym: bool = True):
    """bench_w4a16.py's random GPTQ-layout weights (beside this script), prepared for the kernels."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_w4a16 import make_weights as bench_weights

    return bench_weights(n, k, sym)


def max_err(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def prebuild(ms, log) -> dict:
    """Build every CUDA variant the run needs (bf16, sym and asym; the build the launches use, PDL or not), in
    parallel: {(config, mt, asym): built}."""
    import torch

    from quantkit.kernels import w4a16_cuda

    cap = torch.cuda.get_device_capability()
    pdl = w4a16_cuda.cuda_pdl(torch.device("cuda"))
    jobs = {(c, 1 if m <= 8 else 2, zeros) for m in ms for c in cuda_configs(m) for zeros in (False, True)}
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        futs = {pool.submit(w4a16_cuda.library, c, mt, True, zeros, cap, pdl): (c, mt, zeros) for c, mt, zeros in jobs}
        built = {futs[f]: f.result() is not None for f in concurrent.futures.as_completed(futs)}
    log(f"CUDA builds: {sum(built.values())} of {len(built)} in {time.time() - t0:.1f} s "
        f"(nvcc {w4a16_cuda.nvcc_path()}, cache {w4a16_cuda.cache_dir()})")
    return built


def run_shape(n, k, ms, args, log) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from gpu_timing import gpu_time_us

    from quantkit.kernels import w4a16
    from quantkit.kernels.w4a16_configs import CudaConfig, config_label, config_to_dict
    from quantkit.kernels.w4a16_cuda import w4a16_cuda_matmul
    from quantkit.kernels.w4a16_weights import w4a16_matmul_ref

    w = make_weights(n, k)
    w_asym = make_weights(n, k, sym=False)
    weight_bytes = w.qweight.numel() * 4 + w.scales.numel() * 2
    src = torch.empty(weight_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = gpu_time_us(lambda: dst.copy_(src), calls=10, replays=5)
    copy_tbs = 2 * weight_bytes / copy_us / 1e6
    del src, dst
    bf16_w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    try:
        i4 = torch.ops.aten._convert_weight_to_int4pack(
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"), 8)
        i4_sz = torch.rand(k // GROUP, n, 2, device="cuda").bfloat16() * 1e-2
    except Exception as e:  # torch builds without the int4 kernel
        log(f"torch int4 unavailable: {e!r}")
        i4 = None
    rows = []
    for m in ms:
        if time.time() > args.t_end:
            log(f"deadline: skipping {n}x{k} M={m}")
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref, ref_asym = w4a16_matmul_ref(x, w), w4a16_matmul_ref(x, w_asym)
        choice = w.plan.choice(m)
        variants = [("today: " + choice.label(), lambda x=x: w4a16.w4a16_matmul(x, w), None)]
        variants += [(f"cuda {c.R}/{c.U}/{c.W}" + (f" S{c.SPLITS}" if c.SPLITS else "") + (" L2" if c.L2_256 else ""),
                      lambda x=x, c=c: w4a16_cuda_matmul(x, w, c), c) for c in cuda_configs(m)]
        variants += [("gluon " + config_label(c), lambda x=x, c=c: w4a16.w4a16_matmul(x, w, c), c)
                     for c in gluon_configs(m, n, k) if c != choice.config]
        copy_limit_us = weight_bytes / (copy_tbs * 1e6)
        cell = dict(N=n, K=k, M=m, copy_tbs=copy_tbs, copy_limit_us=copy_limit_us, today=choice.label(), variants=[])
        for name, fn, cfg in variants:
            row = dict(name=name)
            if isinstance(cfg, CudaConfig):
                row["cuda_config"] = config_to_dict(cfg)  # the short form a table entry takes
            try:
                row["max_err"] = max_err(fn(), ref)
                if isinstance(cfg, CudaConfig):
                    row["max_err_asym"] = max_err(w4a16_cuda_matmul(x, w_asym, cfg), ref_asym)
                    if w.partial_sums is not None:
                        row["workspace_clean"] = bool((w.partial_sums == 0).all() and (w.tile_counters == 0).all())
                ok = row["max_err"] <= args.max_err and row.get("max_err_asym", 0) <= args.max_err
                if ok and row.get("workspace_clean", True):
                    row["us"] = gpu_time_us(fn, calls=10, replays=5)
                    row["pct_copy"] = 100 * copy_limit_us / row["us"]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            cell["variants"].append(row)
        cell["cublas_us"] = gpu_time_us(lambda x=x: F.linear(x, bf16_w), calls=10, replays=5)
        if i4 is not None:
            cell["torch_int4_us"] = gpu_time_us(lambda x=x: torch._weight_int4pack_mm(x, i4, GROUP, i4_sz),
                                                calls=10, replays=5)
        print_cell(cell, log)
        rows.append(cell)
    return rows


def print_cell(cell, log):
    log(f"\n{cell['N']}x{cell['K']} M={cell['M']}: copy {cell['copy_tbs']:.2f} TB/s (limit "
        f"{cell['copy_limit_us']:.1f} us), cuBLAS {cell['cublas_us']:.1f} us, torch int4 "
        f"{cell.get('torch_int4_us', float('nan')):.1f} us")
    log(f"  {'variant':<58} {'max err':>9} {'us':>7} {'% copy':>7} {'x cuBLAS':>8}")
    for r in cell["variants"]:
        us = r.get("us", float("nan"))
        err = r.get("max_err", float("nan"))
        note = r.get("error", "") or ("" if "us" in r else "  NOT TIMED (error above --max-err or workspace left dirty)")
        log(f"  {r['name'][:58]:<58} {err:>9.2e} {us:>7.1f} {r.get('pct_copy', float('nan')):>7.1f} "
            f"{cell['cublas_us'] / us:>8.2f}{note}")


def candidate_entries(cells: list[dict], card: str, margin_us: float = 0.5, margin: float = 0.04) -> list[dict]:
    """Table entries (``kernels/w4a16_h200.json`` form, naming ``card``) for the cells where the best CUDA variant
    beat today's pick by more than ``max(margin_us, margin x today)``: candidates only. A cell's gain alone does
    not make a default (the 30B-A3B q/k/v cell gained 1.6 us here and nothing in the whole step, docs/kernels.md):
    each goes in after a step A/B (`bash bench/gpu_check.sh ab ...`)."""
    from gpu_timing import proposed_entries

    return proposed_entries(cells, card, "us", lambda v: "cuda_config" in v, margin_us, margin,
                            lambda cell, today, cuda: ("cuda", cuda["cuda_config"], cuda["us"],
                                                       f"measured by bench_w4a16_decode.py: today's pick "
                                                       f"{today['us']:.1f} us"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK list")
    ap.add_argument("--ms", default="1,4,16", help="activation rows list (1-16)")
    ap.add_argument("--deadline", type=float, default=270.0, help="seconds: cells not started by then are skipped")
    ap.add_argument("--max-err", type=float, default=1e-2, help="largest max error (relative) a timed variant may have")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    if any(not 1 <= m <= 16 for m in ms):
        ap.error("--ms: the decode kernels take 1 to 16 rows")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_timing import gpu_run, log, run_cells

    started = gpu_run("w4a16_decode", args.out)
    if started is None:
        return 2
    result, out = started

    from quantkit.kernels.w4a16_configs import config_label

    args.t_end = time.time() + args.deadline
    built = prebuild(ms, log)
    result.update(group_size=GROUP, timing="gpu_timing.gpu_time_us: 10 calls a graph, L2 evicted by reading, best of 5",
                  cuda_builds={f"{config_label(c)} mt={mt} asym={z}": ok for (c, mt, z), ok in built.items()})
    run_cells(result, out, shapes, lambda s: run_shape(*s, ms, args, log), lambda s: f"{s[0]}x{s[1]}",
              candidate_entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
