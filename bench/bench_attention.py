"""Benchmark quantkit's attention kernels (prefill + decode) against PyTorch SDPA backends on one GPU.

    python bench/bench_attention.py [--quick] [--out bench/runs]

Prefill: batch x seqlen = 16384 tokens, seqlen 512..16384, 16 heads at head dim 64 and 128, and a
GQA row (32 query heads, 8 KV heads, head dim 128); causal and non-causal; bf16.
TFLOP/s = 4 * batch * heads * seqlen^2 * headdim / time (halved for causal); time = the median of CUDA-graph
replays (the GPU time; --eager: eager calls with an L2 flush, as runs up to 22 timed them). Each prefill row
also has the host microseconds per call of our two paths and of cuDNN (*_host_us), which eager callers pay.
Peers: scaled_dot_product_attention with each backend forced (flash, cuDNN, efficient).
Ours: the Triton kernel (kernels/attention.py), the Gluon kernel with the FA3 overlap
(kernels/attention_gluon.py; NO_GLUON=1 leaves it out), the warp-specialized FA3-structured Gluon
kernel (kernels/attention_gluon_ws.py; NO_WS=1 leaves it out) and the FP8 path (best fp8 variant).
Options restrict the run to fit a device lease: --seqlens, --heads, --variants, --peers, --sections.
Also: a sweep of our kernel variants (tile shapes, ring depth, warp specialization) at seqlen
4096 that picks the configs for the table, the FP8 path's accuracy (with and without the
Hadamard rotation), and decode bandwidth (KV bytes read / time) against the measured device
copy bandwidth.
Writes attention_<date>.json under --out (and a PNG plot of the prefill table beside it when
matplotlib is installed) and prints a compact table last.
"""
import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from quantkit.kernels.attention import attention
from quantkit.kernels.attention_fp8 import prepare_fp8
from quantkit.kernels.decode_attention import decode_attention_ref, decode_attention_rope

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_results import plot_after_run  # noqa: E402

TOKENS = 16384


def bench(fn, graph=False):
    """Median milliseconds of ``fn``: CUDA-graph replays (graph, the GPU time alone), or eager calls with an L2
    flush before each (Triton's do_bench: a call whose host side outlasts the flush is timed with the GPU
    waiting for it, as an eager caller sees it)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_us(fn, calls=100):
    """Microseconds of host time per call: ``calls`` calls with no synchronisation (the GPU queue takes them)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(elapsed / calls * 1e6, 1)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def make(b, s, hq, hkv, d, dtype=torch.bfloat16):
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
    return q, k, v


def sdpa_fn(q, k, v, causal, backend):
    # SDPA gets its own preferred (B, H, S, D) contiguous layout: no transposes are timed
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    gqa = qt.shape[1] != kt.shape[1]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                    enable_gqa=gqa)
    return run


def try_time(make_fn, graph=False):
    try:
        return round(bench(make_fn(), graph), 4), None
    except Exception as e:  # a backend or variant that does not run here is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def copy_bandwidth():
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9  # TB/s, bytes read + written


GLUON = os.environ.get("NO_GLUON") != "1"  # NO_GLUON=1: the Gluon kernel failed its tests here
BACKEND = "auto" if GLUON else "triton"

