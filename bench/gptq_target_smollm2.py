"""The command a user types, end to end on SmolLM2-135M: `quantkit gptq` with today's defaults, then the
README's perplexity protocol on the checkpoint it wrote (issue 21's target: <= 22.5).

    python bench/gptq_target_smollm2.py [--out DIR] [--keep] [--skip-quantize] [-- EXTRA GPTQ ARGS]

Runs, as subprocesses (what a user runs, nothing patched):

    quantkit gptq $GGUF -o DIR --calib $DATA/valid.tokens.txt --nsamples 128 --seqlen 512 --asym --group-size 64
    quantkit eval perplexity DIR --data $DATA/test.raw.txt --max-windows 40 --seqlen 2048 --dtype float32

With --dtype-ablation it instead quantizes once in this process through `quantkit.api.quantize` (the
CLI's path and defaults) and writes that one result twice, with the unquantized tensors (embeddings,
tied lm_head, norms) in bfloat16 (what quantkit writes for a float32 model) and in float16, by wrapping
`quantkit.checkpoint.save_quantized` here (a measurement device, not a library option); both are then
evaluated with the same protocol. Prints a table and writes
bench/runs/gptq_target_smollm2_<date>.json with wall times and the load average around each step
(the machine is shared). $QK_GGUF / $QK_DATA override the model and the text (bench/smollm2_protocol.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_protocol import DATA, GGUF  # noqa: E402

QUANTKIT = [sys.executable, "-m", "quantkit.cli.app"]


def run(args: list[str]) -> tuple[str, float, list[float]]:
    """stdout of ``quantkit args`` (stderr passes through), its wall seconds and the 1-minute load
    average before and after."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(QUANTKIT + args, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"quantkit {' '.join(args)} exited {proc.returncode}")
    return proc.stdout, seconds, [load0, os.getloadavg()[0]]


def perplexity(folder: Path, seqlen: int = 2048, windows: int = 40) -> dict:
    args = ["eval", "perplexity", str(folder), "--data", f"{DATA}/test.raw.txt", "--max-windows", str(windows),
            "--seqlen", str(seqlen), "--dtype", "float32", "--json"]
    out, seconds, load = run(args)
    result = json.loads(out)
    return {"command": "quantkit " + " ".join(args[:-1]), "ppl": result["ppl"], "windows": result["windows"],
            "wall_s": round(seconds, 1), "load_1min": load}


def quantize_both_dtypes(out: Path, extra_args: list[str], nsamples: int, seqlen: int) -> dict:
    """One quantization with the CLI's defaults, written as ``out`` (bfloat16) and ``out``-fp16."""
    import quantkit.checkpoint.save as checkpoint
    from quantkit import api
    from quantkit.config import CalibConfig, QuantScheme

    if extra_args:
        sys.exit("--dtype-ablation runs the defaults only; drop the extra gptq options")
    save = checkpoint.save_quantized

    def save_both(model, weights, output, **kwargs):
        kwargs.pop("save_dtype", None)
        save(model, weights, output, save_dtype="bfloat16", **kwargs)
        return save(model, weights, f"{output}-fp16", save_dtype="float16", **kwargs)

    for folder in (out, Path(f"{out}-fp16")):
        shutil.rmtree(folder, ignore_errors=True)
    checkpoint.save_quantized = save_both
    try:
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        report = api.quantize(GGUF, out, method="gptq", scheme=QuantScheme(4, 64, False),
                              calib=CalibConfig(source=f"{DATA}/valid.tokens.txt", nsamples=nsamples, seqlen=seqlen))
    finally:
        checkpoint.save_quantized = save
    return {"command": (f"api.quantize(GGUF, method='gptq', scheme=QuantScheme(4, 64, False), calib {nsamples} x "
                        f"{seqlen} valid.tokens.txt), saved bfloat16 and float16"), "wall_s": round(time.perf_counter() - t0, 1),
            "load_1min": [load0, os.getloadavg()[0]], "options": report.options}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/quantkit-gptq-target"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--skip-quantize", action="store_true", help="evaluate an existing --out")
    parser.add_argument("--dtype-ablation", action="store_true",
                        help="one quantization written with bfloat16 and with float16 unquantized tensors")
    parser.add_argument("--nsamples", type=int, default=128, help="protocol: 128")
    parser.add_argument("--seqlen", type=int, default=512, help="calibration tokens per window; protocol: 512")
    parser.add_argument("--eval-seqlen", type=int, default=2048, help="protocol: 2048 (smaller: smoke tests)")
    parser.add_argument("--max-windows", type=int, default=40, help="protocol: 40")
    parser.add_argument("extra", nargs="*", help="more gptq options (after --; a repeated option wins)")
    args = parser.parse_args()
    gptq_args = ["gptq", GGUF, "-o", str(args.out), "--calib", f"{DATA}/valid.tokens.txt", "--nsamples", str(args.nsamples),
                 "--seqlen", str(args.seqlen), "--asym", "--group-size", "64", *args.extra]
    record: dict = {"what": "issue 21 target: the user's gptq command with the defaults, README perplexity protocol",
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "machine": f"{platform.machine()} {os.cpu_count()} CPUs (shared)",
                    "versions": _versions()}
    if args.dtype_ablation:
        record["quantize"] = quantize_both_dtypes(args.out, args.extra, args.nsamples, args.seqlen)
        rows = {"bfloat16": args.out, "float16": Path(f"{args.out}-fp16")}
    else:
        if not args.skip_quantize:
            shutil.rmtree(args.out, ignore_errors=True)
            out, seconds, load = run(gptq_args + ["--json"])
            report = json.loads(out)
            record["quantize"] = {"command": "quantkit " + " ".join(gptq_args), "wall_s": round(seconds, 1),
                                  "load_1min": load, "options": report.get("options"),
                                  "engine_kernels": report.get("engine_kernels")}
        rows = {"as written": args.out}
    record["perplexity"] = {}
    print(f"{'checkpoint':<34}{'perplexity':>11}{'eval s':>8}")
    for label, folder in rows.items():
        config = json.loads((folder / "config.json").read_text())
        result = perplexity(folder, args.eval_seqlen, args.max_windows)
        result["checkpoint"] = {"dtype": config["dtype"], "desc_act": config["quantization_config"]["desc_act"]}
        record["perplexity"][label] = result
        print(f"{label + ' (' + config['dtype'] + ')':<34}{result['ppl']:>11.3f}{result['wall_s']:>8.0f}")
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    if "quantize" in record:
        print(f"quantization {record['quantize']['wall_s']:.0f} s wall, load {record['quantize']['load_1min']}")
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    smoke = (args.eval_seqlen, args.max_windows, args.nsamples, args.seqlen) != (2048, 40, 128, 512) or args.extra
    name = "gptq_target_smollm2_dtype" if args.dtype_ablation else "gptq_target_smollm2"
    path = Path(__file__).parent / "runs" / f"{name}_{date}{'_custom' if smoke else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def _versions() -> dict:
    import torch
    import transformers

    import quantkit

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "quantkit": getattr(quantkit, "__version__", "?")}


if __name__ == "__main__":
    main()
