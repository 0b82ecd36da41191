"""Quantize a model larger than memory from disk: a Qwen2.5-14B-shaped random model, GPTQ, layer by layer.

Writes a model with Qwen2.5-14B's shapes (48 layers, hidden 5120, about 29.5 GB in bf16; random
weights generated on the GPU, written shard by shard so the host never holds more than one shard)
to local disk as safetensors, then quantizes it with ``quantkit.api.quantize(..., stream on)``:
decoder layers are read from the files one at a time and packed layers written as they finish.
Reports the time and the peak host (RSS high-water mark of the quantizing process) and device
memory, and writes JSON under bench/runs/ (card, versions, date).

    python bench/bench_quantize_from_disk.py                  # the 14B shape on cuda (~30 GB in --workdir)
    python bench/bench_quantize_from_disk.py --layers 8       # fewer layers
    python bench/bench_quantize_from_disk.py --tiny           # CPU smoke run (tiny shapes, seconds)

The quantizing runs in a child process, so its peak RSS counts only the quantization (writing the
random model holds one shard in host memory and is not counted). The model and the checkpoint are
deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "runs"

QWEN25_14B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False}
TINY = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False}


def write_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer trained in-process (the model's vocabulary can be larger)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(folder))


def write_random_model(folder: Path, shape: dict, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                       shard_bytes: int = 2 * 2**30, seed: int = 0) -> int:
    """Write a random model with ``shape`` (a transformers config dict) as sharded safetensors + index,
    config.json and a tokenizer; returns the bytes of tensor data. Tensors are generated on ``device``
    and each shard is moved to the host and written as soon as it is full. Weights are N(0, 0.02),
    norms 1, so activations stay finite through any number of layers."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.checkpoint.read import parameters_on_meta

    folder.mkdir(parents=True, exist_ok=True)
    params = dict(shape)
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    config.torch_dtype = dtype
    with parameters_on_meta():  # names and shapes only
        skeleton = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_keys: list[list[str]] = []  # the keys of each written shard (the tensors are dropped once written)
    size = total = 0

    def flush() -> None:
        save_file(shard, str(folder / f"part-{len(shard_keys)}.safetensors"), metadata={"format": "pt"})
        shard_keys.append(list(shard))
        shard.clear()

    for key, param in skeleton.named_parameters():
        if param.ndim == 1 and "norm" in key:
            tensor = torch.ones(param.shape, dtype=dtype)
        else:
            tensor = (torch.randn(param.shape, generator=generator, device=device) * 0.02).to(dtype).cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[key] = tensor
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, keys in enumerate(shard_keys):
        final = f"model-{i + 1:05d}-of-{len(shard_keys):05d}.safetensors"
        (folder / f"part-{i}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(str(folder))
    write_tokenizer(folder)
    return total


# The child: quantizes and prints one JSON line with its own peak memory.
_CHILD = r"""
import json, sys, torch
from quantkit import api
from quantkit.config import LoadConfig, QuantScheme
args = json.loads(sys.argv[1])
tokens = torch.randint(0, args["vocab"], (args["nsamples"], args["seqlen"]), generator=torch.Generator().manual_seed(0))
report = api.quantize(args["model"], args["output"], method=args["method"], scheme=QuantScheme(4, 128, True),
                      load=LoadConfig(device=args["device"], stream=args["stream"]), calib_tokens=tokens,
                      batch_size=args["batch_size"], progress=True, method_options=args["options"])
print("REPORT " + json.dumps(report.to_dict()))
"""


def quantize_in_child(model: Path, output: Path, *, method: str, device: str, nsamples: int, seqlen: int,
                      vocab: int, stream: str = "on", batch_size: int = 8, options: dict | None = None) -> dict:
    """Run ``api.quantize`` in a fresh Python process; its report (with its peak host memory) and wall time."""
    args = {"model": str(model), "output": str(output), "method": method, "device": device, "nsamples": nsamples,
            "seqlen": seqlen, "vocab": vocab, "stream": stream, "batch_size": batch_size, "options": options or {}}
    t0 = time.perf_counter()
    # The child's progress (stderr) goes straight to ours, so a long run shows its layers as they finish.
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"quantizing failed (exit {proc.returncode}); its log is above")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return {"wall_s": wall, "report": json.loads(line[len("REPORT "):])}


