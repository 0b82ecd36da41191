"""SmolLM2-135M quality table for AWQ (quantkit) vs RTN, protocol of ../shared/MODELS.md.

Usage: python bench/awq_smollm2_quality.py ROW [ROW ...]   (rows below; JSON lines appended to $QK_OUT)
       python bench/awq_smollm2_quality.py --table   (collect $QK_OUT into bench/results/awq_smollm2_quality.json)
Env: QK_THREADS (torch threads, default 1: 2 threads under the shared load were 5x slower on small
ops), QK_LAYERS (probe: keep only the first N decoder layers, no perplexity).
"""
import dataclasses
import json
import logging
import os
import platform
import sys
import time

import torch
import transformers
from smollm2_protocol import load_protocol, ppl  # bench/, beside this script

from quantkit.calibrate.walker import walk
from quantkit.config import QuantScheme
from quantkit.methods.awq import AWQConfig
from quantkit.methods.awq_method import AWQMethod
from quantkit.methods.rtn import RTNMethod

logging.basicConfig(level=logging.WARNING)
DEVICE = os.environ.get("QK_DEVICE", "cpu")  # the walker's work device and the evaluation's
RECORDS = os.environ.get("QK_RECORDS", ".")
OUT = os.environ.get("QK_OUT", "awq_quality.jsonl")
NWIN = int(os.environ.get("QK_NWIN", "40"))
LAYERS = int(os.environ.get("QK_LAYERS", "0"))
torch.set_num_threads(int(os.environ.get("QK_THREADS", "1")))


def rows():
    r = {"fp": None}
    for g in (64, 128):
        s = QuantScheme(4, g, False)
        r[f"rtn_asym_g{g}"] = ("rtn", s, None)
        r[f"awq_asym_g{g}"] = ("awq", s, AWQConfig())
        r[f"awq_asym_g{g}_noclip"] = ("awq", s, AWQConfig(clip=False))
        r[f"awq_asym_g{g}_gptq"] = ("awq", s, AWQConfig(gptq=True))
        r[f"awq_asym_g{g}_gptq_q"] = ("awq", s, AWQConfig(gptq=True, propagate="quantized"))
        r[f"awq_asym_g{g}_q"] = ("awq", s, AWQConfig(propagate="quantized"))
        r[f"awq_asym_g{g}_noduo"] = ("awq", s, AWQConfig(duo_scaling=False))
        r[f"awq_asym_g{g}_s32"] = ("awq", s, AWQConfig(search_samples=32))
        r[f"awq_asym_g{g}_s8"] = ("awq", s, AWQConfig(search_samples=8))
        # the scale search of every block on the 8 whole windows (before search_tokens, session 16)
        r[f"awq_asym_g{g}_windows"] = ("awq", s, AWQConfig(search_tokens=0))
        r[f"awq_asym_g{g}_qkclip"] = ("awq", s, AWQConfig(clip_skip_qk=False))
        r[f"awq_asym_g{g}_tied"] = ("awq", s, AWQConfig(gqa_tied_vo=True))
        r[f"awq_asym_g{g}_tied_gptq"] = ("awq", s, AWQConfig(gqa_tied_vo=True, gptq=True))
        r[f"awq_asym_g{g}_tied_s8"] = ("awq", s, AWQConfig(gqa_tied_vo=True, search_samples=8))
        r[f"awq_asym_g{g}_tied_s8_gptq"] = ("awq", s, AWQConfig(gqa_tied_vo=True, search_samples=8, gptq=True))
    return r


# Variants evaluated from a saved search (propagate="fp": every group's scale is searched on the
# full-precision layer, independently of clipping and of the other groups, so re-applying a subset of
# the saved scales and rounding with RTN is exactly AWQ without clip, with or without the v -> o scale).
REUSE = {"noclip": lambda g: True, "noclip_untied": lambda g: g.tie is None}


def reapply(model, records, keep, scheme):
    from quantkit.methods.awq import LayerRecord
    from quantkit.methods.awq_method import apply_layer_record

    for prefix, rec in records.items():
        layer = model.get_submodule(prefix)
        apply_layer_record(layer, LayerRecord(tuple(g for g in rec.scales if keep(g))), norm_offset=0.0)
    return walk(model, RTNMethod(scheme), device=DEVICE)