# (name, kwargs of `attention`); each is timed at seqlen 4096, hd 128, 16 heads, 16384 tokens
# Run 1 of 2026-11-30 (evening) also timed triton+ws 128x128 w8 s3 (= plain), fp8 triton 128x128
# w8 s2, gluon 128x64 w8 b4 and fp8 gluon 128x128 w8 b5 (all slower; NOTES_attention.md).
# 64-row tiles with 4 warps (one warpgroup) fit two programs per SM (<= 113 KB of shared memory
# each): independent warpgroups whose softmax and MMA phases can interleave (ping-pong by the
# hardware scheduler), at twice the L2 -> SM traffic per FLOP of 128-row tiles.
WS = GLUON and os.environ.get("NO_WS") != "1"  # NO_WS=1: the warp-specialized kernel failed here
# Run 4 also timed triton 64x64 w4 s2, gluon 64x64 w4 b2, fp8 triton 128x128 w8 s3 / 64x128 w4 s2,
# fp8qk triton 128x128 w8 s3 and fp8 gluon 128x128 w8 b3 / 64x64 w4 b4: all slower than the
# configs kept here (NOTES_attention.md), so run 5 leaves them out to save device time.
BF16_VARIANTS = [
    ("triton 128x128 w8 s3", dict(backend="triton", config=(128, 128, 8, 3))),
    ("triton 64x64 w4 s3", dict(backend="triton", config=(64, 64, 4, 3))),
] + ([
    # FA3 order: softmax of tile j under the P V wgmma of tile j - 1 (attention_gluon.py)
    ("gluon 128x128 w8 b3", dict(backend="gluon", config=(128, 128, 8, 3))),
    ("gluon 64x64 w4 b3", dict(backend="gluon", config=(64, 64, 4, 3))),
] if GLUON else []) + ([
    # FA3 structure: TMA producer partition + two consumer warpgroups ping-ponged (attention_gluon_ws.py);
    # config (BLOCK_N, NUM_BUF, persistent, pingpong). Run 5 (one program a tile) also timed 128x64 b4: slower
    # the kernel's own defaults per head dim, fp8 and length (attention_gluon_ws._default_config)
    ("ws default", dict(backend="gluon_ws")),
    ("ws 128x128 b2", dict(backend="gluon_ws", config=(128, 2, True, True))),
    ("ws 128x128 b3", dict(backend="gluon_ws", config=(128, 3, True, True))),
    ("ws 128x128 b2 1tile", dict(backend="gluon_ws", config=(128, 2, False, True))),
    ("ws 128x128 b3 1tile", dict(backend="gluon_ws", config=(128, 3, False, True))),
] if WS else [])
FP8_VARIANTS = [  # (name, kwargs, fp8 P @ V too?)
    ("fp8 triton 64x128 w4 s3", dict(backend="triton", config=(64, 128, 4, 3)), True),
] + ([
    ("fp8 ws default", dict(backend="gluon_ws"), True),
    ("fp8 ws 128x128 b4", dict(backend="gluon_ws", config=(128, 4, True, True)), True),
    ("fp8 ws 128x128 b4 nopp", dict(backend="gluon_ws", config=(128, 4, True, False)), True),
] if WS else [])


def fixed_cu(b, s):
    return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")


def sweep(args, results):
    """Our variants at one shape; returns the best kwargs per (kind, causal), kind in
    triton / gluon / gluon_ws / fp8."""
    s, d, h = 4096, 128, 16
    b = TOKENS // s
    q, k, v = make(b, s, h, h, d)
    best = {}
    for causal in (False, True):
        # float32 reference through SDPA's efficient backend (supports fp32)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=causal).transpose(1, 2)
        prep = {pv: prepare_fp8(*(x.reshape(-1, h, d) for x in (q, k, v)), fp8_pv=pv, cu_seqlens_k=fixed_cu(b, s))
                for pv in (True, False)}
        runs = [(name, kw, "bf16", 1e-2) for name, kw in BF16_VARIANTS]
        runs += [(name, dict(kw, fp8_prepared=prep[pv]), "fp8", 0.06) for name, kw, pv in FP8_VARIANTS]
        if args.variants:  # only the named variants (and so only their kinds in the table)
            runs = [r for r in runs if r[0] in args.variants.split(",")]
        for name, kw, kind, tol in runs:
            row = {"variant": name, "causal": causal, "seqlen": s, "head_dim": d}
            try:
                out = attention(q, k, v, causal=causal, **kw)
                row["rel_err"] = rel_err(out, ref)
                ms = bench(lambda: attention(q, k, v, causal=causal, **kw), args.graph)
                row["ms"] = round(ms, 4)
                row["tflops"] = round(flops(b, h, s, d, causal) / ms / 1e9, 1)
                key = ("fp8" if kind == "fp8" else kw["backend"], causal)
                if row["rel_err"] < tol and row["tflops"] > best.get(key, (0, None))[0]:
                    kw = {x: y for x, y in kw.items() if x != "fp8_prepared"}
                    best[key] = (row["tflops"], (kw, None if kind != "fp8" else
                                                 next(pv for n, _, pv in FP8_VARIANTS if n == name)))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            results["sweep"].append(row)
            print("sweep", row, flush=True)
        del ref, prep
    return {key: val[1] for key, val in best.items()}


