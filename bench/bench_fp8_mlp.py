"""The one-launch FP8 MLP (kernels/fp8_mlp.py) against the three launches the runtime runs at one row without it
(the gate/up GEMV on codes, the activation with the row's quantization, the down GEMV on codes), each behind the
norm kernel that writes its input codes, as in the decode step: ``LAYERS`` layers of distinct weights (more bytes
than L2 holds) chained in one CUDA graph, us a layer over the graph's replays, beside a device copy of one layer's
weight bytes. Every config is checked against the three launches on one layer first.

    python bench/bench_fp8_mlp.py [--shape 4096,14336,4096] [--layers 8] [--out bench/results/fp8_mlp_CARD.json]

The JSON's ``best`` is the fastest config; ``bench/lib/with_fp8_mlp_config.py`` runs ``quantkit bench`` with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import torch
from gpu_timing import replay_us  # bench/gpu_timing.py, beside this script

CANDIDATES = [  # (pairs, rows, num_warps, ctas_per_sm[, preload, cooperative]); K tiles follow from num_warps.
    # Registers by ptxas for sm_90a (2026-12-07): 63 at (2, 4, 4), so 8 programs an SM, 64 KB of gate/up tiles and
    # 32 KB of down tiles in flight an SM; (4, 8, 4) 128 (4 an SM); (2, 4, 8) spills
    (2, 4, 4, 8),
    (1, 4, 4, 8),
    (2, 8, 4, 5),
    (4, 8, 4, 4),
    (2, 4, 2, 16),
    (4, 4, 2, 8),
    (2, 4, 4, 6),
    (2, 4, 4, 4),
    (2, 4, 4, 8, False),  # no down tile requested before the barrier
    (2, 4, 4, 8, True, False),  # launched without the cooperative attribute
]


def _layer(k: int, inter: int, hidden: int, device: str, gen: torch.Generator):
    def codes(n, kk):
        return (torch.randn(n, kk, device=device, generator=gen) * 16).clamp(-448, 448).to(torch.float8_e4m3fn)

    return dict(wgu=codes(2 * inter, k), sgu=torch.rand(1, 2 * inter, device=device, generator=gen) * 0.01 + 1e-3,
                wd=codes(hidden, inter), sd=torch.rand(1, hidden, device=device, generator=gen) * 0.01 + 1e-3,
                norm=torch.rand(k, device=device, generator=gen, dtype=torch.float32).to(torch.bfloat16) + 0.5)


def _apart(lw, delta, residual):
    from quantkit.kernels.decoder_ops import act_mul_fp8, add_rms_norm_fp8
    from quantkit.kernels.gemv import gemv

    qx, sx, residual = add_rms_norm_fp8(delta, residual, lw["norm"], 1e-5, 0.0, None)
    gate_up = gemv(qx, lw["wgu"], scales=(sx, lw["sgu"]), out_dtype=torch.bfloat16)
    qh, sh = act_mul_fp8(gate_up)
    return gemv(qh, lw["wd"], scales=(sh, lw["sd"]), out_dtype=torch.bfloat16), residual


def _fused(lw, delta, residual, cfg, state):
    from quantkit.kernels.decoder_ops import add_rms_norm_fp8
    from quantkit.kernels.fp8_mlp import fp8_mlp

    qx, sx, residual = add_rms_norm_fp8(delta, residual, lw["norm"], 1e-5, 0.0, None)
    return fp8_mlp(qx, sx, lw["wgu"], lw["sgu"], lw["wd"], lw["sd"], state, "silu", cfg), residual


def _graph_us(run, layers: int, reps: int = 30) -> float:
    """us a layer: ``run()`` (every layer once) captured in a CUDA graph, the median replay over ``layers``."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    times = sorted(replay_us(graph, reps))
    return times[len(times) // 2] / layers


def _card() -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _copy_us(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _graph_us(lambda: dst.copy_(src), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096,14336,4096", help="K,I,H: hidden in, intermediate, hidden out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from quantkit.kernels.fp8_mlp import FP8MlpConfig, FP8MlpState

    k, inter, hidden = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [_layer(k, inter, hidden, "cuda", gen) for _ in range(args.layers)]
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * inter * k + hidden * inter
    copy = _copy_us(nbytes) / 2  # a copy reads and writes: the time to read the bytes once at that rate
    ref, _ = _apart(layers[0], x0, res0)

    def chain(step):
        def run():
            delta, residual = x0, res0
            for lw in layers:
                delta, residual = step(lw, delta, residual)
        return run

    rows = [{"variant": "apart (3 launches)", "us": _graph_us(chain(_apart), args.layers)}]
    for cand in CANDIDATES:
        cfg = FP8MlpConfig(*cand)
        state = FP8MlpState.create(inter, torch.device("cuda"))
        row = {"variant": "fused", "config": dataclasses.asdict(cfg)}
        try:
            y, _ = _fused(layers[0], x0, res0, cfg, state)
            row["rel_err_vs_apart"] = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            row["grid"] = state.grids[cfg]
            if row["rel_err_vs_apart"] > 2e-2:
                row["error"] = "does not match the three launches"
            else:
                row["us"] = _graph_us(chain(lambda lw, d, r, c=cfg, s=state: _fused(lw, d, r, c, s)), args.layers)
        except Exception as e:  # a config the card cannot run (resources, cooperative launch): recorded, skipped
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    timed = [r for r in rows if "us" in r]
    best = min((r for r in timed if r["variant"] == "fused"), key=lambda r: r["us"], default=None)
    print(f"shape K={k} I={inter} H={hidden}, {args.layers} layers; read at the copy rate: {copy:.1f} us a layer")
    print(f"{'variant':<22} {'config':<44} {'grid':>5} {'us':>7} {'% copy':>7} {'rel err':>9}")
    for r in rows:
        cfg = " ".join(f"{v}" for v in r.get("config", {}).values())
        us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:40]
        pct = f"{100 * copy / r['us']:.0f}" if "us" in r else ""
        print(f"{r['variant']:<22} {cfg:<44} {r.get('grid', ''):>5} {us:>7} {pct:>7} "
              f"{r.get('rel_err_vs_apart', float('nan')):9.1e}")
    result = dict(card=_card(), shape=dict(K=k, I=inter, H=hidden), layers=args.layers, copy_read_us=copy,
                  rows=rows, best=best["config"] if best else None,
                  speedup_vs_apart=rows[0]["us"] / best["us"] if best else None)
    if best:
        print(f"best fused {best['us']:.1f} us against apart {rows[0]['us']:.1f} us: {result['speedup_vs_apart']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
