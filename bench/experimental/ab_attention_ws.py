"""A/B of attention kernel variants on one GPU, at 16384 tokens, bf16 inputs (fp8: `prepare_fp8` once, outside
the timing): the ws kernel called directly (no dispatch, no host sync), `attention_varlen` (auto / triton, with
their host-side checks), and cuDNN through SDPA. Runs 8-9 (bench/NOTES_attention.md).

    AB_SHAPES=16/16/2048,16/16/2048/64 AB_VARS=new_bf16,new_fp8_nopp,cudnn python bench/ab_attention_ws.py

Shapes hq/hkv/seqlen[/head_dim]; AB_VARS from the names in `fns` below (NAME.again times NAME once more, for the
spread); also bf16:CFG and fp8:CFG, CFG the ws config tuple with '/' between entries (1/0 for booleans),
e.g. bf16:128/2/1/0 (ring 2, persistent, no ping-pong); bf16+lazy:L and fp8+lazy:L, the kernel's default config
for the shape with its lazy_rescale entry set to L (0 or 1; run 17). AB_REF32=1: each variant's error against a float32
reference (SDPA's efficient backend on the inputs in float32) as NAME_err_vs_fp32. AB_PROFILE=1: each variant runs twice and
is not timed (for `ncu -k regex:_attn_fwd_ws --launch-skip 1 -c 1`); AB_CAUSAL=0/1 runs one mode. AB_BASELINE=<dir> holding an older
copy of the ws kernel as ws_run7.py (runs 8-9: the kernels of commit 8c093a8, with attention_gluon.py as
gluon_run7.py) enables the old_* variants (old_default_fp8: that copy's default fp8 config). AB_PATCH=no_qscale
(diagnostic, wrong numbers): the ws kernel without its per-tile load of the fp8 Q scales. Writes $OUT/ab.json and prints a table last."""
import json
import os
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from quantkit.kernels import attention_gluon_ws as ws
from quantkit.kernels.attention import attention_varlen, prepare_fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import bench, rel_err  # noqa: E402  (the timing and error of the main bench)