def prefill_table(args, results, best):
    seqlens = [1024, 4096, 16384] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    if args.seqlens:
        seqlens = [int(x) for x in args.seqlens.split(",")]
    heads = [(16, 16, 64), (16, 16, 128), (32, 8, 128)]
    if args.heads:
        heads = [tuple(int(y) for y in x.split("/")) for x in args.heads.split(",")]
    for hq, hkv, d in heads:
        for s in seqlens:
            b = TOKENS // s
            q, k, v = make(b, s, hq, hkv, d)
            prep = {pv: prepare_fp8(*(x.reshape(-1, x.shape[2], d) for x in (q, k, v)), fp8_pv=pv,
                                    cu_seqlens_k=fixed_cu(b, s)) for pv in (True, False)}
            for causal in (False, True):
                row = {"hq": hq, "hkv": hkv, "head_dim": d, "seqlen": s, "batch": b, "causal": causal}
                f = flops(b, hq, s, d, causal)
                for col, kind in (("ours", "triton"), ("ours_gluon", "gluon"), ("ours_ws", "gluon_ws"),
                                  ("ours_fp8", "fp8")):
                    if (kind, causal) not in best:
                        row[col] = "not run"
                        continue
                    kw, pv = best[(kind, causal)]
                    kw = dict(kw)
                    if d != 128 and "config" in kw:
                        # the default config for that head dim (the ring depth of a 128-wide config
                        # may not fit shared memory at another head dim)
                        kw.pop("config")
                    if kind == "fp8":
                        kw["fp8_prepared"] = prep[pv]
                    t, err = try_time(lambda: (lambda: attention(q, k, v, causal=causal, **kw)), args.graph)
                    row[col] = round(f / t / 1e9, 1) if t else err
                    if t:
                        row[f"{col}_host_us"] = host_us(lambda: attention(q, k, v, causal=causal, **kw))
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                 ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                    if name not in args.peers.split(","):
                        row[name] = "not run"
                        continue
                    tb, errb = try_time(lambda: sdpa_fn(q, k, v, causal, be), args.graph)
                    row[name] = round(f / tb / 1e9, 1) if tb else errb
                    if tb and name == "cudnn":
                        row["cudnn_host_us"] = host_us(sdpa_fn(q, k, v, causal, be))
                results["prefill"].append(row)
                print("prefill", row, flush=True)
            del q, k, v, prep


def fp8_accuracy(results):
    """Relative error vs float32 on random data, and on data with outlier channels in q and k
    (as activations of real LLMs have), for bf16, fp8, and fp8 + Hadamard (fp8: per-token q,
    per-128-key-block k, per-head v scales)."""
    b, s, h, d = 4, 2048, 16, 128
    for outliers in (False, True):
        q, k, v = make(b, s, h, h, d)
        if outliers:
            scale = torch.ones(d, device="cuda")
            scale[torch.randperm(d, device="cuda")[:4]] = 30.0
            q, k = (q.float() * scale / 8).bfloat16(), (k.float() * scale / 8).bfloat16()
        ref = attention(q.float(), k.float(), v.float(), causal=True)
        be = BACKEND
        row = {"outlier_channels": outliers,
               "bf16": rel_err(attention(q, k, v, causal=True, backend=be), ref),
               "fp8": rel_err(attention(q, k, v, causal=True, fp8=True, backend=be), ref),
               "fp8_triton_kernel": rel_err(attention(q, k, v, causal=True, fp8=True, backend="triton"), ref),
               "fp8_hadamard": rel_err(attention(q, k, v, causal=True, fp8=True, hadamard=True, backend=be), ref),
               "fp8_qk_only": rel_err(attention(q, k, v, causal=True, fp8=True, fp8_pv=False), ref),
               "fp8_qk_only_hadamard": rel_err(attention(q, k, v, causal=True, fp8=True, fp8_pv=False,
                                                         hadamard=True), ref)}
        results["fp8_accuracy"].append(row)
        print("fp8_acc", row, flush=True)


