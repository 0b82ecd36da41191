"""W4A16 decode variants timed where the decode step runs them: right after the kernel that writes their input.

    python bench/bench_w4a16_chain.py [--layers qkv,o,gate_up,down] [--m 1] [--deadline 200] [--out PATH]

The selection table (``kernels/w4a16_h200.json``) is tuned on calls timed alone: L2 evicted, then the GEMM. In the
decode step every W4A16 call follows a small kernel (the add + RMSNorm before q/k/v and gate/up, decode attention
before o, the activation before down) launched with programmatic dependent launch, so the GEMM's programs start
while that kernel runs, and whatever a GEMM requests before its ``griddepcontrol.wait`` (weights: no kernel writes
them) overlaps it. A design that requests more of its weights early (the TMA ring, ``NUM_BUF`` units; the CUDA
kernel's L2 prefetch) may lose alone and win in the chain. Here each variant of a Llama-3-8B decode layer is timed
both ways on the same weights:

* alone: ``gpu_timing.gpu_time_us`` of the call on its input;
* in the chain: the same timer on (predecessor, then the call on the predecessor's output), less the predecessor
  alone: what the call adds to the step.

Every variant is first checked against the plain-PyTorch reference (float32) on the predecessor's output; one above
``--max-err`` is not timed. Where the best variant in the chain beats today's pick in the chain by more than
max(0.3 us, 3 %), the JSON's ``candidate_entries`` hold a table entry naming the card: candidates for a whole-step
A/B (``bash bench/gpu_check.sh w4a16-chain``), never defaults by themselves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Llama-3-8B's decode linears (the runtime stacks q/k/v and gate/up) and the kernel before each in the step.
LAYERS = {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "attention"), "gate_up": (28672, 4096, "norm"),
          "down": (4096, 14336, "act")}
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CONTEXT = 128  # cached tokens before the new one (quantkit bench's default decode context)


def gluon_configs():
    """The decode configs the table draws from (direct kernel) and TMA-ring configs whose producer requests 2-8
    units of weights before it waits for the previous kernel."""
    from quantkit.kernels.w4a16_configs import GluonConfig as G

    out = [G(128, 16, 1, 4, CTAS_PER_SM=4, DIRECT=True), G(128, 16, 1, 4, CTAS_PER_SM=4, DIRECT=True, UNROLL=2),
           G(256, 16, 1, 8, CTAS_PER_SM=2, DIRECT=True), G(256, 16, 1, 8, CTAS_PER_SM=2, DIRECT=True, GATHER_X=True),
           G(64, 16, 1, 4, CTAS_PER_SM=8, DIRECT=True)]
    for block_n, stages, ctas in [(128, 2, 4), (128, 4, 4), (128, 4, 3), (128, 6, 2), (128, 8, 2), (256, 4, 2),
                                  (256, 6, 1), (256, 8, 1)]:
        out.append(G(block_n, 16, stages, 4, CTAS_PER_SM=ctas, X_BOX_K=64))
    return out


def cuda_configs():
    from quantkit.kernels.w4a16_configs import CudaConfig

    return [CudaConfig(2, 2, 4), CudaConfig(1, 4, 4), CudaConfig(2, 2, 4, L2_256=True), CudaConfig(2, 2, 4, SPLITS=1)]


def predecessor(kind: str, m: int, k: int):
    """A no-argument callable running the step's kernel before a layer (on fixed random inputs), returning the
    layer's input ``[m, k]`` bf16, as the runtime launches it (programmatic dependent launch on Hopper)."""
    import torch

    from quantkit.kernels import decoder_ops
    from quantkit.kernels.decode_attention import decode_attention_rope
    from quantkit.kernels.device_info import programmatic_launch

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(k + m)
    if kind == "norm":
        delta, residual = (torch.randn(m, k, device=dev, dtype=bf16, generator=g) for _ in range(2))
        weight = torch.rand(k, device=dev, dtype=bf16, generator=g) + 0.5
        return lambda: decoder_ops.add_rms_norm(delta, residual, weight, 1e-5, 0.0)[0]
    if kind == "act":
        gate_up = torch.randn(m, 2 * k, device=dev, dtype=bf16, generator=g)
        return lambda: decoder_ops.act_mul(gate_up, "silu")
    if kind == "attention":
        assert k == HEADS * HEAD_DIM
        qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=bf16, generator=g)
        angles = torch.arange(4 * CONTEXT, device=dev)[:, None] * torch.rand(HEAD_DIM // 2, device=dev, generator=g)
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        k_cache, v_cache = (torch.randn(m, 2 * CONTEXT, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16, generator=g)
                            for _ in range(2))
        positions = torch.full((m,), CONTEXT, dtype=torch.int32, device=dev)
        slots = torch.arange(m, dtype=torch.int32, device=dev)
        counters = torch.zeros(m * KV_HEADS, dtype=torch.int32, device=dev)
        pdl = programmatic_launch(dev)
        return lambda: decode_attention_rope(qkv, cos, sin, positions, slots, k_cache, v_cache, HEADS, counters,
                                             pdl=pdl)
    raise ValueError(f"unknown predecessor {kind!r}")


def run_layer(name: str, m: int, args, log) -> dict:
    from bench_w4a16_decode import make_weights, max_err
    from gpu_timing import gpu_time_us, l2_evict_buffer

    from quantkit.kernels import w4a16
    from quantkit.kernels.w4a16_configs import CudaConfig, config_label, config_to_dict
    from quantkit.kernels.w4a16_cuda import nvcc_path, w4a16_cuda_matmul
    from quantkit.kernels.w4a16_weights import w4a16_matmul_ref

    n, k, kind = LAYERS[name]
    w = make_weights(n, k)
    pred = predecessor(kind, m, k)
    x = pred()
    ref = w4a16_matmul_ref(x, w)
    flush = l2_evict_buffer("cuda")

    def timed(fn):
        return gpu_time_us(fn, flush, calls=10, replays=5)

    choice = w.plan.choice(m)
    variants = [("today: " + choice.label(), None, lambda x: w4a16.w4a16_matmul(x, w))]
    variants += [("gluon " + config_label(c), c, lambda x, c=c: w4a16.w4a16_matmul(x, w, c))
                 for c in gluon_configs() if c != choice.config and c.fits(m, w.group_size)]
    if nvcc_path() is not None:
        variants += [(config_label(c), c, lambda x, c=c: w4a16_cuda_matmul(x, w, c)) for c in cuda_configs()
                     if c != choice.config]
    pred_us = [timed(pred)]
    cell = dict(layer=name, N=n, K=k, M=m, predecessor=kind, today=choice.label(), variants=[])
    for label, config, fn in variants:
        if time.time() > args.t_end:
            log(f"  deadline: {label} not timed")
            continue
        row = dict(name=label)
        if config is not None:
            row["kernel"] = "cuda" if isinstance(config, CudaConfig) else "gluon"
            row["config"] = config_to_dict(config)
        try:
            row["max_err"] = max_err(fn(x), ref)
            if row["max_err"] <= args.max_err:
                row["alone_us"] = timed(lambda fn=fn: fn(x))
                row["chain_total_us"] = timed(lambda fn=fn: fn(pred()))
        except Exception as e:  # a config this card cannot build or launch
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        cell["variants"].append(row)
    pred_us.append(timed(pred))  # again at the end: the spread of the subtraction
    cell["predecessor_us"] = pred_us
    for row in cell["variants"]:
        if "chain_total_us" in row:
            row["chain_us"] = row["chain_total_us"] - min(pred_us)
    print_cell(cell, log)
    return cell


def print_cell(cell: dict, log) -> None:
    log(f"\n{cell['layer']} {cell['N']}x{cell['K']} M={cell['M']} after {cell['predecessor']} "
        f"({', '.join(f'{v:.1f}' for v in cell['predecessor_us'])} us alone)")
    log(f"  {'variant':<62} {'max err':>9} {'alone us':>9} {'in chain':>9}")
    for r in sorted(cell["variants"], key=lambda r: r.get("chain_us", float("inf"))):
        note = r.get("error", "") or ("" if "chain_us" in r else "  not timed")
        log(f"  {r['name'][:62]:<62} {r.get('max_err', float('nan')):>9.2e} {r.get('alone_us', float('nan')):>9.1f} "
            f"{r.get('chain_us', float('nan')):>9.1f}{note}")


def candidate_entries(cells: list[dict], card: str, margin_us: float = 0.3, margin: float = 0.03) -> list[dict]:
    """Table entries (``kernels/w4a16_h200.json`` form, naming ``card``) for the cells where the fastest variant in
    the chain beat today's pick in the chain by more than ``max(margin_us, margin x today)``."""
    from gpu_timing import proposed_entries

    return proposed_entries(cells, card, "chain_us", lambda v: "config" in v, margin_us, margin,
                            lambda cell, today, best: (
                                best["kernel"], best["config"], best["alone_us"],
                                f"bench_w4a16_chain.py: {best['chain_us']:.1f} us after the {cell['predecessor']} "
                                f"kernel against today's pick {today['chain_us']:.1f}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {', '.join(LAYERS)}")
    ap.add_argument("--m", type=int, default=1, help="activation rows (1-8: the decode kernels' rows)")
    ap.add_argument("--deadline", type=float, default=200.0, help="seconds: variants not started by then are skipped")
    ap.add_argument("--max-err", type=float, default=1e-2, help="largest max error (relative) a timed variant may have")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    layers = args.layers.split(",")
    if unknown := [name for name in layers if name not in LAYERS]:
        ap.error(f"--layers: unknown {', '.join(unknown)}; known: {', '.join(LAYERS)}")
    if not 1 <= args.m <= 8:
        ap.error("--m: the decode kernels take 1 to 8 rows here")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_w4a16_decode import prebuild
    from gpu_timing import gpu_run, log, run_cells

    started = gpu_run("w4a16_chain", args.out)
    if started is None:
        return 2
    result, out = started

    args.t_end = time.time() + args.deadline
    prebuild([args.m], log)
    result.update(context=CONTEXT, timing="gpu_timing.gpu_time_us (10 calls a graph, L2 evicted by reading, best of "
                  "5); in the chain: predecessor + call, less the predecessor alone (the lower of two timings)")
    run_cells(result, out, layers, lambda name: [run_layer(name, args.m, args, log)], candidates=candidate_entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
