"""Where the host time of one `attention()` call goes: cProfile over repeated calls on one GPU.

    python3 bench/debug/attention_host_profile.py [--shape 16/16/512/64] [--fp8] [--causal] [--calls 300]

Prints the functions with the most own time and the most cumulative time per call (microseconds).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from quantkit.kernels.attention import attention
from quantkit.kernels.attention_fp8 import prepare_fp8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16/16/512/64")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    hq, hkv, s, *rest = (int(x) for x in args.shape.split("/"))
    d = rest[0] if rest else 128
    b = 16384 // s
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    prep = prepare_fp8(*(x.reshape(-1, x.shape[2], d) for x in (q, k, v)), cu_seqlens_k=cu) if args.fp8 else None
    for _ in range(3):
        attention(q, k, v, causal=args.causal, fp8_prepared=prep)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        attention(q, k, v, causal=args.causal, fp8_prepared=prep)
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    total = stats.total_tt / args.calls * 1e6
    print(f"{args.shape} fp8={args.fp8} causal={args.causal}: {total:.1f} us of Python a call (under cProfile)")
    for key in ("tottime", "cumulative"):
        print(f"--- by {key}, us a call")
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3], reverse=True)
        for (path, line, name), (_, ncalls, tt, ct, _) in rows[:args.top]:
            print(f"{tt / args.calls * 1e6:8.1f} {ct / args.calls * 1e6:8.1f} {ncalls / args.calls:6.1f}x  "
                  f"{path.split('site-packages/')[-1]}:{line} {name}")


if __name__ == "__main__":
    main()
