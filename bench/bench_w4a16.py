"""Benchmark the W4A16 Triton GEMM against cuBLAS bf16 and torch._weight_int4pack_mm (one GPU).

    python bench/bench_w4a16.py [--quick] [--variants] [--deadline S] [--out bench/runs/w4a16_<date>.json]

Every timing is the median over CUDA-graph replays; each replay runs the op once on each of
several rotating copies of its inputs (together over 3x the 60 MB L2), so no run finds its weights
in L2 and host launch overhead is out of the numbers (the eager launcher costs ~100+ us of Python
on the device machine's CPU, see NOTES). For M <= 16 the table also gives the bandwidth of the
packed weight bytes (qweight + scales) against a device-to-device copy measured in the same run.
Inputs are random (never zeros); a correctness check against a float32 reference runs per shape.
Writes the JSON and, when matplotlib is installed, a PNG plot beside it (bench/plot_results.py).

``QUANTKIT_W4A16_MODULE`` names the kernel module to time (default ``quantkit.kernels.w4a16``): an A/B against
another version of the kernels stages that version as its own package (e.g. ``main_kernels.w4a16``, see
bench/ab_w4a16.sh) and runs this script once per module in the same device call. Modules from before the
selection table (autotuned on first use) are timed through their own ``choose_path`` and tuner caches.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

kw = importlib.import_module(os.environ.get("QUANTKIT_W4A16_MODULE", "quantkit.kernels.w4a16"))
PLANNED = not hasattr(kw, "choose_path")  # the selection-table API (else: autotuned on first use)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import replay_us  # noqa: E402
from plot_results import plot_after_run  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672)]
MS = [1, 4, 16, 64, 256, 1024, 4096]
GROUP = 128


L2_BYTES = 60 * 2**20


def rotations(bytes_per_call: int, cap: int = 24) -> int:
    """Copies of the inputs so that one pass over all of them overflows L2 three times."""
    return max(2, min(cap, -(-3 * L2_BYTES // max(bytes_per_call, 1))))


def capture_graph(fns) -> torch.cuda.CUDAGraph:
    """One CUDA graph that runs every fn of ``fns`` (rotating inputs) once, replayed once already."""
    for f in fns:
        f()  # compile, autotune, allocator warm-up: all outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def bench_graph(fns, reps: int = 20) -> float:
    """Median microseconds per call over replays of :func:`capture_graph`."""
    graph = capture_graph(fns)
    times = [us / len(fns) for us in replay_us(graph, reps)]
    del graph
    return sorted(times)[len(times) // 2]


def bench(fn) -> float:
    """Median eager time in microseconds (do_bench, L2 flushed): used for the copy only."""
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t_us = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (t_us * 1e-6) / 1e12


def make_weights(n: int, k: int, sym: bool = True):
    """Random GPTQ-layout weights, prepared for the kernel: sym (zero 8, stored as 7) or random zero points."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
    if sym:
        qzeros = torch.full((k // GROUP, n // 8), 0x77777777, dtype=torch.int32, device="cuda")
    else:
        qzeros = torch.randint(-(2**31), 2**31 - 1, (k // GROUP, n // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(k // GROUP, n, device="cuda") * 2e-3 + 1e-3).half()
    w = kw.prepare_w4a16_weights(qweight, qzeros, scales, None, 4, GROUP, sym)
    if PLANNED:
        _PLANS[(n, k)] = w.plan
    return w


_PLANS = {}


def packed_bytes(w) -> int:
    """Bytes of packed weights one call reads: the int32 words and the fp16 scales."""
    return w.qweight.numel() * 4 + w.scales.numel() * 2


def rotating_weights(w0, n: int, k: int) -> list:
    """``w0`` and enough fresh copies of its shape that one pass over all of them overflows L2."""
    return [w0] + [make_weights(n, k) for _ in range(rotations(packed_bytes(w0)) - 1)]


def torch_int4_weights(n: int, k: int):
    """Operands of torch._weight_int4pack_mm: packed weight and bf16 [K/G, N, 2] scales+zeros."""
    w_u8 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, 8)
    sz = torch.rand(k // GROUP, n, 2, device="cuda").bfloat16() * 1e-2
    return packed, sz


def dequant_f32(w) -> torch.Tensor:
    """Float32 ``W^T [K, N]`` of the sym weights made by make_weights."""
    from quantkit.pack import unpack_rows

    codes = unpack_rows(w.qweight.t().contiguous(), w.bits, w.in_features).float()
    return (codes - 2 ** (w.bits - 1)) * w.scales[w.g_idx.long()].float()


def check(w, w_kn: torch.Tensor, m: int, path: str | None = None, config=None) -> float:
    """Relative error of the (autotuned) kernel, or of ``config``'s, against float32 on fresh random bf16 inputs."""
    x = torch.randn(m, w.in_features, device="cuda").bfloat16()
    ref = x.float() @ w_kn
    if config is not None:
        out = kw.w4a16_matmul(x, w, config=config)
    else:
        out = kw.w4a16_matmul(x, w) if path is None else kw.w4a16_matmul(x, w, path=path)  # path: older modules
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_shape(n, k, ms, copy_tbs, rows, variants, deadline=float("inf"), first=False):
    """Time every M of one shape. ``first``: this is the process's first shape, whose first cell is timed twice
    and the first timing dropped: on one H200 the first graph timing of a process read 45.1 / 46.4 us for the
    28672 x 8192, M = 1 cell and the same cell 41.7-42.6 right after, in the same process (session 17,
    ``bench/device_w4a16_first_cell.sh``); main's run-time tuner of the filing code hid it by timing first."""
    ws = [make_weights(n, k)]
    w_kn = dequant_f32(ws[0])
    err = {m: check(ws[0], w_kn, m) for m in (1, 3, 16, 40, 333)}  # the default path at decode and prefill sizes
    dequant = getattr(kw, "DequantConfig", None)  # dequantize-then-cuBLAS, a prefill candidate (no table entry)
    if dequant is not None:
        err["dequant_m333"] = check(ws[0], w_kn, 333, config=dequant())
    probe = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
    if PLANNED:
        paths = sorted({c.kernel for _, c in ws[0].plan.choices})
        variants = False  # the planned API takes a config with every named path: time the plan only
    else:
        paths = (["gemv", "tc"] + (["pairs"] if kw.pairs_supported(ws[0]) else [])
                 + (["gluon"] if kw.gluon_available(probe, ws[0]) else []))
    decode_only = ("gemv",)
    if variants:  # every kernel checked at a decode and a prefill size, not only the default's choice
        err |= {f"{p}_m{m}": check(ws[0], w_kn, m, p) for p in paths for m in (1, 3, 16, 333)
                if p not in decode_only or m <= kw.DECODE_MAX_M}
    del w_kn
    ws = rotating_weights(ws[0], n, k)
    bf16 = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(rotations(2 * n * k))]
    try:
        i4 = [torch_int4_weights(n, k) for _ in range(rotations(packed_bytes(ws[0])))]
    except Exception as e:
        print(f"torch int4 unavailable: {e!r}", file=sys.stderr)
        i4 = []
    for m in ms:
        if time.time() > deadline:
            print(f"deadline: skipping N={n} K={k} M={m}", flush=True)
            continue
        xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(max(len(ws), len(bf16)))]
        row = dict(N=n, K=k, M=m, relerr_m1=err[1], relerr_m3=err[3], relerr_m333=err[333],
                   path=_path(m, ws[0], paths), relerr={str(key): v for key, v in err.items()})
        ours = [lambda x=x, w=w: kw.w4a16_matmul(x, w) for x, w in zip(xs, ws)]
        if first and m == ms[0]:
            bench_graph(ours)  # the warm-up timing, dropped (docstring)
        row["triton_us"] = bench_graph(ours)
        row["cublas_us"] = bench_graph([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, bf16)])
        if dequant is not None and m >= 256:
            row["dequant_cublas_us"] = bench_graph(
                [lambda x=x, w=w: kw.w4a16_matmul(x, w, config=dequant()) for x, w in zip(xs, ws)])
        if i4:
            row["torch_int4_us"] = bench_graph(
                [lambda x=x, p=p: torch._weight_int4pack_mm(x, p[0], GROUP, p[1]) for x, p in zip(xs, i4)])
        if variants:
            # Every other kernel at the same M (the GEMV up to 16 rows): where each one stops paying.
            for other in paths:
                if other == row["path"] or (other in decode_only and m > kw.DECODE_MAX_M):
                    continue
                row[f"triton_{other}_us"] = bench_graph(
                    [lambda x=x, w=w, p=other: kw.w4a16_matmul(x, w, path=p) for x, w in zip(xs, ws)])
            row[f"triton_{row['path']}_us"] = row["triton_us"]
        row["tflops"] = 2 * m * n * k / (row["triton_us"] * 1e-6) / 1e12
        if m <= kw.DECODE_MAX_M:
            tbs = packed_bytes(ws[0]) / (row["triton_us"] * 1e-6) / 1e12
            row["weight_tbs"] = tbs
            row["pct_copy_bw"] = 100 * tbs / copy_tbs
        rows.append(row)
        # One short progress line per point (the full rows go to the JSON): keeps earlier output, such
        # as a test run's summary, inside a log tail.
        print(f"N={n} K={k} M={m} triton {row['triton_us']:.1f} us", flush=True)
        del xs


def _path(m, w, paths) -> str:
    if PLANNED:
        return w.plan.choice(m).kernel
    return kw.choose_path(m, w, "gluon" in paths)


def tuned_configs() -> dict:
    if PLANNED:  # what the plans of the timed shapes hold (filled as shapes are prepared)
        return {f"{n}x{k}": {str(b): c.label() for b, c in plan.choices} for (n, k), plan in _PLANS.items()}
    out = {}
    for name, tuner in (("gemv", kw._gemv_tuned), ("gemv_direct", kw._gemv_direct_tuned), ("decode", kw._decode_tuned),
                        ("prefill", kw._prefill_tuned), ("pairs", kw._pairs_tuned)):
        out[name] = {str(key): str(cfg) for key, cfg in tuner.cache.items()}
    # the timed module's own Gluon tuner (modules from before the selection table had one; today's has none)
    tuner = getattr(sys.modules.get(kw.__name__.rsplit(".", 1)[0] + ".w4a16_gluon"), "GLUON_TUNER", None)
    if tuner is not None:
        out["gluon"] = {str(key): str(cfg) for key, cfg in tuner.cache.items()}
    return out


def print_table(rows, copy_tbs):
    print(f"\ncopy bandwidth {copy_tbs:.2f} TB/s (read+write); us per call, median of graph replays")
    hdr = f"{'N':>6} {'K':>6} {'M':>5} {'triton':>9} {'cublas':>9} {'int4pt':>9} {'xcuBLAS':>7} " \
          f"{'xint4':>6} {'%copy':>6} {'TFLOP/s':>7} {'path':>6} {'gemv':>9} {'gluon':>9} {'pairs':>9} {'tc':>9}"
    print(hdr)
    for r in rows:
        i4 = r.get("torch_int4_us", float("nan"))
        print(f"{r['N']:>6} {r['K']:>6} {r['M']:>5} {r['triton_us']:>9.1f} {r['cublas_us']:>9.1f} "
              f"{i4:>9.1f} {r['cublas_us'] / r['triton_us']:>7.2f} {i4 / r['triton_us']:>6.2f} "
              f"{r.get('pct_copy_bw', float('nan')):>6.1f} {r['tflops']:>7.1f} "
              f"{r.get('path', '-'):>6} " + " ".join(f"{r.get(f'triton_{p}_us', float('nan')):>9.1f}"
                                                   for p in ("gemv", "gluon", "pairs", "tc")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="largest shape, M in 1, 16, 4096 only")
    ap.add_argument("--variants", action="store_true", help="also time every other kernel at each M, and check each")
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds: points not started by then are skipped (the JSON says which ran)")
    ap.add_argument("--shapes", default=None, help="NxK list, e.g. 8192x28672,4096x14336 (default: the issue's)")
    ap.add_argument("--ms", default=None, help="M list, e.g. 1,256 (default: the issue's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    shapes = SHAPES[-1:] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        unknown = [s for s in shapes if s not in SHAPES]
        if unknown:
            ap.error(f"--shapes: {unknown} are not among the benchmark shapes {SHAPES}")
    ms = [1, 16, 4096] if args.quick else MS
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    if args.variants and not args.quick:
        ms = sorted(set(ms) | {2, 8, 32})  # the crossovers between the kernels
    copy_tbs = copy_bandwidth()
    rows = []
    now = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or f"bench/runs/w4a16_{now:%Y%m%d_%H%M}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    def write(complete: bool):
        # Written after every shape too, so that an outer timeout still leaves the finished shapes.
        result = dict(
            card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=now.isoformat(timespec="seconds"), group_size=GROUP, copy_tbs=copy_tbs, complete=complete,
            timing="median of 20 CUDA-graph replays over rotating inputs (>3x L2); copy: do_bench median",
            rows=sorted(rows, key=lambda r: (SHAPES.index((r["N"], r["K"])), r["M"])), tuned=tuned_configs(),
        )
        with open(out, "w") as f:
            json.dump(result, f, indent=1)

    # Largest shapes first: they carry the targets, so a deadline cuts the small ones.
    for i, (n, k) in enumerate(sorted(shapes, key=lambda s: -s[0] * s[1])):
        run_shape(n, k, ms, copy_tbs, rows, args.variants, t0 + args.deadline, first=i == 0)
        torch.cuda.empty_cache()
        write(False)
    rows.sort(key=lambda r: (SHAPES.index((r["N"], r["K"])), r["M"]))
    write(True)
    print_table(rows, copy_tbs)
    plot_after_run(out)


if __name__ == "__main__":
    main()