def summarize(res):
    lin = [s for L in res.layer_stats for s in L["linears"].values()]
    out = {}
    for key in ("alpha", "scale_err_rtn", "scale_err_awq", "weight_error", "err_rtn", "err_gptq"):
        vals = [s[key] for s in lin if key in s]
        if vals:
            out[f"mean_{key}"] = sum(vals) / len(vals)
    b = sum(s.get("clip_err_before", 0) for s in lin); a = sum(s.get("clip_err_after", 0) for s in lin)
    if b:
        out["clip_err_ratio"] = a / b
    out["alphas"] = {L["prefix"]: {k: s.get("alpha") for k, s in L["linears"].items()} for L in res.layer_stats[:3]}
    out["notes_layer0"] = res.layer_stats[0]["notes"]
    return out


def main(names):
    torch.manual_seed(0)
    model, tok, fp_state, test_ids, calib = load_protocol(LAYERS)
    table = rows()
    for name in names:
        model.load_state_dict(fp_state)
        rec = {"row": name, "device": DEVICE if DEVICE == "cpu" else torch.cuda.get_device_name(),
               "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()[0]}
        if "+" in name:  # BASE+VARIANT: re-apply BASE's saved search
            base, variant = name.split("+")
            scheme = table[base][1]
            t0 = time.perf_counter()
            reapply(model, torch.load(f"{RECORDS}/awq_records_{base}.pt", weights_only=False), REUSE[variant],
                    scheme)
            rec["quant_seconds"] = time.perf_counter() - t0
            rec.update(bits=scheme.bits, group_size=scheme.group_size, sym=scheme.sym, method="awq-reapplied")
        elif name != "fp":
            kind, scheme, cfg = table[name]
            method = RTNMethod(scheme) if kind == "rtn" else AWQMethod(scheme, cfg)
            t0 = time.perf_counter()
            res = walk(model, method, device=DEVICE, token_ids=calib if kind == "awq" else None, batch_size=16)
            rec["quant_seconds"] = time.perf_counter() - t0
            rec.update(bits=scheme.bits, group_size=scheme.group_size, sym=scheme.sym, method=kind,
                       config=None if cfg is None else dataclasses.asdict(cfg))
            rec.update(summarize(res))
            if kind == "awq":
                torch.save(method.records, f"{RECORDS}/awq_records_{name}.pt")
        if not LAYERS:
            t0 = time.perf_counter()
            model.to(DEVICE)
            rec["ppl"] = ppl(model, test_ids, nwin=NWIN)
            model.to("cpu")
            rec["ppl_seconds"] = time.perf_counter() - t0
        rec["loadavg_end"] = os.getloadavg()[0]
        rec["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
        rec["command"] = f"python bench/awq_smollm2_quality.py {name}"
        rec["eval_threads"] = torch.get_num_threads()
        rec["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version()}
        print(json.dumps(rec), flush=True)
        with open(OUT, "a") as f:
            f.write(json.dumps(rec) + "\n")


def table(path="bench/results/awq_smollm2_quality.json"):
    """The last measurement of every row, with the peers' numbers from ../shared/MODELS.md."""
    latest = {}
    with open(OUT) as f:
        for line in f:
            rec = json.loads(line)
            latest[rec["row"]] = rec
    result = {
        "what": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, fp32): WikiText-2 test perplexity, seqlen 2048, "
                "first 40 windows, no BOS; calibration 128 x 512 tokens at random offsets (seed 0) of valid.tokens.txt",
        "machine": "CPU 2 cores (shared with other jobs: load average 7-12 during these runs, so wall times are "
                   "3-5x what an idle machine gives; each run used 1 torch thread)",
        "date": time.strftime("%Y-%m-%d"),
        "summary": {r: {"ppl": rec.get("ppl"), "quant_seconds": rec.get("quant_seconds"),
                        "ppl_seconds": rec.get("ppl_seconds"), "command": rec.get("command")}
                    for r, rec in latest.items()},
        "rows": list(latest.values()),
        "peers_from_MODELS_md": {"unquantized": 19.86, "rtn_asym_g64": 26.39, "rtn_asym_g128": 27.44,
                                 "llmcompressor_gptq_asym_g64_static_act_order": 23.15,
                                 "llmcompressor_awq_asym_g64": "not measured (about an hour on this CPU)"},
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _args(argv):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", action="store_true", help="collect $QK_OUT into the results table instead of running")
    ap.add_argument("rows", nargs="*", metavar="ROW", help=f"rows to run (one of: {', '.join(sorted(rows()))})")
    args = ap.parse_args(argv)
    unknown = [r for r in args.rows if r not in rows()]
    if unknown or (not args.rows and not args.table):
        ap.error(f"unknown rows {unknown}" if unknown else "name at least one ROW, or --table")
    return args


if __name__ == "__main__":
    _a = _args(sys.argv[1:])
    if _a.table:
        table()
    else:
        main(_a.rows)
