"""The peer beside bench_quantize_8b.py: llm-compressor's GPTQ on the same random Llama-3-8B-shaped model.

llm-compressor 0.14.0.1 ``oneshot`` with ``GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])``
(4-bit symmetric, groups of 128, its default static act-order), the same 128 x 2048 random calibration
tokens as ``bench_quantize_8b.py`` (``torch.randint`` seed 0), the same random weights (the bench's
``build_model``: N(0, 0.02) drawn on the GPU, seed 0), and the model starting in host memory, which
llm-compressor's sequential pipeline onloads to the GPU layer by layer. ``oneshot`` re-reads the
config by name and wants a tokenizer, so the random model is saved first (with a small byte-level BPE
tokenizer, ``bench_quantize_from_disk.write_tokenizer``) and loaded back from that folder; only
``oneshot`` is timed. Peak device memory is ``torch.cuda.max_memory_allocated`` over ``oneshot``.

    python bench/peer_llmcompressor_gptq_8b.py --layers 8 --out bench/runs/peer.json
    python bench/peer_llmcompressor_gptq_8b.py --tiny        # CPU smoke run (tiny shapes)

Needs llmcompressor, compressed-tensors, loguru, datasets (and their own needs) importable; on the
device they travel as wheels (bench/device_quant_s16.sh).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize_8b import LLAMA3_8B, TINY, build_model  # noqa: E402
from bench_quantize_from_disk import write_tokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--nsamples", type=int, default=None, help="default 128 (tiny 8)")
    p.add_argument("--seqlen", type=int, default=None, help="default 2048 (tiny 64)")
    p.add_argument("--batch-size", type=int, default=1, help="oneshot's batch_size (its default 1)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available() and not args.tiny
    # tiny: intermediate 384, not 352 (llm-compressor refuses columns that groups of 128 do not divide)
    shape = {**TINY, "intermediate_size": 384} if args.tiny else LLAMA3_8B
    nsamples = args.nsamples or (8 if args.tiny else 128)
    seqlen = args.seqlen or (64 if args.tiny else 2048)
    dtype = torch.bfloat16 if cuda else torch.float32
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qk-llmc-"))
    folder = work / "model"
    t0 = time.perf_counter()
    model = build_model(shape, args.layers, dtype, torch.device("cuda" if cuda else "cpu"))
    model.save_pretrained(str(folder))
    write_tokenizer(folder)
    del model
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)  # on the host
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prepare_s = time.perf_counter() - t0
    tokens = torch.randint(0, shape["vocab_size"], (nsamples, seqlen), generator=torch.Generator().manual_seed(0))
    ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    oneshot(model=model, processor=tokenizer, dataset=ds, recipe=recipe, num_calibration_samples=nsamples,
            max_seq_length=seqlen, batch_size=args.batch_size, shuffle_calibration_samples=False)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    # Sanity: the quantized linears carry a weight scale (compressed-tensors' frozen qparams).
    n_scaled = sum(1 for n, _ in model.named_parameters() if n.endswith("weight_scale"))
    rec = {
        "peer": "llm-compressor", "method": "gptq", "recipe": "GPTQModifier(targets=Linear, scheme=W4A16, "
        "ignore=[lm_head])", "layers": args.layers, "nsamples": nsamples, "seqlen": seqlen,
        "batch_size": args.batch_size, "total_s": seconds, "per_layer_s": seconds / args.layers,
        "peak_gib": peak, "prepare_s_not_counted": prepare_s, "quantized_linears": n_scaled,
        "device": torch.cuda.get_device_name() if cuda else f"CPU {platform.processor()}",
        "versions": {k: importlib.metadata.version(k) for k in
                     ("llmcompressor", "compressed-tensors", "torch", "transformers", "datasets")},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"llm-compressor GPTQ W4A16: {args.layers} layers, {nsamples} x {seqlen}: {seconds:.1f} s "
          f"({seconds / args.layers:.2f} s a layer), peak device memory {peak:.2f} GiB, "
          f"{n_scaled} quantized linears")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rec, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
