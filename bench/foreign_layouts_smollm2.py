"""Do other tools' checkpoint layouts of one quantized SmolLM2 evaluate to the same perplexity?

Question (issue 27): a folder whose settings live only in ``quantize_config.json`` (AutoGPTQ), a
GPTQModel folder spelling ``format``/``method`` (v1) or storing v2 zero points, and an AutoAWQ GEMM
folder must read as the same model as the quantkit checkpoint they were made from. The script
quantizes SmolLM2-135M with RTN (W4 asymmetric g64, a scheme every one of these layouts holds),
re-writes that checkpoint in each layout by the producers' conventions, and runs ``quantkit eval
perplexity``'s code path (``quantkit.api.evaluate_perplexity``) on each, fp32 on the CPU, the first
``--windows`` windows of 2048 tokens of WikiText-2 test. Equal perplexities (to float rounding) mean
every layout is read as the same weights. Prints a table and writes JSON under bench/runs/.

    python bench/foreign_layouts_smollm2.py --windows 4
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

GPTQ_SETTINGS = {"bits": 4, "group_size": 64, "desc_act": False, "sym": False, "true_sequential": True}


def set_settings(folder: Path, quantization_config: dict | None, files: dict[str, dict]) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2))


def rewrite_zeros_v2(folder: Path, bits: int) -> None:
    """GPTQModel v2: every qzeros holds the zero points themselves instead of zero - 1."""
    from quantkit.pack import pack_rows, unpack_rows

    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        for key in [k for k in tensors if k.endswith(".qzeros")]:
            out_features = tensors[key.replace(".qzeros", ".scales")].shape[1]
            stored = unpack_rows(tensors[key].t().contiguous(), bits, out_features)  # [out, G], zero - 1
            tensors[key] = pack_rows(stored + 1, bits).t().contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})


def make_layouts(original: Path, work: Path) -> dict[str, Path]:
    from quantkit.checkpoint.save import load_quantized, save_quantized
    from quantkit.config import QuantScheme

    folders = {"quantkit-gptq-v1": original}
    autogptq = work / "autogptq-quantize-config-only"
    shutil.copytree(original, autogptq)
    set_settings(autogptq, None, {"quantize_config.json": {**GPTQ_SETTINGS, "quant_method": "gptq",
                                                           "checkpoint_format": "gptq"}})
    folders[autogptq.name] = autogptq
    v1 = work / "gptqmodel-v1-format-method"
    shutil.copytree(original, v1)
    set_settings(v1, {**GPTQ_SETTINGS, "method": "gptq", "format": "gptq", "pack_dtype": "int32"}, {})
    folders[v1.name] = v1
    v2 = work / "gptqmodel-v2"
    shutil.copytree(original, v2)
    v2_settings = {**GPTQ_SETTINGS, "method": "gptq", "format": "gptq_v2", "pack_dtype": "int32"}
    set_settings(v2, v2_settings, {"quantize_config.json": v2_settings})
    rewrite_zeros_v2(v2, 4)
    folders[v2.name] = v2
    model, tokenizer = load_quantized(original)
    awq = save_quantized(model, {}, work / "autoawq-gemm", tokenizer=tokenizer, method="rtn",
                         scheme=QuantScheme(4, 64, False), layout="awq")
    folders[awq.name] = awq
    return folders


def main() -> None:
    from smollm2_protocol import DATA, GGUF

    from quantkit import api
    from quantkit.config import LoadConfig, QuantScheme

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    load = LoadConfig(dtype="float32", device="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        api.quantize(GGUF, work / "quantkit-gptq-v1", method="rtn", scheme=QuantScheme(4, 64, False), load=load)
        for name, folder in make_layouts(work / "quantkit-gptq-v1", work).items():
            t0 = time.perf_counter()
            result = api.evaluate_perplexity(str(folder), data=f"{DATA}/test.raw.txt", seqlen=2048,
                                             max_windows=args.windows, load=load)
            info = api.inspect(folder)
            rows.append({"layout": name, "read_as": info.layout, "settings_from": info.settings_source.split("(")[-1]
                         .rstrip(")"), "ppl": result.ppl, "windows": result.n_windows,
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(f"{name:36s} {info.layout:9s} ppl {result.ppl:.6f}", flush=True)
    reference = rows[0]["ppl"]
    print(f"\n{'layout':36s} {'read as':9s} {'perplexity':>12s} {'rel. diff':>10s}")
    for row in rows:
        row["rel_diff_vs_quantkit"] = abs(row["ppl"] - reference) / reference
        print(f"{row['layout']:36s} {row['read_as']:9s} {row['ppl']:12.6f} {row['rel_diff_vs_quantkit']:10.2e}")
    out = args.json or REPO / "bench" / "runs" / f"foreign_layouts_smollm2_{datetime.now(timezone.utc):%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "question": "same perplexity for one SmolLM2 RTN W4 asym g64 checkpoint in every layout quantkit reads",
        "model": Path(GGUF).name, "protocol": f"WikiText-2 test.raw.txt, first {args.windows} windows of 2048, "
        "fp32, CPU", "rows": rows, "card": platform.processor() or platform.machine(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
