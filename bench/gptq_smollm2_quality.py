"""SmolLM2-135M quality table for GPTQ (quantkit) vs RTN, protocol of ../shared/MODELS.md.

Usage: python bench/gptq_smollm2_quality.py ROW [ROW ...]   (rows named below, e.g. fp rtn_asym_g64
gptq_asym_g64_act1 gptq_asym_g64_act1_mse; results appended to $QK_OUT, default gptq_quality.jsonl)

The model is the GGUF the tests fetch (tests/conftest.py: smollm2_gguf) under $QUANTKIT_CACHE or
~/.cache/quantkit; the text comes from ../shared/data/wikitext2 beside the checkout.
"""
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
from quantkit.methods.gptq import GPTQConfig
from quantkit.methods.gptq_method import GPTQMethod
from quantkit.methods.rtn import RTNMethod

logging.basicConfig(level=logging.WARNING)
OUT = os.environ.get("QK_OUT", "gptq_quality.jsonl")
NWIN = int(os.environ.get("QK_NWIN", "40"))

def rows():
    r = {"fp": None}
    for g in (64, 128):
        for sym in (True, False):
            s = "sym" if sym else "asym"
            r[f"rtn_{s}_g{g}"] = ("rtn", QuantScheme(4, g, sym), None)
            for act in (False, True):
                r[f"gptq_{s}_g{g}_act{int(act)}"] = ("gptq", QuantScheme(4, g, sym), GPTQConfig(desc_act=act))
                r[f"gptq_{s}_g{g}_act{int(act)}_static"] = ("gptq", QuantScheme(4, g, sym), GPTQConfig(desc_act=act, static_groups=True))
                r[f"gptq_{s}_g{g}_act{int(act)}_mse"] = ("gptq", QuantScheme(4, g, sym), GPTQConfig(desc_act=act, mse=True))
                r[f"gptq_{s}_g{g}_act{int(act)}_static_mse"] = ("gptq", QuantScheme(4, g, sym), GPTQConfig(desc_act=act, static_groups=True, mse=True))
                r[f"gptq_{s}_g{g}_act{int(act)}_nots"] = ("gptq", QuantScheme(4, g, sym), GPTQConfig(desc_act=act, true_sequential=False))
                r[f"gptq_{s}_g{g}_act{int(act)}_multipass"] = ("gptq", QuantScheme(4, g, sym), GPTQConfig(desc_act=act, single_pass_max_tokens=0))
    return r

def main(names):
    torch.manual_seed(0)
    if os.environ.get("QK_THREADS"):
        torch.set_num_threads(int(os.environ["QK_THREADS"]))
    model, tok, fp_state, test_ids, calib = load_protocol()
    table = rows()
    for name in names:
        model.load_state_dict(fp_state)
        rec = {"row": name, "pid": os.getpid(), "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()[0]}
        if name != "fp":
            kind, scheme, cfg = table[name]
            method = RTNMethod(scheme) if kind == "rtn" else GPTQMethod(scheme, cfg)
            t0 = time.perf_counter()
            c0 = time.process_time()
            t_start = time.perf_counter()
            def progress(ev):
                print(f"  {name} layer {ev.index + 1}/{ev.n_layers} {ev.seconds:.1f}s elapsed {time.perf_counter() - t_start:.0f}s", file=sys.stderr, flush=True)
            res = walk(model, method, device="cpu", token_ids=calib if kind == "gptq" else None, batch_size=16,
                       on_layer=progress)
            rec["quant_seconds"] = time.perf_counter() - t0
            rec["quant_cpu_seconds"] = time.process_time() - c0
            rec.update(bits=scheme.bits, group_size=scheme.group_size, sym=scheme.sym, method=kind,
                       config=None if cfg is None else cfg.__dict__)
            if kind == "gptq":
                lin = [s for L in res.layer_stats for s in L["linears"].values()]
                rec["mean_err_rtn"] = sum(s["err_rtn"] for s in lin) / len(lin)
                rec["mean_err_gptq"] = sum(s["err_gptq"] for s in lin) / len(lin)
                rec["solve_seconds"] = sum(s["seconds"] for s in lin)
                rec["hessian_seconds"] = sum(s["hessian_seconds"] for s in lin)
                rec["max_damp"] = max(s["damp"] for s in lin)
                with open(f"stats_{name}.json", "w") as f:
                    json.dump(res.layer_stats, f)
        t0 = time.perf_counter()
        rec["ppl"] = ppl(model, test_ids, nwin=NWIN)
        rec["ppl_seconds"] = time.perf_counter() - t0
        rec["loadavg_end"] = os.getloadavg()[0]
        rec["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
        rec["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
        print(json.dumps(rec), flush=True)
        with open(OUT, "a") as f:
            f.write(json.dumps(rec) + "\n")

def _args(argv):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", metavar="ROW", choices=sorted(rows()),
                    help="rows to run, e.g. fp rtn_asym_g64 gptq_asym_g64_act1_mse (one of: %(choices)s)")
    return ap.parse_args(argv).rows


if __name__ == "__main__":
    main(_args(sys.argv[1:]))
