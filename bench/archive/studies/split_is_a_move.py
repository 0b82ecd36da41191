"""Proof that splitting a kernel file into modules was a pure move (issue 38), on the CPU.

Two checks:

* ``source OLD_REV``: every top-level function and assignment of the old files (read from git at OLD_REV) appears
  with identical text, decorators included, in exactly one of the new modules; and every global name a function of
  a new module reads resolves in that module (a jit function's globals come from the module that defines it).
* ``sass DIR`` / ``sass DIR --compare OLD_DIR``: compile the Gluon kernels for sm_90 with Triton's ptxas (no GPU)
  at a set of configs and write their SASS to DIR; with --compare, diff against a DIR written at the old revision.
  Identical SASS means the GPU runs the same instructions.

    python bench/archive/studies/split_is_a_move.py source 1bfcc39
    git stash; python bench/archive/studies/split_is_a_move.py sass /tmp/sass_old; git stash pop   (or a checkout)
    python bench/archive/studies/split_is_a_move.py sass /tmp/sass_new --compare /tmp/sass_old
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# old file -> the modules its contents moved to
SPLITS = {
    "kernels/w4a16_gluon.py": ["w4a16_gluon", "w4a16_gluon_common", "w4a16_gluon_ring", "w4a16_gluon_direct"],
    "kernels/attention_gluon_ws.py": ["attention_gluon_ws", "attention_gluon_ws_tiles",
                                      "attention_gluon_ws_consumer"],
}


def _top_level(text: str) -> dict[str, str]:
    """name -> source text (decorators included) of each top-level def / class / assignment."""
    tree = ast.parse(text)
    lines = text.splitlines()
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [ast.unparse(t) for t in node.targets]
        elif isinstance(node, ast.AnnAssign):
            names = [ast.unparse(node.target)]
        else:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        body = "\n".join(lines[start - 1:node.end_lineno])
        for name in names:
            out[name] = body
    return out


def _unresolved_globals(mod) -> list[str]:
    """Names a function of ``mod`` reads that are neither its locals nor the module's globals nor builtins."""
    tree = ast.parse(Path(mod.__file__).read_text())
    missing = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        local = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local:
                if n.id not in vars(mod) and not hasattr(builtins, n.id):
                    missing.append(f"{mod.__name__}.{node.name}: {n.id}")
    return missing


def check_source(old_rev: str) -> bool:
    ok = True
    for old_path, modules in SPLITS.items():
        old = _top_level(subprocess.run(["git", "show", f"{old_rev}:{old_path}"], cwd=ROOT, check=True,
                                        capture_output=True, text=True).stdout)
        new: dict[str, list[tuple[str, str]]] = {}
        for m in modules:
            for name, text in _top_level((ROOT / "kernels" / f"{m}.py").read_text()).items():
                new.setdefault(name, []).append((m, text))
        same = 0
        for name, text in old.items():
            homes = [m for m, t in new.get(name, []) if t == text]
            if len(homes) == 1:
                same += 1
            else:
                ok = False
                print(f"  {old_path}: {name}: defined identically in {homes or 'no new module'}")
        extra = sorted(set(new) - set(old))
        print(f"{old_path}: {same} of {len(old)} top-level definitions moved with identical text into "
              f"{', '.join(modules)}; new top-level names: {extra or 'none'}")
        for m in modules:
            missing = _unresolved_globals(importlib.import_module(f"quantkit.kernels.{m}"))
            ok &= not missing
            for line in missing:
                print("  unresolved global:", line)
    print("source: PURE MOVE" if ok else "source: DIFFERENCES")
    return ok


