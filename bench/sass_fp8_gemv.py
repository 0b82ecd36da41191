"""What the sm_90 machine code of the dense decode GEMVs says about bytes in flight (CPU only, no GPU): bf16
against the two FP8 paths, at the configs the runtime picks at M = 1 for Llama-3-8B's linears.

    python bench/sass_fp8_gemv.py [--out bench/runs/sass_fp8_gemv.json]

Issue #42: on one H200 the FP8 decode linears read their 8.0 GB at ~2.4 TB/s while bf16's read 15.0 GB at ~4.2
(docs/fp8.md). Each case compiles ``kernels/gemv.py``'s ``_gemv_kernel`` for sm_90 with Triton's ptxas exactly as
its launcher specializes it (16-byte aligned pointers, sizes divisible by 16, ``num_stages=1``, PDL on) and reads
the SASS with ``bench/sass_w4a16_decode.py``'s analysis: registers and the warps an SM holds, the widths of the
weight loads, and in the K loop the bytes a thread has issued and not yet waited for. By Little's law an SM
streams about (bytes in flight) / latency; an H200 needs ~25-30 KB in flight per SM for its copy rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_w4a16_decode import analyse, in_flight_per_sm, summarize, tool, write_record  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantkit.kernels.gemv import _gemv_kernel
sig_types, constexprs, num_warps, out = json.loads(sys.argv[1])
names = ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_ym", "xs_ptr", "ws_ptr"]
signature = dict(zip(names, sig_types), **{n: "constexpr" for n in constexprs})
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names}  # every pointer aligned, every size % 16 == 0
k = triton.compile(ASTSource(fn=_gemv_kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})
open(out, "wb").write(k.asm["cubin"])
"""


def cases() -> list[dict]:
    """(label, argument types, constexprs, warps) of each path on each layer, with the launchers' own configs."""
    from quantkit.kernels import gemv, gemv_fp8

    out = []
    for layer, (n, k) in SHAPES.items():
        cfg = gemv._gemv_config(1, n, k)
        base = dict(M=1, HAS_BIAS=False, EVEN_K=True, PDL=True)
        out.append(dict(label=f"bf16 {layer} {n}x{k}", layer=layer, path="bf16", config=cfg.__dict__,
                        types=["*bf16", "*bf16", "*bf16", "*bf16", "i32", "i32", "i32", "i32", "i32", "*bf16", "*bf16"],
                        cx=dict(base, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALED=False, W_VEC=cfg.vec),
                        warps=cfg.num_warps))
        # the two-launch FP8 path: codes from fp8_quant, then gemv(..., scales=) (bf16's config, BLOCK_K doubled)
        c2 = gemv._fp8_codes_config(1, n, k)
        out.append(dict(label=f"fp8 two-launch {layer} {n}x{k}", layer=layer, path="fp8_two_launch",
                        config=c2.__dict__,
                        types=["*fp8e4nv", "*fp8e4nv", "*fp8e4nv", "*bf16", "i32", "i32", "i32", "i32", "i32", "*fp32",
                               "*fp32"],
                        cx=dict(base, BLOCK_N=c2.block_n, BLOCK_K=c2.block_k, SCALED=True, W_VEC=c2.vec),
                        warps=c2.num_warps))
        c1 = gemv_fp8.TUNED_FP8.get((n, k, 1), gemv_fp8.DEFAULT_FP8[1])
        out.append(dict(label=f"fp8 one-launch {layer} {n}x{k}", layer=layer, path="fp8_one_launch",
                        config=c1.__dict__,
                        types=["*bf16", "*fp8e4nv", "*fp8e4nv", "*bf16", "i32", "i32", "i32", "i32", "i32", "*fp32",
                               "*fp32"],
                        cx=dict(base, BLOCK_N=c1.block_n, BLOCK_K=c1.block_k, SCALED=True, QUANT_X=True,
                                STATIC_X=False, AMAX_BLOCK=gemv_fp8.amax_block(1, k, c1.num_warps),
                                W_VEC=c1.vec or gemv_fp8.VEC),
                        warps=c1.num_warps))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default bench/runs/sass_fp8_gemv_<date>.json)")
    args = ap.parse_args(argv)
    if not Path(tool("cuobjdump")).exists():
        print("sass_fp8_gemv: this triton build ships no cuobjdump/ptxas", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results = []
    with tempfile.TemporaryDirectory(prefix="sass_fp8_") as work:
        todo = cases()
        for i, c in enumerate(todo):
            cubin = Path(work) / f"case{i}.cubin"
            done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([c["types"], c["cx"], c["warps"],
                                                                              str(cubin)])],
                                  env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            for a in analyse(cubin, 32 * c["warps"], None):
                results.append(dict(case=c["label"], layer=c["layer"], path=c["path"], config=c["config"],
                                    in_flight_kb_per_sm_peak=in_flight_per_sm(a) / 1024, **a))
                print(f"[{i + 1}/{len(todo)}] " + summarize(f"{c['label']} {c['config']}", a), flush=True)
    write_record(args.out, "sass_fp8_gemv", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