if os.environ.get("AB_PATCH") == "no_qscale":
    # Diagnostic only (wrong numbers): the fp8 per-token Q scale is not loaded at a tile's start, which bounds
    # what hiding that load's latency could gain (run 19b: ~4 % at S = 2048 causal). Must run before the first
    # compile.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _row_state_no_qscale(qs_ptr, sm_scale, q_start, offs_m, seqlen_q, stride_qsm, head, HEAD_DIM: gl.constexpr,
                             BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, o_layout: gl.constexpr,
                             s_layout: gl.constexpr):
        rows: gl.constexpr = offs_m.shape[0]
        row_layout: gl.constexpr = offs_m.type.layout
        qk_scale = gl.full([rows], sm_scale * 1.4426950408889634, gl.float32, layout=row_layout)
        m_i = gl.full([rows], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([rows], gl.float32, layout=row_layout)
        acc = gl.zeros([rows, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([rows, BLOCK_N], gl.float32, layout=s_layout)
        return qk_scale, m_i, l_i, acc, s_zero

    ws._row_state = _row_state_no_qscale

ws_run7 = None
if os.environ.get("AB_BASELINE"):
    sys.path.insert(0, os.environ["AB_BASELINE"])
    import ws_run7  # noqa: F811

rows = []
shapes = [(16, 16, s, 128) for s in (2048, 4096, 8192, 16384)] + [(32, 8, s, 128) for s in (2048, 4096, 16384)]
only = os.environ.get("AB_SHAPES")
if only:
    shapes = [tuple(int(x) for x in t.split("/")) for t in only.split(",")]
shapes = [sh + (128,) * (len(sh) == 3) for sh in shapes]
VARS = os.environ.get("AB_VARS", "old_bf16,new_bf16,old_fp8_nopp,new_fp8,new_fp8_nopp,new_fp8_b2_nopp,triton_fp8,cudnn").split(",")
for hq, hkv, s, d in shapes:
    b = 16384 // s
    q = torch.randn(b * s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    prep = prepare_fp8(q, k, v, cu_seqlens_k=cu)
    for causal in (False, True):
        f = 4.0 * b * hq * s * s * d / (2 if causal else 1)
        cfg16 = (128, 3 if causal else 2) if d == 128 else (128, 4)
        fns = {
            "old_bf16": lambda: ws_run7.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, config=cfg16),
            "new_bf16": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, config=cfg16),
            "old_fp8_nopp": lambda: ws_run7.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, False)),
            "old_fp8": lambda: ws_run7.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, True)),
            "new_fp8": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, True)),
            "new_fp8_nopp": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, False)),
            "new_fp8_b2_nopp": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 2, True, False)),
            "new_fp8_b3": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 3, True, True)),
            "new_bf16_b2": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, config=(128, 2)),
            "new_bf16_b3": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, config=(128, 3)),
            "new_bf16_1tile": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, config=cfg16 + (False, True)),
            # runs 10-11: the TMA-store epilogue (ts) and the producer-staged K scale (ks) of the fp8 path
            "bf16_b2_ts": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, config=(128, 2, True, True, True)),
            "bf16_b4_ts": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, config=(128, 4, True, True, True)),
            "fp8_ts": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, False, True)),
            "fp8_ts_ks": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, False, True, True)),
            "fp8_ks": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, False, False, True)),
            "fp8_ts_ks_pp": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 4, True, True, True, True)),
            "default_bf16": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal),
            "old_default_fp8": lambda: ws_run7.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep),
            "default_fp8": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep),
            "fp8_ts_ks_b3": lambda: ws.attention_varlen_ws(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, config=(128, 3, True, False, True, True)),
            "auto_bf16": lambda: attention_varlen(q, k, v, cu, cu, s, causal=causal),
            "auto_fp8": lambda: attention_varlen(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep),
            "triton_fp8_def": lambda: attention_varlen(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, backend="triton"),
            "triton_fp8": lambda: attention_varlen(q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep, backend="triton", config=(64, 128, 4, 3)),
        }
        qt, kt, vt = (x.view(b, s, -1, d).transpose(1, 2).contiguous() for x in (q, k, v))
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv)
        fns["cudnn"] = cudnn
        for name in VARS:  # bf16:CFG / fp8:CFG, the ws kernel with an explicit config
            kind, _, cfg = name.split(".")[0].partition(":")
            if kind.endswith("+lazy"):  # the default config for this shape, lazy_rescale = cfg
                kind = kind[:-len("+lazy")]
                cfg = ws._default_config(d, kind == "fp8", s)[:7] + (int(cfg),)
            elif cfg:
                cfg = tuple(int(x) for x in cfg.split("/"))
            else:
                continue  # a named variant of `fns`
            prep_arg = prep if kind == "fp8" else None
            fns[name.split(".")[0]] = (lambda cfg=cfg, prep_arg=prep_arg: ws.attention_varlen_ws(
                q, k, v, cu, cu, s, causal=causal, fp8_prepared=prep_arg, config=cfg))
        row = {"hq": hq, "hkv": hkv, "d": d, "seqlen": s, "batch": b, "causal": causal}
        ref = ref32 = None
        if os.environ.get("AB_CAUSAL") and int(os.environ["AB_CAUSAL"]) != causal:
            continue
        if os.environ.get("AB_REF32") and not os.environ.get("AB_PROFILE"):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                ref32 = torch.nn.functional.scaled_dot_product_attention(
                    qt.float(), *(x.float().repeat_interleave(hq // hkv, 1) for x in (kt, vt)), is_causal=causal)
            ref32 = ref32.transpose(1, 2).reshape(b * s, hq, d)
        if os.environ.get("AB_PROFILE"):
            for name in VARS:
                fns[name.split(".")[0]]()
                fns[name.split(".")[0]]()
            torch.cuda.synchronize()
            continue
        for name in VARS:
            try:
                fn = fns[name.split(".")[0]]
                out = fn()
                if name == "cudnn":
                    out = out.transpose(1, 2).reshape(b * s, hq, d)
                if ref is None and name in ("new_bf16", "old_bf16", "auto_bf16", "default_bf16"):
                    ref = out
                row[name] = round(f / bench(fn) / 1e9, 1)
                if ref is not None:
                    row[name + "_err_vs_bf16"] = round(rel_err(out, ref), 4)
                if ref32 is not None:
                    row[name + "_err_vs_fp32"] = round(rel_err(out, ref32), 4)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
out = os.environ.get("OUT", ".")
json.dump({"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "vars": VARS, "rows": rows}, open(os.path.join(out, "ab.json"), "w"), indent=1)
print("\nhq/hkv seqlen c | " + " ".join(f"{v[:12]:>12s}" for v in VARS))
for r in rows:
    print(f"{r['hq']}/{r['hkv']} {r['seqlen']:6d} {int(r['causal'])} | " + " ".join(f"{r[v]:12.1f}" if isinstance(r[v], float) else f"{'err':>12s}" for v in VARS))
