"""MoE on one GPU: GPTQ time and memory on a Qwen3-30B-A3B-shaped model, serving int4 vs bf16, and the fused
MoE kernel against a per-expert loop of the dense W4A16 kernel.

The model has random weights built on the GPU (no download; bench/moe_models.py: 48 layers, 128 experts,
top-8, hidden 2048, expert intermediate 768, skewed routers). Sections (each can be skipped):

* ``gptq``: ``quantkit.calibrate.walker.walk`` with GPTQ's defaults and the default all-expert calibration on
  ``--nsamples`` x ``--seqlen`` random tokens: seconds, peak device and host memory, RTN-fallback experts;
* ``awq``: the same with AWQ's defaults (a fresh random model; run last, after the serving runs);
* ``serve``: the runtime (kernels backend, CUDA graphs at decode when they capture) on the GPTQ weights
  (int4) and on 16-bit experts of the same shapes: decode tokens/s at batch 1/8/32, prefill of 2048 tokens,
  and the active-expert bytes per decode token against the copy bandwidth (roofline);
* ``kernel``: one layer's experts, fused kernel vs a per-expert loop of ``w4a16_linear``, M = 1..2048; and
  the runtime's MoE block as a CUDA-graph replay (as decode runs it), routing and align in one program or not.

Prints a table and writes JSON (card, versions, date) to bench/results/bench_moe_<date>.json.

    python bench/bench_moe.py                  # everything (H200: expect ~20-30 minutes)
    python bench/bench_moe.py --skip awq serve kernel   # GPTQ alone (each section also runs alone:
    python bench/bench_moe.py --skip gptq awq kernel    # serving, on RTN weights: speed does not depend on them)
    python bench/bench_moe.py --tiny --device cpu       # the smoke test (~10 s; tests/test_bench_moe.py)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_models import QWEN3_30B_A3B, random_moe  # noqa: E402


def card() -> dict:
    import transformers
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def env(**values: str):
    """Environment variables set for the block (the kernel switches the runtime reads at each call), then put
    back as they were."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def layer_printer(name: str, done: list):
    """The walker's per-layer callback: prints k of n, seconds, ETA and the method's phases (where the time of a
    layer goes), keeps each layer's seconds and phases in ``done``."""

    def on_layer(ev):
        done.append({"seconds": ev.seconds, "phases": {k: round(v, 3) for k, v in ev.phases.items()}})
        eta = ev.elapsed / (ev.index + 1) * (ev.n_layers - ev.index - 1)
        # the walker's phases (move_in, method, propagate, move_out...) and the method's own (method.*), so that a
        # call cut short still says where a layer's time went (the JSON, written at the end, has their medians)
        split = ", ".join(f"{k} {v:.1f}" for k, v in ev.phases.items())
        print(f"  {name} layer {ev.index + 1}/{ev.n_layers}: {ev.seconds:.1f} s (ETA {eta:.0f} s; {split})",
              flush=True)

    return on_layer


def median_layer(done: list) -> dict:
    """The median layer's seconds and the median of each phase over the layers."""
    mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"layer_seconds_median": mid([d["seconds"] for d in done]),
            "layer_phases_median": {k: mid([d["phases"].get(k, 0.0) for d in done]) for k in done[0]["phases"]}}


def model_to_quantize(args, sizes: dict, seed: int):
    """The random model a method quantizes, on ``--model-device`` (default ``--device``), and the seconds its
    build took (printed as it ends). Drawn on ``--device`` and moved: on the CPU, one layer of the 30B shape with the embeddings (1.24 B weights) took 22.7 s to draw, and
    torch's ``normal_`` runs on one core whatever the thread count (1.8 s for 403 M on 1 or 2), so the 48 layers take
    ~9 minutes: a 48-layer GPTQ call with the model drawn on the CPU printed nothing, not even its first layer, in
    560 s (one H100, 2026-12-07)."""
    t0 = time.perf_counter()
    model = random_moe("qwen3_moe", device=args.device, dtype=torch.bfloat16, seed=seed, **sizes)
    where = f"drawn on {args.device}"
    if args.model_device and torch.device(args.model_device) != torch.device(args.device):
        model.to(args.model_device)
        _free()
        where += f", moved to {args.model_device}"
    seconds = time.perf_counter() - t0
    # printed at once: a call cut before the first layer still says where its time went
    print(f"  model built in {seconds:.1f} s ({where})", flush=True)
    return model, seconds


