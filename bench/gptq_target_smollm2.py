"""The command a user types, end to end on SmolLM2-135M: `quantkit gptq` with today's defaults, then the
README's perplexity protocol on the checkpoint it wrote (issue 21's target: <= 22.5).

    python bench/gptq_target_smollm2.py [--out DIR] [--keep] [--skip-quantize] [-- EXTRA GPTQ ARGS]

Runs, as subprocesses (what a user runs, nothing patched):

    quantkit gptq $GGUF -o DIR --calib $DATA/valid.tokens.txt --nsamples 128 --seqlen 512 --asym --group-size 64
    quantkit eval perplexity DIR --data $DATA/test.raw.txt --max-windows 40 --seqlen 2048 --dtype float32

then, to show what the dtype of the unquantized tensors (embeddings, tied lm_head, norms) is worth,
re-saves that same checkpoint with them in bfloat16 (`save_quantized(..., save_dtype="bfloat16")` on the
loaded checkpoint: packed tensors as they are; float16 -> bfloat16, which rounds as float32 -> bfloat16
would except on rare ties) and evaluates it the same way. Prints a table and writes
bench/results/gptq_target_smollm2_<date>.json with wall times and the load average around each step
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


def resave_bfloat16(folder: Path, out: Path) -> None:
    """The same checkpoint with its unquantized tensors in bfloat16 (packed tensors unchanged)."""
    import torch

    from quantkit.checkpoint import load_quantized, save_quantized
    from quantkit.config import QuantScheme

    model, tokenizer = load_quantized(folder, dtype=torch.float32)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantScheme(qc["bits"], qc["group_size"], qc["sym"])
    extra = {"resaved_from": str(folder), "static_groups": qc.get("static_groups", False),
             "calibration": qc.get("quantkit", {}).get("calibration")}
    save_quantized(model, {}, out, tokenizer=tokenizer, method="gptq", scheme=scheme, extra=extra,
                   overwrite=True, save_dtype="bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/quantkit-gptq-target"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--skip-quantize", action="store_true", help="evaluate an existing --out")
    parser.add_argument("--eval-seqlen", type=int, default=2048, help="protocol: 2048 (smaller: smoke tests)")
    parser.add_argument("--max-windows", type=int, default=40, help="protocol: 40")
    parser.add_argument("extra", nargs="*", help="more gptq options (after --; a repeated option wins)")
    args = parser.parse_args()
    gptq_args = ["gptq", GGUF, "-o", str(args.out), "--calib", f"{DATA}/valid.tokens.txt", "--nsamples", "128",
                 "--seqlen", "512", "--asym", "--group-size", "64", *args.extra]
    record: dict = {"what": "issue 21 target: the user's gptq command with the defaults, README perplexity protocol",
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "machine": f"{platform.machine()} {os.cpu_count()} CPUs (shared)",
                    "versions": _versions()}
    if not args.skip_quantize:
        shutil.rmtree(args.out, ignore_errors=True)
        out, seconds, load = run(gptq_args + ["--json"])
        report = json.loads(out)
        record["quantize"] = {"command": "quantkit " + " ".join(gptq_args), "wall_s": round(seconds, 1),
                              "load_1min": load, "options": report.get("options"),
                              "engine_kernels": report.get("engine_kernels")}
    config = json.loads((args.out / "config.json").read_text())
    record["checkpoint"] = {"dtype": config["dtype"], "desc_act": config["quantization_config"]["desc_act"],
                            "save_dtype": config["quantization_config"]["quantkit"].get("save_dtype")}
    record["perplexity"] = perplexity(args.out, args.eval_seqlen, args.max_windows)
    bf16 = args.out.with_name(args.out.name + "-bf16")
    resave_bfloat16(args.out, bf16)
    record["perplexity_bf16_resaved"] = perplexity(bf16, args.eval_seqlen, args.max_windows)
    if not args.keep:
        shutil.rmtree(bf16, ignore_errors=True)
        shutil.rmtree(args.out, ignore_errors=True)
    print(f"{'checkpoint':<34}{'perplexity':>11}{'eval s':>8}")
    print(f"{'as written (' + record['checkpoint']['dtype'] + ')':<34}{record['perplexity']['ppl']:>11.3f}"
          f"{record['perplexity']['wall_s']:>8.0f}")
    print(f"{'re-saved, bfloat16':<34}{record['perplexity_bf16_resaved']['ppl']:>11.3f}"
          f"{record['perplexity_bf16_resaved']['wall_s']:>8.0f}")
    if "quantize" in record:
        print(f"quantization {record['quantize']['wall_s']:.0f} s wall, load {record['quantize']['load_1min']}")
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    smoke = args.eval_seqlen != 2048 or args.max_windows != 40 or args.extra
    path = Path(__file__).parent / "results" / f"gptq_target_smollm2_{date}{'_custom' if smoke else ''}.json"
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
