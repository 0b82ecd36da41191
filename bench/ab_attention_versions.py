"""A/B of two versions of the attention kernels in one process: README's prefill table (bf16 through
``attention()``'s defaults, and FP8 on operands each version prepares itself) and its decode table.

    python bench/ab_attention_versions.py --old filing_kernels --out ab.json [--seqlens 512,2048] [--deadline 200]

``--old`` names a package holding another version's ``attention.py`` and ``decode_attention.py`` (staged from git
with its ``quantkit.kernels`` imports renamed, e.g.
``git archive 304145d kernels | tar -x -C STAGE && mv STAGE/kernels STAGE/filing_kernels &&
sed -i 's/quantkit\\.kernels/filing_kernels/g' STAGE/filing_kernels/*.py`` and STAGE on PYTHONPATH); ``--new``
defaults to this checkout's ``quantkit.kernels``. Each cell is timed new, old, new (CUDA-graph replays, median), so
the two new timings give that cell's run-to-run spread beside the difference. Prints one line per cell, a summary of
the cells where old beats new by more than the spread, and writes JSON with card, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import json
import platform
import time

import torch
import triton

TOKENS = 16384
HEADS = [(16, 16, 128), (32, 8, 128), (16, 16, 64)]
SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
DECODE = [(1, 32768, 32, 8, 128), (8, 8192, 32, 8, 128), (64, 2048, 32, 8, 128), (16, 4096, 16, 16, 64)]


def replay_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def triple(fn_new, fn_old) -> dict:
    """new, old, new: the old version's time between two of the new one's."""
    a = replay_ms(fn_new)
    b = replay_ms(fn_old)
    c = replay_ms(fn_new)
    return {"new_ms": round(min(a, c), 5), "old_ms": round(b, 5), "spread": round(abs(a - c) / min(a, c), 4)}


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def prefill_cells(new, old, seqlens, deadline, t0):
    for hq, hkv, d in HEADS:
        for s in seqlens:
            if time.time() - t0 > deadline:
                return
            b = TOKENS // s
            q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
            packed = [x.reshape(-1, x.shape[2], d) for x in (q, k, v)]
            prep = {m: m.prepare_fp8(*packed, cu_seqlens_k=cu) for m in (new, old)}
            for causal in (False, True):
                flop = 4.0 * b * hq * s * s * d / (2 if causal else 1)
                for precision in ("bf16", "fp8"):
                    def call(m):
                        kw = {"fp8_prepared": prep[m]} if precision == "fp8" else {}
                        return lambda: m.attention(q, k, v, causal=causal, **kw)
                    row = {"table": "prefill", "hq": hq, "hkv": hkv, "head_dim": d, "seqlen": s, "causal": causal,
                           "precision": precision}
                    try:
                        row["err_new_vs_old"] = rel_err(call(new)(), call(old)())
                        row.update(triple(call(new), call(old)))
                        row["new_tflops"] = round(flop / row["new_ms"] / 1e9, 1)
                        row["old_tflops"] = round(flop / row["old_ms"] / 1e9, 1)
                    except Exception as e:  # a version that cannot run a cell is reported, not fatal
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    yield row
            del q, k, v, prep, packed


def decode_cells(new, old):
    for b, length, hq, hkv, d in DECODE:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        row = {"table": "decode", "batch": b, "cache_len": length, "hq": hq, "hkv": hkv, "head_dim": d}
        new_call, old_call = new.decode(q, kc, vc, lens), old.decode(q, kc, vc, lens)
        row["err_new_vs_old"] = rel_err(new_call().view(q.shape), old_call().view(q.shape))
        row.update(triple(new_call, old_call))
        row["new_kernel"], row["old_kernel"] = new.decode_kernel, old.decode_kernel
        row["new_kv_TBps"] = round(4 * b * length * hkv * d / row["new_ms"] / 1e9, 3)
        yield row


class Version:
    """One version's attention and decode entry points, from ``<package>.attention`` / ``.decode_attention``."""

    def __init__(self, package: str):
        mod = importlib.import_module(f"{package}.attention")
        dec = importlib.import_module(f"{package}.decode_attention")
        # prepare_fp8 lived in attention.py at the filing, in attention_fp8.py since
        self.name, self.attention = package, mod.attention
        self.prepare_fp8 = getattr(mod, "prepare_fp8", None) or importlib.import_module(
            f"{package}.attention_fp8").prepare_fp8
        # the general split-K kernel where a version has it (the filing's), else the runtime's fused kernel (since
        # session 19 the only one in kernels/) given RoPE as the identity and the last cached key/value as the new
        # token's: the same attention over the same cache
        self.decode_kernel = "decode_attention" if hasattr(dec, "decode_attention") else "decode_attention_rope"
        self._dec = dec

    def decode(self, q, k_cache, v_cache, lens):
        """A no-argument call of this version's decode attention: q (B, 1, Hq, D) over the full caches."""
        if self.decode_kernel == "decode_attention":
            return lambda: self._dec.decode_attention(q, k_cache, v_cache, lens)
        b, length, d = q.shape[0], k_cache.shape[1], q.shape[3]
        rows = torch.arange(b, device=q.device)
        qkv = torch.cat([q[:, 0].reshape(b, -1), k_cache[rows, length - 1].reshape(b, -1),
                         v_cache[rows, length - 1].reshape(b, -1)], 1)
        cos = torch.ones(length, d // 2, device=q.device)
        args = (qkv, cos, torch.zeros_like(cos), lens - 1, rows.int(), k_cache, v_cache, q.shape[2],
                torch.zeros(b * k_cache.shape[2], dtype=torch.int32, device=q.device))
        return lambda: self._dec.decode_attention_rope(*args)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="package of the other version, e.g. filing_kernels")
    ap.add_argument("--new", default="quantkit.kernels")
    ap.add_argument("--seqlens", default=None)
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds; later prefill cells skipped")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    new, old = Version(args.new), Version(args.old)
    seqlens = [int(x) for x in args.seqlens.split(",")] if args.seqlens else SEQLENS
    meta = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "new": args.new, "old": args.old, "tokens": TOKENS}
    rows, t0 = [], time.time()
    for row in itertools.chain(decode_cells(new, old), prefill_cells(new, old, seqlens, args.deadline, t0)):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # rewritten after every cell: a cut run keeps what it measured
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    slower = [r for r in rows if "new_ms" in r and r["new_ms"] > r["old_ms"] * (1 + max(r["spread"], 0.01))]
    print(f"{len(rows)} cells; new slower than old beyond the cell's spread (or 1 %) in {len(slower)}:")
    for r in slower:
        print("  ", {k: r[k] for k in r if k not in ("err_new_vs_old",)})


if __name__ == "__main__":
    main()