def prepared(model, name: str, scheme):
    """``name``'s method with its defaults around ``model``, its experts unfused into per-expert linears
    (timed and printed: on a model in host memory this ran for minutes before the walk until 2026-12-07)."""
    from quantkit.api import build_method
    from quantkit.methods.moe_prepare import prepare_for_quantization

    t0 = time.perf_counter()
    method = prepare_for_quantization(model, build_method(name, scheme))
    seconds = time.perf_counter() - t0
    print(f"  experts unfused in {seconds:.1f} s", flush=True)
    return method, seconds


def run_gptq(args, sizes: dict, record: dict):
    """GPTQ with its defaults (``quantize_timed``), plus the experts' calibration tokens and fallbacks; the model and
    its result stay for the serving section."""
    from quantkit.moe.stats import expert_tokens

    model, result, scheme, timing = quantize_timed(args, sizes, "gptq", seed=0)
    experts = expert_tokens(result.layer_stats)
    record["gptq"] = {**timing, "rtn_fallback_experts": sum(len(r["rtn_fallback"]) for r in experts.values()),
                      "scheme": "W4 g128 sym, GPTQ defaults, --moe-calib all"}
    return model, result, scheme


def quantize_rtn(args, sizes: dict, record: dict):
    """The model with RTN weights (for the serving section when the GPTQ section is skipped)."""
    from quantkit.api import build_method
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme
    from quantkit.methods.moe_prepare import prepare_for_quantization

    model = random_moe("qwen3_moe", device=args.device, dtype=torch.bfloat16, **sizes)
    scheme = QuantScheme(bits=4, group_size=128, sym=True)
    t0 = time.perf_counter()
    result = walk(model, prepare_for_quantization(model, build_method("rtn", scheme)), device=args.device)
    record["serve_weights"] = {"method": "rtn", "seconds": time.perf_counter() - t0}
    return model, result, scheme


def quantize_timed(args, sizes: dict, name: str, seed: int):
    """A fresh random model quantized by ``name`` with its defaults: the model, the walker's result, the scheme and
    the timing record (build, unfuse and walk seconds, ``total_seconds`` the last two: what quantizing the model in
    memory costs, its build aside; the median layer and its phases; peak device and host memory)."""
    from quantkit.api import default_options
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme
    from quantkit.models.lazy import peak_host_memory_bytes

    model, build_seconds = model_to_quantize(args, sizes, seed=seed)
    scheme = QuantScheme(bits=4, group_size=128, sym=name != "awq")
    method, unfuse_seconds = prepared(model, name, scheme)
    tokens = torch.randint(0, sizes["vocab_size"], (args.nsamples, args.seqlen),
                           generator=torch.Generator().manual_seed(0))
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    done: list = []
    t0 = time.perf_counter()
    result = walk(model, method, device=args.device, token_ids=tokens, batch_size=args.batch_size,
                  on_layer=layer_printer(name, done))
    sync()
    seconds = time.perf_counter() - t0
    timing = {"seconds": seconds, "build_seconds": build_seconds, "unfuse_seconds": unfuse_seconds,
              "total_seconds": unfuse_seconds + seconds, **median_layer(done), "n_quantized": len(result.weights),
              "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else 0,
              "peak_host_gib": peak_host_memory_bytes() / 2**30, "tokens": args.nsamples * args.seqlen,
              "options": default_options(name, scheme)}
    print(f"  {name}: {len(done)} layers in {seconds:.1f} s, {timing['total_seconds']:.1f} s with the unfuse; peak "
          f"device {timing['peak_device_gib']:.1f} GiB, host {timing['peak_host_gib']:.1f} GiB", flush=True)
    return model, result, scheme, timing