# One fresh interpreter per compile (as tests/kernels/conftest.py): configs as the compile tests use them
_W4A16 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from quantkit.kernels.w4a16_gluon import GluonConfig, _w4a16_gluon_kernel, _w4a16_direct_kernel
kind, p, out = json.loads(sys.argv[1])
if kind == "ring":
    block_n, block_m, num_buf, num_warps, wgmma, group_size, x_box_k, has_zeros = p
    cfg = GluonConfig(block_n, block_m, num_buf, num_warps, WGMMA=wgmma, STREAM_K=not wgmma,
                      CTAS_PER_SM=1 if wgmma else 3, X_BOX_K=x_box_k)
    smem = ("NVMMASharedLayout(swizzle_byte_width={}, element_bitwidth={}, rank=2, transposed=False, "
            "fp4_padded=False, cga_layout=[])")
    sig = {"desc_w": f"tensordesc<i32[{block_n}, 16],{smem.format(64, 32)}>",
           "desc_x": f"tensordesc<bf16[{block_m}, {x_box_k}],{smem.format(2 * x_box_k, 16)}>",
           "scales_ptr": "*fp16", "zeros_ptr": "*u8", "xsum_ptr": "*fp32", "c_ptr": "*bf16", "ws_ptr": "*fp32",
           "tile_units_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles": "i32", "tiles_n": "i32", "tiles_m": "i32",
           "stride_sg": "i32", "stride_zg": "i32"}
    cx = dict(GROUP_SIZE=group_size, HAS_ZEROS=has_zeros, BLOCK_N=block_n, BLOCK_M=block_m, GROUP_N=8,
              NUM_BUF=num_buf, WGMMA=wgmma, ATOMIC_OUT=not wgmma, PERSISTENT=False, num_warps=num_warps)
    fn, attrs = _w4a16_gluon_kernel, {}
else:
    block_n, block_m, num_warps, ctas, group_size, has_zeros, gathered, unroll = p
    cfg = GluonConfig(block_n, block_m, 1, num_warps, ctas, DIRECT=True)
    sig = {"w_ptr": "*i32", "x_ptr": "*bf16", "scales_ptr": "*fp16", "zeros_ptr": "*u8", "xsum_ptr": "*fp32",
           "c_ptr": "*bf16", "ws_ptr": "*fp32", "counters_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles": "i32",
           "tiles_n": "i32", "stride_wn": "i32", "stride_xm": "i32", "stride_sg": "i32", "stride_zg": "i32"}
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + ["N", "stride_wn", "stride_xm", "stride_sg", "stride_zg"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    cx = dict(GROUP_SIZE=group_size, HAS_ZEROS=has_zeros, BLOCK_N=block_n, BLOCK_M=block_m, GATHERED=gathered,
              UNROLL=unroll, num_warps=num_warps)
    fn = _w4a16_direct_kernel
sig |= {name: "constexpr" for name in cx}
k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps, "maxnreg": cfg.maxnreg()})
open(out, "wb").write(k.asm["cubin"])
"""

_ATTN = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from quantkit.kernels import attention_gluon_ws as ws
from quantkit.kernels.attention_fp8 import prepare_fp8
from quantkit.kernels.attention_gluon_common import make_descriptors
fp8, causal, config, d, out_path = json.loads(sys.argv[1])
tokens, heads = 4 * 1024, 8
q = torch.randn(tokens, heads, d, dtype=torch.bfloat16)
k = torch.randn(tokens, heads, d, dtype=torch.bfloat16)
cu = torch.arange(0, tokens + 1, 1024, dtype=torch.int32)
out = torch.empty_like(q)
prep = prepare_fp8(q, k, k, cu_seqlens_k=cu) if fp8 else None
block_n, num_buf, persistent, pingpong, tma_store, stage_ks, rowsum_mma, lazy = ws._full_config(config, d, fp8, 1024)
desc_q, desc_k, desc_v, qs, ks, vs = make_descriptors(q, k, k, ws._HALF_M, block_n, prep, out)
desc_o = ws._output_descriptor(out) if tma_store else desc_q
args = dict(desc_q=desc_q, desc_k=desc_k, desc_v=desc_v, desc_o=desc_o, o_ptr=out, qs_ptr=qs, ks_ptr=ks,
            v_scale_ptr=vs, cu_seqlens_q_ptr=cu, cu_seqlens_k_ptr=cu, sm_scale=0.1, stride_om=heads * d,
            stride_oh=d, stride_qsm=heads, stride_ksn=heads, NUM_M_BLOCKS=8, N_SEQ=4, N_WORK=256, SWIZZLE=1)
cx = dict(GROUP=2, HEAD_DIM=d, BLOCK_N=block_n, IS_CAUSAL=causal, IS_FP8=fp8, NUM_BUF=num_buf, PINGPONG=pingpong,
          TMA_STORE=tma_store, STAGE_KS=stage_ks and fp8, ROWSUM_MMA=rowsum_mma and fp8, LAZY_RESCALE=lazy,
          CONSUMER_REGS=ws.CONSUMER_REGS)
sig, attrs = {}, {}
for i, name in enumerate(ws._attn_fwd_ws.arg_names):
    if name in cx:
        sig[name] = "constexpr"
        continue
    a = args[name]
    sig[name] = mangle_type(a)
    if isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0):
        attrs[(i,)] = [["tt.divisibility", 16]]
kern = triton.compile(GluonASTSource(fn=ws._attn_fwd_ws, signature=sig, constexprs=cx, attrs=attrs),
                      target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": ws.MAXNREG})
open(out_path, "wb").write(kern.asm["cubin"])
"""

