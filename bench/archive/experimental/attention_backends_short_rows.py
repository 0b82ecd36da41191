"""Each attention backend's default config at the short rows where `attention_select` picks the FA3-ordered Gluon
kernel (hd128 at S <= 512, causal S <= 1024), beside the other two kernels, in one process (CUDA-graph replays,
median, each cell timed twice to show its spread). Question: does the FA3-ordered kernel still earn its place?

    python bench/experimental/attention_backends_short_rows.py --out DIR
"""

import argparse
import datetime
import json
import platform

import torch
import triton

from quantkit.kernels.attention import attention

TOKENS = 16384


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seqlens", default="256,512,1024,2048")
    args = ap.parse_args()
    rows = []
    for hq, hkv, d in ((16, 16, 128), (32, 8, 128), (16, 16, 64)):
        for s in (int(x) for x in args.seqlens.split(",")):
            b = TOKENS // s
            q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
            for causal in (False, True):
                flop = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
                row = dict(hq=hq, hkv=hkv, d=d, seqlen=s, causal=causal)
                ref = attention(q, k, v, causal=causal, backend="triton").float()
                for _rep in range(2):
                    for be in ("auto", "triton", "gluon", "gluon_ws"):
                        try:
                            fn = lambda: attention(q, k, v, causal=causal, backend=be)  # noqa: E731
                            out = fn()
                            err = ((out.float() - ref).norm() / ref.norm()).item()
                            ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
                            row.setdefault(be, []).append(round(flop / ms / 1e9, 1))
                            row[f"{be}_err"] = round(err, 5)
                        except Exception as e:  # a backend that does not take the case
                            row[be] = f"{type(e).__name__}: {str(e)[:80]}"
                rows.append(row)
                print(row, flush=True)
            del q, k, v
    meta = dict(card=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                unit="TFLOP/s, two timings per cell")
    with open(f"{args.out}/attention_backends_short_rows.json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
