"""How much of a short attention call is the host: one H200, the kernels behind `attention()` timed three ways.

    python3 bench/debug/attention_timing_modes.py [--shapes 16/16/512/64,16/16/1024] [--json F]

For each shape (hq/hkv/seqlen[/head_dim], 16384 tokens a batch as in bench_attention.py), causal and not:
* host: microseconds of Python per call, 200 calls with no synchronisation (the GPU queue absorbs them);
* do_bench: `triton.testing.do_bench` as bench_attention.py times it (an L2 flush before each call, CUDA
  events around it), so a call whose host side outlasts the flush is timed with the GPU waiting for it;
* graph: `do_bench_cudagraph`, replays of a captured call: the GPU time alone.
Rows: quantkit bf16 and fp8 (prepared outside the timing) through `attention()`, and SDPA's cuDNN backend.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_attention import TOKENS, host_us  # noqa: E402

from quantkit.kernels.attention import attention  # noqa: E402
from quantkit.kernels.attention_fp8 import prepare_fp8  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16/16/512/64,16/16/1024/64,16/16/2048/64,16/16/512,16/16/1024,16/16/2048,"
                                        "32/8/1024,16/16/8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'shape':>16} c | {'name':6} | {'host us':>8} {'do_bench us':>11} {'graph us':>9} | TFLOP/s do_bench / graph")
    for text in args.shapes.split(","):
        hq, hkv, s, *rest = (int(x) for x in text.split("/"))
        d = rest[0] if rest else 128
        b = TOKENS // s
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        prep = prepare_fp8(*(x.reshape(-1, x.shape[2], d) for x in (q, k, v)), cu_seqlens_k=cu)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        for causal in (False, True):
            flops = 4.0 * b * hq * s * s * d / (2 if causal else 1)

            def cudnn(causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                            enable_gqa=hq != hkv)

            fns = {"bf16": lambda causal=causal: attention(q, k, v, causal=causal),
                   "fp8": lambda causal=causal: attention(q, k, v, causal=causal, fp8_prepared=prep),
                   "cudnn": cudnn}
            for name, fn in fns.items():
                h = host_us(fn, calls=200)
                eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
                rows.append(dict(hq=hq, hkv=hkv, seqlen=s, head_dim=d, causal=causal, name=name, host_us=h,
                                 do_bench_us=eager, graph_us=graph, tflops_do_bench=flops / eager / 1e6,
                                 tflops_graph=flops / graph / 1e6))
                print(f"{text:>16} {int(causal)} | {name:6} | {h:8.1f} {eager:11.1f} {graph:9.1f} | "
                      f"{flops / eager / 1e6:6.1f} / {flops / graph / 1e6:6.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           date=datetime.datetime.now().isoformat(timespec="seconds"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