def versions() -> dict:
    import safetensors
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a smoke test of this script")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's 48)")
    p.add_argument("--method", choices=("gptq", "rtn", "awq"), default="gptq")
    p.add_argument("--nsamples", type=int, default=None, help="calibration windows (default 128; tiny 4)")
    p.add_argument("--seqlen", type=int, default=None, help="tokens per window (default 2048; tiny 32)")
    p.add_argument("--stream", choices=("on", "off", "auto"), default="on")
    p.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    p.add_argument("--options", default=None,
                   help='method options as JSON (default: the method\'s defaults), e.g. \'{"mse": false}\'')
    p.add_argument("--workdir", default=None, help="where the model and checkpoint go (default: a tmp folder)")
    p.add_argument("--keep", action="store_true", help="keep the model and the checkpoint")
    p.add_argument("--out", default=None, help="JSON path (default bench/runs/quantize_from_disk_<date>.json)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import tempfile

    shape = dict(TINY if args.tiny else QWEN25_14B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    device = args.device or ("cpu" if args.tiny else "cuda")
    nsamples, seqlen = args.nsamples or (4 if args.tiny else 128), args.seqlen or (32 if args.tiny else 2048)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="qk-from-disk-"))
    model_dir, out_dir = work / "model", work / "quantized"
    try:
        t0 = time.perf_counter()
        model_bytes = write_random_model(model_dir, shape, device=device,
                                         shard_bytes=(1 if args.tiny else 2048) * 2**20)
        write_s = time.perf_counter() - t0
        print(f"wrote {model_bytes / 1e9:.2f} GB of random {shape['model_type']} weights in {write_s:.1f} s", flush=True)
        child = quantize_in_child(model_dir, out_dir, method=args.method, device=device, nsamples=nsamples,
                                  seqlen=seqlen, vocab=shape["vocab_size"], stream=args.stream,
                                  options=json.loads(args.options) if args.options else None)
        out_bytes = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
        n_out_files = len(list(out_dir.glob("*.safetensors")))
    finally:
        if not args.keep:  # only what this run wrote (a --workdir may hold other things)
            for folder in (model_dir, out_dir):
                shutil.rmtree(folder, ignore_errors=True)
            if not args.workdir:
                shutil.rmtree(work, ignore_errors=True)
    report = child["report"]
    card = torch.cuda.get_device_name(0) if device.startswith("cuda") else f"CPU {platform.processor()}"
    return {
        "method": args.method, "options": json.loads(args.options) if args.options else {}, "shape": shape, "nsamples": nsamples, "seqlen": seqlen, "device": card,
        "model_bytes": model_bytes, "checkpoint_bytes": out_bytes, "checkpoint_files": n_out_files,
        "write_model_s": write_s, "quantize_wall_s": child["wall_s"], "seconds": report["seconds"],
        "streamed": report["streamed"], "peak_host_memory_bytes": report["peak_host_memory_bytes"],
        "peak_device_memory_bytes": report["peak_device_memory_bytes"],
        "host_memory_fraction_of_model": report["peak_host_memory_bytes"] / model_bytes,
        "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def print_table(rec: dict) -> None:
    gib = 2**30
    print()
    print(f"{rec['method']} from disk on {rec['device']}: {rec['shape']['num_hidden_layers']} layers, "
          f"{rec['nsamples']} x {rec['seqlen']} tokens, streamed={rec['streamed']}")
    print(f"{'model on disk':<28}{rec['model_bytes'] / gib:>10.2f} GiB")
    print(f"{'checkpoint written':<28}{rec['checkpoint_bytes'] / gib:>10.2f} GiB in {rec['checkpoint_files']} file(s)")
    print(f"{'quantize (process wall)':<28}{rec['quantize_wall_s']:>10.1f} s")
    for key, value in rec["seconds"].items():
        print(f"{'  ' + key:<28}{value:>10.1f} s")
    print(f"{'peak host memory (RSS)':<28}{rec['peak_host_memory_bytes'] / gib:>10.2f} GiB "
          f"({100 * rec['host_memory_fraction_of_model']:.1f}% of the model)")
    print(f"{'peak device memory':<28}{rec['peak_device_memory_bytes'] / gib:>10.2f} GiB")


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    rec = run(args)
    print_table(rec)
    out = Path(args.out) if args.out else RESULTS / (
        f"quantize_from_disk_{rec['method']}{'_tiny' if args.tiny else ''}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
