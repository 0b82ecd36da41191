"""FP8 decode GEMV configs on this GPU: every candidate checked, then timed, beside today's two-launch path and
bf16, on Llama-3-8B's linears at M = 1, 2, 4.

    python bench/tune_fp8_gemv.py [--path codes|fused] [--shapes 6144x4096,...] [--ms 1,2,4] [--deadline 120]
                                  [--jobs 12] [--out PATH]

``--path codes`` (the default) tunes the GEMV on e4m3 codes, ``gemv(qx, w, scales=)`` in kernels/gemv.py: the
runtime's kernel at one row, where the norm or activation kernel in front writes the codes; it is timed alone (the
codes made once, outside the timing) and its picks print as ``TUNED_FP8_CODES`` lines for this card. ``--path
fused`` tunes the one-launch GEMV that quantizes its own activations (kernels/gemv_fp8.py, ``TUNED_FP8``).

Candidates: BLOCK_N in 1, 2, 4, 8, 16, BLOCK_K in 512 .. 8192, 4 or 8 warps, the next weight tile requested a step
ahead or not (``prefetch``), kept where ``gemv_fp8.fits`` says the tile fits (every thread owns a weight vector: 8
codes fused, 16 on codes; BLOCK_K within K, (M + 1) x the thread's share of the tile at most ``MAX_TILE_FLOATS``
float32 registers: past it the sm_90 build spills). All of them are compiled first, in ``--jobs`` worker processes
(Triton's disk cache then serves this process). Each (shape, M) cell then:

* checks every candidate on random bf16 activations against the float32 reference (``gemv_fp8_ref``): the max
  error relative to the reference's largest value (a bf16 output rounding is ~4e-3); one above ``--max-err`` is
  reported and not timed. ``same`` says whether it equals the two-launch path bit for bit (the same codes and
  scales; the float32 sums group differently where the config differs, and on the GPU also at the same config,
  as the two-launch path reads 16-byte weight vectors and this kernel 8-byte ones: tests/kernels/test_gemv_fp8.py
  checks the bitwise case with ``vec=8``);
* times each as a served model runs it (``gpu_timing.gpu_time_us``: CUDA-graph replays, L2 evicted before each
  call), then the ``--confirm`` fastest and the table's current config again with more replays, and keeps the
  fastest by that second timing;
* times the two-launch path's GEMV (codes in) at each confirmed config too (``two_launch_us`` in a row; the fastest
  as ``two_launch_best``): its own configs are bf16's with BLOCK_K doubled (``gemv._fp8_codes_config``);
* times today's two-launch path (``quantize_per_token``, then ``gemv(..., scales=)`` at its default config), the
  runtime's bf16 linear on the bf16 weight (``dispatch.dense_linear``: quantkit's bf16 GEMV at M = 1, cuBLAS
  above) and cuBLAS (``F.linear``); "x bf16" compares with the runtime's.

GB/s counts the weight codes and scales read; "% copy" is that rate against a device-to-device copy of the same
bytes measured in the same run (a copy moves them twice: read + write). The closing table gives, per cell, the
pick, the table's config, the two-launch path and bf16, the time of one token's 32 layers of these linears at
each M (the lm_head, bf16 in both models, is not in it), and the ``TUNED_FP8`` lines to paste into
kernels/gemv_fp8.py. Writes JSON (card, versions, date, every cell) to ``--out`` (default
``bench/runs/fp8_gemv_<date>.json``) after every cell, so the deadline keeps the finished cells.
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
LAYERS = 32
BLOCK_NS, BLOCK_KS, WARPS = (1, 2, 4, 8, 16), (512, 1024, 2048, 4096, 8192), (4, 8)


def candidates(m: int, k: int, path: str) -> list:
    from quantkit.kernels.gemv import DenseGemvConfig
    from quantkit.kernels.gemv_fp8 import fits

    out = [DenseGemvConfig(bn, bk, w, prefetch=p) for bn in BLOCK_NS for bk in BLOCK_KS for w in WARPS
           for p in (False, True)]
    return [c for c in out if fits(c, m, k, vec=16 if path == "codes" else 8)]


def label(cfg) -> str:
    return f"{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}w" + ("+pf" if cfg.prefetch else "")


def cfg_fields(cfg) -> list:
    return [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.prefetch]


def runner(path: str, x, wq, ws):
    """``run(cfg)``: the kernel ``--path`` tunes at ``cfg`` on these operands (codes: ``x`` quantized once, here, as
    the kernel in front of the linear would write it)."""
    import torch

    from quantkit.kernels.fp8_quant import quantize_per_token
    from quantkit.kernels.gemv import gemv
    from quantkit.kernels.gemv_fp8 import gemv_fp8

    if path == "fused":
        return lambda cfg: gemv_fp8(x, wq, ws, config=cfg)
    qx, sx = quantize_per_token(x)
    return lambda cfg: gemv(qx, wq, None, config=cfg, scales=(sx, ws), out_dtype=torch.bfloat16)


def table_config(path: str, m: int, n: int, k: int, card: str | None):
    from quantkit.kernels.gemv import _fp8_codes_config
    from quantkit.kernels.gemv_fp8 import fp8_gemv_config

    return fp8_gemv_config(m, n, k) if path == "fused" else _fp8_codes_config(m, n, k, card)


def _compile(tasks: list, device: str) -> int:
    """In a worker process: launch gemv_fp8 once per (n, k, m, config), so Triton compiles it into its disk cache
    (the same arguments' alignment as the timed calls, hence the same cache key). Returns the number compiled."""
    if device == "cpu":  # --smoke: the interpreter (TRITON_INTERPRET=1 came with the environment)
        interpreter_fix()
    import torch

    from quantkit.kernels.gemv import DenseGemvConfig

    weights, done = {}, 0
    for n, k, m, cfg, path in tasks:
        if (n, k) not in weights:
            weights[(n, k)] = (torch.zeros(n, k, device=device, dtype=torch.float8_e4m3fn),
                               torch.ones(1, n, device=device))
        try:
            run = runner(path, torch.zeros(m, k, device=device, dtype=torch.bfloat16), *weights[(n, k)])
            run(DenseGemvConfig(*cfg))
            done += 1
        except Exception:  # reported when the cell checks it
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    return done




def precompile(cells, jobs: int, until: float, device: str, log, path: str) -> None:
    """Compile every candidate of every cell in ``jobs`` spawned processes (``tuning.precompile_in_workers``)."""
    tasks = sorted({(n, k, m, tuple(cfg_fields(c)), path) for n, k, m in cells for c in candidates(m, k, path)})
    precompile_in_workers(tasks, _compile, jobs, until, device, log)


class Shape:
    """One layer's FP8 weight (codes, per-channel scales), its bf16 original and the copy bandwidth of its bytes."""

    def __init__(self, n: int, k: int, device: str, time_us):
        import torch

        gen = torch.Generator(device=device).manual_seed(n + k)
        self.n, self.k = n, k
        self.w16 = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16()
        self.ws = (self.w16.float().abs().amax(dim=1) / 448).reshape(1, n).contiguous()
        self.wq = (self.w16.float() / self.ws.reshape(n, 1)).to(torch.float8_e4m3fn)
        self.bytes = n * k + 4 * n  # codes and scales
        src = torch.empty(self.bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        self.copy_tbs = 2 * self.bytes / time_us(lambda: dst.copy_(src), 5) / 1e6


def run_cell(shape: Shape, m: int, args, us, log) -> dict:
    import torch
    import torch.nn.functional as F

    from quantkit.kernels.dispatch import dense_linear
    from quantkit.kernels.fp8_quant import quantize_per_token
    from quantkit.kernels.gemv import gemv
    from quantkit.kernels.gemv_fp8 import gemv_fp8_ref

    n, k, wq, ws = shape.n, shape.k, shape.wq, shape.ws
    x = torch.randn(m, k, device=wq.device, generator=torch.Generator(device=wq.device).manual_seed(m)).bfloat16()
    ref = gemv_fp8_ref(x, wq, ws, out_dtype=torch.float32)
    run = runner(args.path, x, wq, ws)

    def two_launch(config=None):  # the quantization kernel, then the GEMV on codes at its own config or ``config``
        qx, sx = quantize_per_token(x)
        return gemv(qx, wq, None, config=config, scales=(sx, ws), out_dtype=torch.bfloat16)

    def max_err(y) -> float:
        return ((y.float() - ref).abs().max() / ref.abs().max()).item()

    y_two = two_launch()
    table = table_config(args.path, m, n, k, args.card)
    cell = dict(N=n, K=k, M=m, path=args.path, copy_tbs=shape.copy_tbs, table=label(table),
                two_launch_err=max_err(y_two), two_launch_us=us(two_launch, args.replays),
                cublas_us=us(lambda: F.linear(x, shape.w16), args.replays),
                bf16_us=us(lambda: dense_linear(x, shape.w16), args.replays), rows=[])
    # "same": bitwise the two-launch path's result (fused), or the table config's (codes)
    y_same = y_two if args.path == "fused" else run(table)
    cands = candidates(m, k, args.path)
    cands += [table] if table not in cands else []
    for cfg in cands:
        row = dict(config=label(cfg), cfg=cfg_fields(cfg))
        if time.time() > args.t_end:
            row["error"] = "deadline: not run"
            cell["rows"].append(row)
            continue
        try:
            y = run(cfg)
            row.update(max_err=max_err(y), same=bool(torch.equal(y, y_same)))
            if row["max_err"] <= args.max_err:
                row["us"] = us(lambda cfg=cfg: run(cfg), args.replays)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        cell["rows"].append(row)
    timed = sorted((r for r in cell["rows"] if "us" in r), key=lambda r: r["us"])
    confirm = timed[: args.confirm] + [r for r in timed[args.confirm:] if r["config"] == label(table)]
    for r in confirm:
        cfg = type(table)(*r["cfg"])
        r["us_confirm"] = us(lambda cfg=cfg: run(cfg), 4 * args.replays)
        if args.path == "fused":
            # the two-launch path's GEMV at the same tile (its 16-byte vectors: 16 codes a thread): its configs
            # are bf16's with BLOCK_K doubled, which keep half bf16's warps per SM (bench/sass_fp8_gemv.py)
            try:
                r["two_launch_err"] = max_err(two_launch(cfg))
                r["two_launch_us"] = us(lambda cfg=cfg: two_launch(cfg), 4 * args.replays)
            except Exception as e:
                r["two_launch_error"] = f"{type(e).__name__}: {e}"[:300]
    if confirm:
        best = min(confirm, key=lambda r: r["us_confirm"])
        cell["best"] = dict(config=best["config"], cfg=best["cfg"], us=best["us_confirm"])
        table_rows = [r for r in confirm if r["config"] == label(table)]
        cell["table_us"] = table_rows[0]["us_confirm"] if table_rows else None
        two = [r for r in confirm if r.get("two_launch_us") and r["two_launch_err"] <= args.max_err]
        if two:
            b2 = min(two, key=lambda r: r["two_launch_us"])
            cell["two_launch_best"] = dict(config=b2["config"], cfg=b2["cfg"], us=b2["two_launch_us"])
    print_cell(cell, shape, log)
    return cell


def gbs(shape: Shape, us: float) -> float:
    return shape.bytes / us / 1e3


def print_cell(cell: dict, shape: Shape, log) -> None:
    copy = shape.copy_tbs * 1e3
    log(f"\n{cell['N']}x{cell['K']} M={cell['M']}: copy {copy:.0f} GB/s; two-launch {cell['two_launch_us']:.1f} us "
        f"(max err {cell['two_launch_err']:.1e}), bf16 {cell['bf16_us']:.1f} us (cuBLAS {cell['cublas_us']:.1f}); "
        f"table {cell['table']}")
    log(f"  {'config':<16} {'max err':>8} {'same':>5} {'us':>7} {'confirm':>8} {'GB/s':>6} {'% copy':>7} "
        f"{'2-launch at it':>14}")
    rows = sorted(cell["rows"], key=lambda r: r.get("us_confirm", r.get("us", float("inf"))))
    for r in rows:
        t = r.get("us_confirm", r.get("us"))
        rate = f"{gbs(shape, t):>6.0f} {100 * gbs(shape, t) / copy:>7.1f}" if t else f"{'':>6} {'':>7}"
        note = r.get("error", "") or ("" if "us" in r else "  NOT TIMED (error above --max-err)")
        log(f"  {r['config']:<16} {r.get('max_err', float('nan')):>8.1e} {str(r.get('same', '')):>5} "
            f"{r.get('us', float('nan')):>7.1f} {r.get('us_confirm', float('nan')):>8.1f} {rate} "
            f"{r.get('two_launch_us', float('nan')):>14.1f}{note}")


def summary(cells: list, shapes: dict, n_shapes: int, log, path: str = "fused", card: str = "") -> list[str]:
    """The closing table, the per-token totals and the table lines to paste (``TUNED_FP8`` for the fused path,
    ``TUNED_FP8_CODES`` for the GEMV on codes, M = 1 only, keyed by this card)."""
    log(f"\n{'shape':<12} {'M':>2} {'pick':<14} {'us':>7} {'% copy':>7} {'table us':>9} {'2-launch':>9} "
        f"{'bf16':>7} {'cuBLAS':>7} {'x bf16':>7} {'x 2-launch':>10}  best 2-launch config")
    lines, totals = [], {}
    for c in cells:
        if "best" not in c:
            continue
        shape, b = shapes[(c["N"], c["K"])], c["best"]
        log(f"{c['N']}x{c['K']:<7} {c['M']:>2} {b['config']:<14} {b['us']:>7.1f} "
            f"{100 * gbs(shape, b['us']) / (shape.copy_tbs * 1e3):>7.1f} {c.get('table_us') or float('nan'):>9.1f} "
            f"{c['two_launch_us']:>9.1f} {c['bf16_us']:>7.1f} {c['cublas_us']:>7.1f} {c['bf16_us'] / b['us']:>7.2f} "
            f"{c['two_launch_us'] / b['us']:>10.2f}  "
            + (f"{c['two_launch_best']['config']} {c['two_launch_best']['us']:.1f} us" if "two_launch_best" in c
               else "-"))
        pf = ", prefetch=True" if len(b["cfg"]) > 3 and b["cfg"][3] else ""
        key = f"{card!r}, {c['N']}, {c['K']}" if path == "codes" else f"{c['N']}, {c['K']}, {c['M']}"
        if path == "fused" or c["M"] == 1:
            lines.append(f"    ({key}): C({b['cfg'][0]}, {b['cfg'][1]}, {b['cfg'][2]}{pf}),  "
                         f"# {b['us']:.1f} us, {100 * gbs(shape, b['us']) / (shape.copy_tbs * 1e3):.0f}% of copy")
        t = totals.setdefault(c["M"], dict(cells=0, fused=0.0, table=0.0, two=0.0, bf16=0.0))
        t["cells"] += 1
        t["fused"] += b["us"]
        t["table"] += c.get("table_us") or float("nan")
        t["two"] += c["two_launch_us"]
        t["bf16"] += c["bf16_us"]
    for m, t in sorted(totals.items()):
        part = "" if t["cells"] == n_shapes else f" (only {t['cells']} of {n_shapes} linears)"
        log(f"one token, {LAYERS} layers' linears at M={m}{part}: FP8 {path} {LAYERS * t['fused'] / 1e3:.2f} ms "
            f"(table {LAYERS * t['table'] / 1e3:.2f}), two launches {LAYERS * t['two'] / 1e3:.2f} ms, "
            f"bf16 {LAYERS * t['bf16'] / 1e3:.2f} ms: {t['bf16'] / t['fused']:.2f}x bf16")
    where = "TUNED_FP8 entries (kernels/gemv_fp8.py)" if path == "fused" else "TUNED_FP8_CODES entries (kernels/gemv.py)"
    log(f"\n{where}:\n" + "\n".join(lines))
    return lines




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", choices=("codes", "fused"), default="codes",
                    help="codes: the GEMV on e4m3 codes (the runtime's default at one row); fused: the one-launch "
                         "GEMV that quantizes its activations")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK list")
    ap.add_argument("--ms", default="1,2,4", help="activation rows list (1-4)")
    ap.add_argument("--deadline", type=float, default=120.0,
                    help="seconds from the start: compiling stops waiting at 40%% of it, cells not started by then "
                         "are skipped and a cell running past it times no further candidates")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes compiling the candidates first (default: CPU cores - 2, at most 12; 0: compile "
                         "each when first timed)")
    ap.add_argument("--replays", type=int, default=3, help="CUDA-graph replays per timing (the confirmation: 4x)")
    ap.add_argument("--confirm", type=int, default=3, help="fastest candidates timed again")
    ap.add_argument("--max-err", type=float, default=1e-2, help="largest max error (relative) a timed config may have")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a CPU check of this script (Triton's interpreter, --shapes 16x512, wall-clock timing, no "
                         "compile processes): exercises every step, measures nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        # the interpreter rounds float32 to e4m3 its own way (tests/kernels/test_fp8_quant.py): errors of ~0.1
        args.shapes, args.max_err = "16x512", 0.5
        args.jobs = 0 if args.jobs is None else args.jobs
        interpreter_fix()
    elif args.jobs is None:
        args.jobs = min(12, max(1, (os.cpu_count() or 2) - 2))
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        ap.error("--shapes takes NxK,NxK and --ms 1,2,4")
    if any(not 1 <= m <= 4 for m in ms):
        ap.error("--ms: the GEMV takes 1 to 4 rows")
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("tune_fp8_gemv: needs a CUDA GPU (torch sees none); --smoke checks the script on the CPU",
              file=sys.stderr)
        return 2
    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    device, time_us = timer(args.smoke)

    t0 = time.time()
    args.t_end = t0 + args.deadline
    now = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or f"bench/runs/fp8_gemv_{now:%Y%m%d_%H%M}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    def log(line):
        print(line, flush=True)

    cells = [(n, k, m) for m in ms for n, k in shapes]  # M = 1 first on every shape: batch-1 decode matters most
    args.card = "CPU smoke run" if args.smoke else torch.cuda.get_device_name()
    precompile(cells, args.jobs, t0 + 0.4 * args.deadline, device, log, args.path)
    result = dict(card=args.card, path=args.path, torch=torch.__version__, triton=triton.__version__,
                  date=now.isoformat(timespec="seconds"), deadline_s=args.deadline,
                  timing=f"gpu_timing.gpu_time_us: 10 calls a graph, L2 evicted by reading, best of {args.replays} "
                         f"replays; the {args.confirm} fastest and the table's config again, best of "
                         f"{4 * args.replays}", cells=[], complete=False)
    built: dict = {}
    for i, (n, k, m) in enumerate(cells):
        if time.time() > args.t_end:
            log(f"deadline: {n}x{k} M={m} and {len(cells) - i - 1} more cells not run")
            break
        elapsed = time.time() - t0
        log(f"[{i + 1}/{len(cells)}] {n}x{k} M={m} ({elapsed:.0f} s"
            + (f", about {elapsed / i * (len(cells) - i):.0f} s left)" if i else ")"))
        if (n, k) not in built:
            built[(n, k)] = Shape(n, k, device, time_us)
        result["cells"].append(run_cell(built[(n, k)], m, args, time_us, log))
        result["copy_tbs"] = {f"{s.n}x{s.k}": s.copy_tbs for s in built.values()}
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    result["paste"] = summary(result["cells"], built, len(shapes), log, args.path, args.card)
    result["complete"] = len(result["cells"]) == len(cells)
    result["seconds"] = time.time() - t0
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