CASES = {
    # ring: block_n, block_m, num_buf, num_warps, wgmma, group_size, x_box_k, has_zeros
    "ring_prefill_g128": (_W4A16, ["ring", [128, 128, 5, 8, True, 128, 32, False]]),
    "ring_prefill_g32_asym": (_W4A16, ["ring", [128, 64, 4, 8, True, 32, 64, True]]),
    "ring_decode_g128_box64": (_W4A16, ["ring", [128, 16, 6, 4, False, 128, 64, False]]),
    "ring_decode_g32_asym": (_W4A16, ["ring", [128, 16, 6, 4, False, 32, 32, True]]),
    # direct: block_n, block_m, num_warps, ctas, group_size, has_zeros, gathered, unroll
    "direct_raw_sym_u1": (_W4A16, ["direct", [128, 16, 4, 3, 128, False, False, 1]]),
    "direct_gathered_asym_u2": (_W4A16, ["direct", [128, 8, 4, 4, 128, True, True, 2]]),
    # attention: fp8, causal, config (None: default), head dim
    "attn_fp8_causal_default_d128": (_ATTN, [True, True, None, 128]),
    "attn_bf16_causal_default_d128": (_ATTN, [False, True, None, 128]),
    "attn_bf16_plain_d64_no_tma_store": (_ATTN, [False, False, [128, 4, True, True, False], 64]),
    "attn_fp8_d64_rowsum_off": (_ATTN, [True, False, [128, 4, True, False, False, True, False, False], 64]),
}


def compile_sass(out_dir: Path) -> None:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for i, (name, (script, args)) in enumerate(CASES.items()):
        cubin = out_dir / f"{name}.cubin"
        done = subprocess.run([sys.executable, "-c", script, json.dumps(args[:] + [str(cubin)])], env=env,
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            sys.exit(f"{name}: compile failed\n{done.stderr[-3000:]}")
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
        (out_dir / f"{name}.sass").write_text(sass)
        print(f"[{i + 1}/{len(CASES)}] {name}: {sum('/*' in line for line in sass.splitlines())} SASS lines")


def compare(new_dir: Path, old_dir: Path) -> bool:
    ok = True
    for name in CASES:
        a, b = (d / f"{name}.sass" for d in (old_dir, new_dir))
        same = a.read_text() == b.read_text()
        ok &= same
        print(f"  {name}: {'identical SASS' if same else 'SASS DIFFERS'}")
    print("sass: IDENTICAL" if ok else "sass: DIFFERENCES")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("source", help="compare top-level definitions with the old revision's files")
    s.add_argument("old_rev")
    c = sub.add_parser("sass", help="compile the kernels for sm_90 and write their SASS")
    c.add_argument("out_dir", type=Path)
    c.add_argument("--compare", type=Path, help="a directory written at the old revision")
    a = ap.parse_args()
    if a.cmd == "source":
        sys.exit(0 if check_source(a.old_rev) else 1)
    compile_sass(a.out_dir)
    if a.compare:
        sys.exit(0 if compare(a.out_dir, a.compare) else 1)


if __name__ == "__main__":
    main()
