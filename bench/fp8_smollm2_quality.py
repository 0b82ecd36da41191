"""SmolLM2-135M through ``quantkit fp8``: perplexity against the unquantized model and the KL divergence, on
../shared/MODELS.md's protocol (bench/smollm2_protocol.py), in one pass over the windows.

The FP8 model is the written checkpoint read back (``quantize_fp8`` then ``load_any``: the compressed-tensors
files, FP8Linear's float32 emulation of per-token e4m3 activations); the baseline is the fp32 GGUF model.
Per window both models run; perplexity of each and KL(base || fp8) per token (mean, and the 99th percentile)
are accumulated.

Usage: OMP_NUM_THREADS=1 python bench/fp8_smollm2_quality.py [--windows 40] [--weights channel] [--out FILE]
"""
import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from smollm2_protocol import DATA, GGUF, tokens_of_txt  # bench/, beside this script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--weights", default="channel")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fp8_smollm2_quality.json"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("QK_THREADS", "1")))

    from quantkit.api import load_any
    from quantkit.config import LoadConfig
    from quantkit.fp8_api import quantize_fp8
    from quantkit.methods.fp8 import FP8Config
    from quantkit.models.load import load_model

    started = time.time()
    base = load_model(GGUF, LoadConfig(dtype="float32", device="cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        report = quantize_fp8(GGUF, os.path.join(tmp, "fp8"), config=FP8Config(weights=args.weights),
                              load=LoadConfig(dtype="float32", device="cpu"))
        size = sum(os.path.getsize(os.path.join(tmp, "fp8", f)) for f in os.listdir(os.path.join(tmp, "fp8"))
                   if f.endswith(".safetensors"))
        fp8, _ = load_any(os.path.join(tmp, "fp8"), LoadConfig(dtype="float32", device="cpu"))
    ids = tokens_of_txt(base.tokenizer, f"{DATA}/test.raw.txt")
    n = min(args.windows, ids.numel() // args.seqlen)
    nll = {"base": 0.0, "fp8": 0.0}
    kl_tokens = []
    with torch.inference_mode():
        for w in range(n):
            x = ids[w * args.seqlen:(w + 1) * args.seqlen][None]
            lb = base.model(input_ids=x, use_cache=False).logits[0, :-1].float()
            lq = fp8(input_ids=x, use_cache=False).logits[0, :-1].float()
            nll["base"] += F.cross_entropy(lb, x[0, 1:], reduction="sum").item()
            nll["fp8"] += F.cross_entropy(lq, x[0, 1:], reduction="sum").item()
            pb, pq = F.log_softmax(lb, -1), F.log_softmax(lq, -1)
            kl_tokens.append((pb.exp() * (pb - pq)).sum(-1))
            cnt = (w + 1) * (args.seqlen - 1)
            print(f"window {w + 1}/{n}: ppl base {math.exp(nll['base'] / cnt):.4f} fp8 {math.exp(nll['fp8'] / cnt):.4f}"
                  f" KL {torch.cat(kl_tokens).mean().item():.5f} ({time.time() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    cnt = n * (args.seqlen - 1)
    kl = torch.cat(kl_tokens)
    ppl_base, ppl_fp8 = math.exp(nll["base"] / cnt), math.exp(nll["fp8"] / cnt)
    record = {
        "model": os.path.basename(GGUF), "weights": args.weights, "activations": "dynamic per token",
        "windows": n, "seqlen": args.seqlen, "ppl_base_fp32": ppl_base, "ppl_fp8": ppl_fp8,
        "ppl_rel_change": ppl_fp8 / ppl_base - 1, "kld_mean": kl.mean().item(),
        "kld_p99": kl.quantile(0.99).item(), "kld_max": kl.max().item(), "checkpoint_safetensors_bytes": size,
        "n_fp8_linears": report.n_quantized, "kept_16bit": report.ignored,
        "note": "16-bit tensors of the checkpoint are bfloat16 (save dtype auto for a float32 model); CPU float32 "
                "emulation of e4m3 W8A8; the machine was shared (timings not meaningful)",
        "seconds": time.time() - started, "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