def run_method(args, sizes: dict, name: str) -> dict:
    """``quantize_timed``'s record alone (the model and its weights freed)."""
    return quantize_timed(args, sizes, name, seed=1)[3]


def runtime_from(model, weights: dict | None, scheme, dense_random: bool = False):
    """A kernels-backend RuntimeModel over the model's tensors: packed ``weights`` where given; with
    ``dense_random`` every tensor is a fresh random bf16 one of the same shape (the bf16 baseline)."""
    from quantkit.runtime.model import RuntimeModel
    from quantkit.runtime.spec import spec_from_config
    from quantkit.runtime.weights import QuantInfo, load_weights

    state = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in (weights or {})}
    for name, qw in (weights or {}).items():
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            state[f"{name}.{leaf}"] = getattr(qw, leaf)
    dev = model.device
    # a generator of its own: after a failed CUDA-graph capture the default one refuses to draw ("Offset
    # increment outside graph capture", seen on the H200 when the int4 capture had failed)
    gen = torch.Generator(device=dev).manual_seed(0)

    def source(keys):
        out = {}
        for k in keys:
            if k not in state:
                continue
            t = state[k]
            out[k] = (torch.randn(t.shape, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 if dense_random
                      else t.to(dev))
        return out

    spec = spec_from_config(model.config)
    quant = QuantInfo(scheme.bits, scheme.group_size, scheme.sym) if weights else None
    w = load_weights(source, set(state), spec, quant, torch.bfloat16, dev, packed_kernel=True)
    backend = "kernels" if dev.type == "cuda" else "reference"  # the CPU: a smoke test of this script only
    return RuntimeModel(spec, model.config, w, backend=backend, dtype=torch.bfloat16, device=dev,
                        max_positions=4096, name="qwen3-30b-a3b-shape")


class _MetaModel:
    """A model's config and tensor shapes (meta tensors), for building random runtimes of its shape."""

    def __init__(self, model) -> None:
        self.config = model.config
        self._state = {k: v.to("meta") for k, v in model.state_dict().items()}
        self.device = next(model.parameters()).device

    def state_dict(self):
        return self._state


def serve_rows(runtime, label: str, args, bandwidth: float) -> list[dict]:
    from quantkit.runtime.engine import Engine
    from quantkit.tools.bench import decode_tps

    def prefill_tps(engine, n):
        prompt = torch.randint(0, engine.model.spec.vocab_size, (n,)).tolist()
        return n / timed(lambda: engine.model.prefill([prompt], [0], engine.cache), repeat=3)

    rows = []
    for graphs in ((True, False) if torch.cuda.is_available() else (False,)):
        try:
            engine = Engine(runtime, None, max_batch=max(args.batches), max_seq_len=2304, cuda_graphs=graphs,
                            graph_buckets=tuple(args.batches))
            for b in args.batches:
                tps = decode_tps(engine, b, steps=args.steps)
                rows.append({"model": label, "what": f"decode b{b}", "tokens_per_s": tps, "graphs": graphs})
            rows.append({"model": label, "what": "prefill 2048", "tokens_per_s": prefill_tps(engine, 2048),
                         "graphs": graphs})
            break
        except Exception as exc:  # noqa: BLE001 - a failed graph capture: measure without graphs, say so
            if not graphs:
                raise
            print(f"  {label}: CUDA graphs failed ({type(exc).__name__}: {exc}); without graphs", flush=True)
            rows.clear()
    per_token = runtime.weights.nbytes()
    for r in rows:
        if r["what"] == "decode b1":
            r["bytes_per_token"] = per_token
            r["roofline_tokens_per_s"] = bandwidth / per_token
            r["fraction_of_roofline"] = r["tokens_per_s"] / r["roofline_tokens_per_s"]
    return rows


def kernel_rows(args) -> list[dict]:
    """One layer's experts: fused kernel vs a per-expert loop of the dense W4A16 kernel."""
    from quantkit.config import QuantScheme
    from quantkit.kernels import moe_gemv
    from quantkit.kernels.dispatch import w4a16_linear
    from quantkit.kernels.moe_align import align_in_one_program
    from quantkit.kernels.moe_router import router_fused_applies
    from quantkit.kernels.moe_w4a16 import fused_moe, stack_quantized
    from quantkit.kernels.w4a16_weights import prepare_w4a16_weights
    from quantkit.methods.rtn import rtn_quantize
    from quantkit.qtensor import QuantizedWeight
    from quantkit.runtime.moe import MoELayer
    from quantkit.tools.bench import graph_time, kernel_times

    h, inter, n_exp, k = 2048, 768, 128, 8
    scheme = QuantScheme(4, 128, True)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    trios = []
    for _ in range(n_exp):
        trio = []
        for rows, cols in ((inter, h), (inter, h), (h, inter)):
            r = rtn_quantize(torch.randn(rows, cols, device=dev, generator=g) / cols**0.5, scheme)
            trio.append(QuantizedWeight.from_codes(r.codes, r.scales, r.zeros, r.g_idx, scheme, device=dev))
        trios.append(tuple(trio))
    ex = stack_quantized(trios, torch.bfloat16, dev)
    dense = []
    for gate, up, down in trios:
        gu = prepare_w4a16_weights(torch.cat([gate.qweight, up.qweight], 1), torch.cat([gate.qzeros, up.qzeros], 1),
                                   torch.cat([gate.scales, up.scales], 1), gate.g_idx, 4, 128, True)
        dn = prepare_w4a16_weights(down.qweight, down.qzeros, down.scales, down.g_idx, 4, 128, True)
        dense.append((gu, dn))

    def loop(x, w, ids):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            gu = w4a16_linear(x[tok], dense[e][0])
            a = torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()
            out.index_add_(0, tok, w4a16_linear(a.to(x.dtype), dense[e][1]).float() * w[tok, slot, None])
        return out.to(x.dtype)

    router = (torch.randn(n_exp, h, device=dev, generator=g) / h**0.5).to(torch.bfloat16)
    rows = []
    for m in args.kernel_m:
        x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(m, n_exp, device=dev)
        w, ids = torch.topk(logits.softmax(-1), k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        want = loop(x, w, ids).float()

        def err_vs_loop(out: torch.Tensor) -> float:
            return ((out.float() - want).norm() / want.norm()).item()

        with env(QUANTKIT_MOE_DECODE="tiles"):  # the tiled kernel at every M (the table's GEMV: below)
            err = err_vs_loop(fused_moe(x, w, ids, ex))
            t_fused = timed(lambda: fused_moe(x, w, ids, ex))
        t_loop = timed(lambda: loop(x, w, ids))
        row = {"m": m, "fused_us": t_fused * 1e6, "loop_us": t_loop * 1e6, "speedup": t_loop / t_fused,
               "rel_err_vs_loop": err}
        # The graph timings below run each call over several routings (several inputs for the block) in turn and
        # divide: at decode sizes one routing's experts (~19 MB at batch 1) stay in L2 across replays, which made
        # configs look faster than whole steps found them (docs/moe.md); prefill sizes read every expert anyway.
        rot = routings(m, n_exp, k, dev) if m <= 32 else [(w, ids)]
        xs = [torch.randn(m, h, device=dev, dtype=torch.bfloat16) for _ in rot[1:]] + [x]
        row["rotations"] = len(rot)

        def over_routings(fn):  # fn(w, ids, **config) on every routing: a list of outputs
            return lambda **c: [fn(wj, idj, **c) for wj, idj in rot]

        def per_call_us(fn) -> float:  # one call's share of a graph replay of len(rot) calls
            return graph_time(fn) * 1e6 / len(rot)

        # as decode runs it: the runtime's whole MoE block (router, routing, align, experts; no shared expert)
        # replayed from a CUDA graph, routing and align in one program where it applies, and as torch ops
        block = MoELayer(router, ex, k, True, True)

        def blocks():
            return [block(xj, None) for xj in xs]

        for align in ("auto", "torch"):
            with env(QUANTKIT_MOE_DECODE="tiles", QUANTKIT_MOE_ALIGN=align):
                row[f"graph_block_us_align_{align}"] = per_call_us(blocks)
        row["one_program_align"] = align_in_one_program(ids.numel(), n_exp, ids.device)
        if moe_gemv.applies(ex, ids.numel()):  # the decode GEMV (kernels/moe_gemv.py): alone and in the block
            gemv_calls = over_routings(lambda wj, idj, **c: moe_gemv.moe_gemv(x, wj, idj, ex, **c))
            row["gemv_rel_err_vs_loop"] = err_vs_loop(moe_gemv.moe_gemv(x, w, ids, ex))
            row["gemv_graph_us"] = per_call_us(gemv_calls)
            with env(QUANTKIT_MOE_DECODE="tiles"):
                row["tiles_graph_us"] = per_call_us(over_routings(lambda wj, idj: fused_moe(x, wj, idj, ex)))
            with env(QUANTKIT_MOE_DECODE="gemv", QUANTKIT_MOE_ROUTER="apart"):
                row["graph_block_us_gemv"] = per_call_us(blocks)
            with env(QUANTKIT_MOE_DECODE="gemv"):  # the router GEMM and the routing in one launch where it applies
                if router_fused_applies(m, k, n_exp, x.device):
                    row["graph_block_us_gemv_fused_router"] = per_call_us(blocks)
                # the block kernel by kernel, one input (durations alone; the graph replay less their sum: the gaps)
                row["block_kernels_gemv"] = kernel_times(lambda: block(x, None))
            row["gemv_config"] = asdict(moe_gemv.gemv_config(ex, ids.numel()))  # the table's pick: the sweep's base
            row["gemv_sweep"] = tile_sweep(gemv_calls, GEMV_CANDIDATES, row["gemv_config"], per=len(rot))
            row["gemv_pipelining_sweep"] = tile_sweep(gemv_calls, GEMV_PIPELINING, GEMV_PIPELINING_PLAIN,
                                                      per=len(rot))
        if m <= 32:  # decode sizes: the tiles a decode table would choose from
            with env(QUANTKIT_MOE_DECODE="tiles"):
                row["tile_sweep"] = tile_sweep(over_routings(lambda wj, idj, **t: fused_moe(x, wj, idj, ex, **t)),
                                               per=len(rot))
        if m >= 256:  # prefill sizes: taller tiles dequantize each expert's weights fewer times
            with env(QUANTKIT_MOE_DECODE="tiles"):
                row["prefill_tile_sweep"] = tile_sweep(lambda **tiles: fused_moe(x, w, ids, ex, **tiles),
                                                       PREFILL_TILE_CANDIDATES, tile_default(prefill=True))
        rows.append(row)
    return rows


# At M = 1 only ~100 programs of the gate/up GEMM have work (8 experts x 12 column tiles), one a SM, each with
# ~12 KB of cp.async loads in flight at 3 stages (its sm_90 SASS: 128-bit LDGSTS), under the ~25-30 KB an SM needs
# at copy speed: deeper pipelines and narrower tiles (more programs) are the candidates.
TILE_CANDIDATES = [dict(block_n=n, block_k=kk, num_warps=nw, num_stages=st)
                   for n in (32, 64, 128) for kk in (64, 128) for nw, st in ((4, 3), (4, 5), (8, 3))]


def tile_default(prefill: bool = False) -> dict:
    """moe_w4a16.TileConfig() as sweep arguments (fused_moe's block_k default, 64, beside it); with ``prefill``
    its block_m too: the base the prefill sweep compares with, the tiles before TILE_CONFIGS (which fused_moe now
    picks at prefill sizes) and what QUANTKIT_MOE_TILES=plain forces. Read from the library, so a change to
    TileConfig changes the sweeps' base with it."""
    from quantkit.kernels.moe_w4a16 import TileConfig

    tiles = TileConfig()
    base = dict(block_n=tiles.block_n, block_k=64, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return dict(block_m=tiles.block_m, **base) if prefill else base


# At prefill (2048 tokens of top-8 over 128 experts: ~128 rows an expert) the 16-row tiles dequantize each 4-bit
# weight tile once per 16 rows, ~8 times an expert; int4 prefill ran at 0.60x bf16 (docs/moe.md). Taller tiles
# unpack each weight fewer times; the candidates for a prefill tile table.
PREFILL_TILE_CANDIDATES = [dict(block_m=bm, block_n=n, block_k=kk, num_warps=nw, num_stages=3)
                           for bm in (16, 32, 64) for n in (64, 128) for kk in (64, 128) for nw in (4, 8)]


# The decode GEMV's knobs: output columns a program, warps, and the programs a launch aims at (more slices of K:
# more loads in flight, more partial sums to add).
GEMV_CANDIDATES = [dict(block_n=n, num_warps=nw, target_programs=tp)
                   for n in (32, 64, 128) for nw in (2, 4) for tp in (256, 512, 1024, 2048)]
# The K loops' software pipelining (cp.async stages) and unrolling at the table's config (moe_gemv.pipelining; 1:
# neither, as the arguments' None now means moe_gemv.PIPELINING): a plain loop waits for each tile's words before it
# asks for the next (sm_90 SASS). An unroll by 4 spills the 4-bit down GEMV.
GEMV_PIPELINING = [dict(num_stages=st, unroll=u) for st in (1, 2, 3, 4) for u in (1, 2)]
GEMV_PIPELINING_PLAIN = dict(num_stages=1, unroll=1)


def sweep_line(rows: list[dict], what: str, base: dict, base_name: str) -> str:
    """One line of a sweep (``tile_sweep``'s rows, fastest first): the fastest config and its time and difference
    from the ``base`` config's output, then the base config's time."""
    nan = float("nan")
    best = rows[0]
    at_base = next(r for r in rows if all(r[k] == v for k, v in base.items()))
    return (f"fastest {what} {({k: best[k] for k in base})} {best.get('us', nan):.1f} us (rel diff "
            f"{best.get('rel_diff', nan):.1e}); {base_name} {at_base.get('us', nan):.1f} us")


def routings(m: int, n_exp: int, k: int, dev: str, count: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` routings ``(weights [m, k] renormalized, ids [m, k])`` of m tokens for timed calls to cycle
    through: at batch 1 disjoint sets of k experts while they last (16 x 8 of 128: every expert once), else random
    top-k."""
    g = torch.Generator().manual_seed(100 + m)
    perm = torch.randperm(n_exp, generator=g)
    out = []
    for j in range(count):
        logits = torch.randn(m, n_exp, generator=g)
        if m == 1 and (j + 1) * k <= n_exp:
            logits[0, perm[j * k:(j + 1) * k]] += 30.0  # these k win
        w, ids = torch.topk(logits.softmax(-1), k, dim=-1)
        out.append(((w / w.sum(-1, keepdim=True)).to(dev), ids.to(dev)))
    return out


def _as_vector(out) -> torch.Tensor:
    """A call's output (a tensor, or a list of them: one a routing) as one float32 vector."""
    return torch.cat([o.float().flatten() for o in out]) if isinstance(out, list) else out.float().flatten()


def tile_sweep(call, candidates=None, default=None, per: int = 1) -> list[dict]:
    """``call(**tiles)`` as a CUDA-graph replay for every candidate config (TILE_CANDIDATES), fastest first, in us
    a replay / ``per`` (the calls a replay makes: ``over_routings``); each output checked against the ``default``
    config's (relative difference), so a config that computes something else shows."""
    from quantkit.tools.bench import graph_time

    want = _as_vector(call(**(default or {})))
    out = []
    for tiles in candidates or TILE_CANDIDATES:
        try:
            got = _as_vector(call(**tiles))
            us = graph_time(lambda tiles=tiles: call(**tiles)) * 1e6 / per
        except Exception as exc:  # e.g. out of shared memory: the config cannot run here
            out.append({**tiles, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        out.append({**tiles, "us": us, "rel_diff": ((got - want).norm() / want.norm()).item()})
    return sorted(out, key=lambda r: r.get("us", float("inf")))


FULL_DEFAULTS = {"layers": 48, "nsamples": 128, "seqlen": 2048, "steps": 64, "kernel_m": [1, 8, 32, 256, 2048]}
TINY_DEFAULTS = {"layers": 2, "nsamples": 4, "seqlen": 64, "steps": 4, "kernel_m": [1, 8]}  # minutes on a CPU


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    # defaults of None: the real sizes, or with --tiny the smoke test's (TINY_DEFAULTS)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (48: the real depth)")
    p.add_argument("--nsamples", type=int, default=None, help="calibration windows (128)")
    p.add_argument("--seqlen", type=int, default=None, help="tokens a window (2048)")
    p.add_argument("--batch-size", type=int, default=8, help="calibration windows per forward")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    p.add_argument("--steps", type=int, default=None, help="decode steps per batch size (64)")
    p.add_argument("--kernel-m", type=int, nargs="+", default=None, help="rows of the kernel section")
    p.add_argument("--skip", nargs="*", default=[], choices=["gptq", "awq", "serve", "kernel"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-device", default=None,
                   help="where the model to quantize sits (default: --device; drawn there and moved); cpu: in "
                   "host memory, the walker moving one layer at a time to --device, as a model loaded from disk is")
    p.add_argument("--tiny", action="store_true", help="a small model of the same family (a smoke test, CPU ok)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/bench_moe_<date>.json)")
    args = p.parse_args()
    for name, value in (TINY_DEFAULTS if args.tiny else FULL_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    sizes = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    if args.tiny:
        sizes.update(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_experts=16,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024)
    record: dict = {"card": card(), "args": vars(args), "shape": sizes}
    model = result = scheme = None
    if "gptq" not in args.skip:
        model, result, scheme = run_gptq(args, sizes, record)
        print(json.dumps(record["gptq"], indent=1), flush=True)
    if "awq" not in args.skip and "serve" in args.skip:
        model = result = None
        _free()
        record["awq"] = run_method(args, sizes, "awq")
        print(json.dumps(record["awq"], indent=1), flush=True)
    if "serve" not in args.skip and model is None:  # serving speed does not depend on the method: RTN is quick
        model, result, scheme = quantize_rtn(args, sizes, record)
    if "serve" not in args.skip:
        from quantkit.tools.bench import copy_bandwidth

        # bytes read per second (a copy reads and writes); the CPU smoke test takes a nominal 10 GB/s
        bandwidth = copy_bandwidth(args.device) * 1e9 / 2 if args.device.startswith("cuda") else 1e10
        record["copy_read_bandwidth_gbs"] = bandwidth / 1e9
        runtime = runtime_from(model, result.weights, scheme)
        # the int4 engine and the bf16 baseline need only the packed weights and the shapes: the 61 GB bf16 model
        # goes first (beside it the int4 engine's KV cache did not fit an 80 GB H100)
        shapes = _MetaModel(model)
        del model, result
        _free()
        rows = serve_rows(runtime, "int4", args, bandwidth)
        del runtime
        _free()
        save(record, args)
        rows += serve_rows(runtime_from(shapes, None, scheme, dense_random=True), "bf16", args, bandwidth)
        record["serve"] = rows
        by = {(r["model"], r["what"]): r["tokens_per_s"] for r in rows}
        record["int4_over_bf16_decode_b1"] = by[("int4", "decode b1")] / by[("bf16", "decode b1")]
    if "kernel" not in args.skip and not args.device.startswith("cuda"):
        print("kernel section skipped: the fused kernel against the per-expert W4A16 loop is a CUDA timing")
    elif "kernel" not in args.skip:
        save(record, args)
        record["kernel"] = kernel_rows(args)
    if "awq" not in args.skip and "serve" not in args.skip:  # after the serving runs freed their memory
        _free()
        record["awq"] = run_method(args, sizes, "awq")
    print_table(record)
    print(f"wrote {save(record, args)}")


def save(record: dict, args) -> Path:
    """The record so far (written after each section too: a run cut by a time limit keeps what it measured)."""
    out = Path(args.out or f"bench/results/bench_moe_{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))
    return out


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def print_table(record: dict) -> None:
    if "gptq" in record:
        gq = record["gptq"]
        print(f"\nGPTQ {record['shape']['num_hidden_layers']} layers, {gq['tokens']} tokens: {gq['total_seconds']:.0f} s "
              f"with the unfuse (walk {gq['seconds']:.0f} s; target < 600 s), peak device {gq['peak_device_gib']:.1f} "
              f"GiB, host {gq['peak_host_gib']:.1f} GiB, {gq['rtn_fallback_experts']} RTN-fallback experts")
    if "awq" in record:
        aw = record["awq"]
        print(f"AWQ (defaults): {aw['total_seconds']:.0f} s with the unfuse (walk {aw['seconds']:.0f} s; target < 600 s), "
              f"peak device {aw['peak_device_gib']:.1f} GiB, host {aw['peak_host_gib']:.1f} GiB")
    if "serve" in record:
        print(f"\n{'model':6s} {'what':14s} {'tok/s':>10s}  graphs  roofline")
        for r in record["serve"]:
            roof = f"{r['fraction_of_roofline']:.0%} of {r['roofline_tokens_per_s']:.0f}" if "roofline_tokens_per_s" in r \
                else ""
            print(f"{r['model']:6s} {r['what']:14s} {r['tokens_per_s']:10.1f}  {str(r['graphs']):6s}  {roof}")
        print(f"int4 / bf16 decode at batch 1: {record['int4_over_bf16_decode_b1']:.2f}x (target >= 1.6x)")
    if "kernel" in record:
        print(f"\n{'M':>6s} {'fused us':>10s} {'loop us':>10s} {'speedup':>8s} {'rel err':>9s}   the MoE block in a "
              "CUDA graph, us: routing + align in one program / as torch ops")
        for r in record["kernel"]:
            print(f"{r['m']:6d} {r['fused_us']:10.1f} {r['loop_us']:10.1f} {r['speedup']:8.2f} "
                  f"{r['rel_err_vs_loop']:9.1e}   {r['graph_block_us_align_auto']:8.1f} / "
                  f"{r['graph_block_us_align_torch']:8.1f}{'' if r['one_program_align'] else '  (beyond one program)'}")
        rotated = max((r.get("rotations", 1) for r in record["kernel"]), default=1)
        if rotated > 1:
            print(f"(decode sizes: graph timings are one call's share of a replay over {rotated} routings, so the "
                  "experts come from HBM, not L2)")
        for r in record["kernel"]:
            if "gemv_graph_us" in r:
                print(f"M={r['m']}: decode GEMV {r['gemv_graph_us']:.1f} us against the tiled kernel "
                      f"{r['tiles_graph_us']:.1f} us (graph replays; rel err vs loop {r['gemv_rel_err_vs_loop']:.1e}); "
                      f"the MoE block with it {r['graph_block_us_gemv']:.1f} us"
                      + (f", and with the router fused into the routing (the default) "
                         f"{r['graph_block_us_gemv_fused_router']:.1f} us"
                         if "graph_block_us_gemv_fused_router" in r else ""))
                kt = r["block_kernels_gemv"]
                print(f"  its kernels: {kt['sum_us']:.1f} us in {kt['launches']} launches: "
                      + "; ".join(f"{x['name'][:36]} x{x['calls']} {x['us']:.1f}" for x in kt["kernels"]))
        sweeps = (("tile_sweep", "tiles", lambda r: tile_default(), "default"),
                  ("prefill_tile_sweep", "prefill tiles", lambda r: tile_default(prefill=True),
                   "the plain 16 x 64 tiles"),
                  ("gemv_pipelining_sweep", "GEMV pipelining", lambda r: GEMV_PIPELINING_PLAIN, "neither"),
                  ("gemv_sweep", "GEMV", lambda r: r["gemv_config"], "the table's"))
        for key, what, base, base_name in sweeps:
            for r in record["kernel"]:
                if r.get(key):
                    print(f"M={r['m']}: " + sweep_line(r[key], what, base(r), base_name))


if __name__ == "__main__":
    main()