def fp8_call_table(args, results):
    """The public fp8 call against our bf16 in one process (--heads, default 16/16/128), bf16 inputs, CUDA-graph
    timing: bf16 (``attention``, auto), fp8 through the public call (fp8=True: the fused quantization + the
    kernel; fp8="auto": that or bf16, as ``attention_select.select_fp8`` decides), the
    former public call (``prepare_fp8`` in PyTorch + the kernel), e4m3 inputs with descale factors (V moved to
    the kernels' layout + the kernel), the kernel alone on prepared operands, and the fused quantization alone.
    Relative errors against float32 attention on the same bf16 inputs."""
    from quantkit.kernels.attention_fp8 import quantize_fp8_per_token, quantize_qkv_fp8

    heads = [tuple(int(x) for x in t.split("/")) for t in args.heads.split(",")] if args.heads else [(16, 16, 128)]
    seqlens = [int(x) for x in args.seqlens.split(",")] if args.seqlens else [2048, 8192, 16384]
    wanted = set(args.fp8call_paths.split(",")) if args.fp8call_paths else None
    for (h, hkv, d), s in itertools.product(heads, seqlens):
        b = TOKENS // s
        q, k, v = make(b, s, h, hkv, d)
        flat = [x.reshape(b * s, -1, d) for x in (q, k, v)]
        cu = fixed_cu(b, s)
        q8, qd = quantize_fp8_per_token(flat[0])  # what a projection emitting e4m3 would give
        kd, vd = (x.abs().amax(dim=(0, 2)).float() / 448.0 for x in flat[1:])
        k8, v8 = ((x.float() / sc[:, None]).to(torch.float8_e4m3fn) for x, sc in zip(flat[1:], (kd, vd)))
        pre8 = [x.view(b, s, -1, d) for x in (q8, k8, v8)]
        prepared = quantize_qkv_fp8(*flat, cu, s)
        for causal in (False, True):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                ref = torch.nn.functional.scaled_dot_product_attention(  # the float32 kernel has no GQA
                    *(x.float().repeat_interleave(h // x.shape[2], 2).transpose(1, 2) for x in (q, k, v)),
                    is_causal=causal).transpose(1, 2)
            paths = {
                "bf16": lambda: attention(q, k, v, causal=causal),
                "fp8_public": lambda: attention(q, k, v, causal=causal, fp8=True),
                "fp8_auto": lambda: attention(q, k, v, causal=causal, fp8="auto"),
                "fp8_public_before": lambda: attention(q, k, v, causal=causal,
                                                       fp8_prepared=prepare_fp8(*flat, cu_seqlens_k=cu)),
                "fp8_inputs_descale": lambda: attention(*pre8, causal=causal, q_descale=qd, k_descale=kd,
                                                        v_descale=vd),
                "fp8_kernel_only": lambda: attention(q, k, v, causal=causal, fp8_prepared=prepared),
                "quantize_only": lambda: quantize_qkv_fp8(*flat, cu, s),
            }
            if wanted:
                paths = {n: fn for n, fn in paths.items() if n in wanted}
            row = {"hq": h, "hkv": hkv, "head_dim": d, "seqlen": s, "batch": b, "causal": causal}
            f = flops(b, h, s, d, causal)
            for name, fn in paths.items():
                if not name.startswith("quantize"):
                    row[f"{name}_rel_err"] = round(rel_err(fn(), ref), 5)
                t, err = try_time(lambda fn=fn: fn, graph=True)
                row[f"{name}_us"] = round(t * 1e3, 1) if t else err
                if t and not name.startswith("quantize"):
                    row[f"{name}_tflops"] = round(f / t / 1e9, 1)
            for name in ("fp8_public", "fp8_auto", "fp8_public_before", "fp8_inputs_descale", "fp8_kernel_only"):
                if isinstance(row.get(f"{name}_us"), float) and isinstance(row.get("bf16_us"), float):
                    row[f"{name}_vs_bf16"] = round(row["bf16_us"] / row[f"{name}_us"], 3)
            results["fp8_call"].append(row)
            print("fp8_call", row, flush=True)
            del ref
        del q, k, v, flat, prepared, q8, k8, v8, pre8


def decode_table(results, copy_tbs):
    """The runtime's decode attention (``decode_attention_rope``: RoPE, the cache write and split attention in one
    launch) on a full cache: the token at position L - 1 attends to L keys. RoPE is given the identity (cos 1,
    sin 0) and the last cached key/value as the new token's, so the float32 reference reads the same cache."""
    shapes = [(1, 32768, 32, 8, 128), (8, 8192, 32, 8, 128), (64, 2048, 32, 8, 128), (16, 4096, 16, 16, 64)]
    for b, L, hq, hkv, d in shapes:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, L, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        rows = torch.arange(b, device="cuda")
        qkv = torch.cat([q[:, 0].reshape(b, -1), kc[rows, L - 1].reshape(b, -1), vc[rows, L - 1].reshape(b, -1)], 1)
        cos, sin = torch.ones(L, d // 2, device="cuda"), torch.zeros(L, d // 2, device="cuda")
        args = (qkv, cos, sin, lens - 1, rows.int(), kc, vc, hq, torch.zeros(b * hkv, dtype=torch.int32, device="cuda"))
        out = decode_attention_rope(*args).view(q.shape)
        # the float32 reference on the first sequence only (the loop reference is slow)
        err = rel_err(out[:1], decode_attention_ref(q[:1], kc[:1], vc[:1], lens[:1]))
        # CUDA graph replay, as a server runs decode: launch overhead out of the kernel time
        ms = triton.testing.do_bench_cudagraph(lambda: decode_attention_rope(*args), rep=100, return_mode="median")
        kv_bytes = 2 * b * L * hkv * d * 2
        row = {"batch": b, "cache_len": L, "hq": hq, "hkv": hkv, "head_dim": d, "ms": round(ms, 4),
               "kv_TBps": round(kv_bytes / ms / 1e9, 3),
               "frac_of_copy": round(kv_bytes / ms / 1e9 / copy_tbs, 3),
               "rel_err": err}
        results["decode"].append(row)
        print("decode", row, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/runs"))
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--seqlens", help="comma list for the prefill table, e.g. 2048,4096")
    ap.add_argument("--heads", help="comma list of hq/hkv/d for the prefill table, e.g. 16/16/128,32/8/128")
    ap.add_argument("--sections", default="prefill,fp8acc,decode",
                    help="which of prefill,fp8acc,decode,fp8call to run (fp8call: the public fp8 call against bf16)")
    ap.add_argument("--fp8call-paths", help="comma list of the fp8call section's paths to time (default: all)")
    ap.add_argument("--name", help="results file name (default attention_<date>.json)")
    ap.add_argument("--variants", help="comma list of sweep variant names to run (default: all)")
    ap.add_argument("--peers", default="flash,cudnn,efficient", help="SDPA backends to time")
    ap.add_argument("--eager", dest="graph", action="store_false",
                    help="time eager calls with an L2 flush (do_bench; runs up to 22) instead of CUDA-graph replays")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results = {"card": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
               "triton": triton.__version__, "cuda": torch.version.cuda,
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "tokens": TOKENS,
               "timing": "cuda graph replays" if args.graph else "eager, L2 flushed (do_bench)",
               "sweep": [], "prefill": [], "fp8_accuracy": [], "decode": [], "fp8_call": []}
    results["copy_TBps"] = round(copy_bandwidth(), 3)
    best = {} if args.skip_sweep else sweep(args, results)
    results["chosen"] = {str(c): str(v) for c, v in best.items()}
    print("chosen:", results["chosen"], flush=True)
    sections = {"prefill": lambda: prefill_table(args, results, best), "fp8acc": lambda: fp8_accuracy(results),
                "decode": lambda: decode_table(results, results["copy_TBps"]),
                "fp8call": lambda: fp8_call_table(args, results)}
    result_path = os.path.join(args.out, args.name or f"attention_{datetime.date.today()}.json")
    for name in args.sections.split(","):
        try:
            sections[name]()
        except Exception as e:
            print("section failed:", type(e).__name__, str(e)[:300], flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(result_path, "w") as f:  # after every section, so a later failure keeps what ran
            json.dump(results, f, indent=1)
    if results["prefill"]:
        plot_after_run(result_path)

    # ---- compact table last ----
    print(f"\n{results['card']} torch {results['torch']} triton {results['triton']} "
          f"copy {results['copy_TBps']} TB/s")
    print("chosen:", results["chosen"])
    for r in results["sweep"]:
        print(f"sweep {r['variant']:22s} causal={int(r['causal'])} "
              + (f"{r['tflops']:6.1f} TF/s err {r['rel_err']:.1e}" if "tflops" in r
                 else r.get("error", "")[:90]))
    print("hq/hkv/d  seqlen c | triton gluon  ws     fp8    flash  cudnn  effic  (TFLOP/s)")
    for r in results["prefill"]:
        cells = [r[k] if isinstance(r[k], float) else "err"
                 for k in ("ours", "ours_gluon", "ours_ws", "ours_fp8", "flash", "cudnn", "efficient")]
        print(f"{r['hq']}/{r['hkv']}/{r['head_dim']:<4d} {r['seqlen']:6d} {int(r['causal'])} | "
              + " ".join(f"{c:6}" if isinstance(c, str) else f"{c:6.1f}" for c in cells))
    for r in results["fp8_accuracy"]:
        print("fp8 acc", {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()})
    for r in results["decode"]:
        print(f"decode b={r['batch']} L={r['cache_len']} {r['hq']}/{r['hkv']}/{r['head_dim']}: {r['ms']} ms "
              f"{r['kv_TBps']} TB/s ({r['frac_of_copy']:.0%} of copy) err {r['rel_err']:.1e}")
    if results["fp8_call"]:
        print("hq/hkv/d seqlen c | us: bf16  fp8 call  auto  before  fp8 in  kernel  quant | x bf16: call auto before "
              "fp8in kernel | err bf16 fp8call auto fp8in")
    for r in results["fp8_call"]:
        us = [r.get(f"{n}_us") for n in ("bf16", "fp8_public", "fp8_auto", "fp8_public_before",
                                          "fp8_inputs_descale", "fp8_kernel_only", "quantize_only")]
        x = [r.get(f"{n}_vs_bf16") for n in ("fp8_public", "fp8_auto", "fp8_public_before", "fp8_inputs_descale",
                                              "fp8_kernel_only")]
        e = [r.get(f"{n}_rel_err") for n in ("bf16", "fp8_public", "fp8_auto", "fp8_inputs_descale")]
        print(f"{r['hq']}/{r['hkv']}/{r['head_dim']} {r['seqlen']:6d} {int(r['causal'])} | "
              + " ".join(f"{str(u):>8}" for u in us) + " | " + " ".join(f"{str(v):>6}" for v in x) + " | "
              + " ".join(f"{str(v):>8}" for v in e))
    errors = [r for r in results["prefill"] if isinstance(r["ours"], str) and r["ours"] != "not run"]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
