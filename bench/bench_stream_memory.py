"""Peak host memory of a streamed quantization (``--stream on``) against the checkpoint's size: RTN and GPTQ.

Writes a random bf16 Llama-shaped checkpoint layer by layer (safetensors shards of ``--shard-mb``; the
whole model is never held, in any dtype), then runs the ``quantkit`` CLI on it in a child process for each
method and reads the child's own peak resident memory (its JSON report's ``peak_host_memory_bytes``:
``VmHWM`` of that process, read at its end). The bound checked is issue 43's: a third of the checkpoint
plus 512 MiB.

    python bench/bench_stream_memory.py                                   # the issue's 2.2 GB shape, CPU
    python bench/bench_stream_memory.py --shape llama2k --shape llama4k --layers 2   # two widths
    python bench/bench_stream_memory.py --device cuda --shape llama8b --method gptq --streams on,off \
        --nsamples 128 --seqlen 2048                                      # H200: streamed vs whole model
    python bench/bench_stream_memory.py ... --model DIR --streams off    # reuse a checkpoint written with --keep
    python bench/bench_stream_memory.py --shape tiny                      # a smoke run (seconds)

Memory numbers do not depend on how busy the machine is; times do (a shared CPU makes them longer).
Prints a table and writes JSON (host, versions, date, every run) to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CALIB = REPO.parent / "shared" / "data" / "wikitext2" / "valid.tokens.txt"

# Llama-shaped; vocabularies as the families they are named after (SmolLM2's 49,152, Llama 3's 128,256).
SHAPES = {
    # issue 43's checkpoint: SmolLM2-1.7B's widths, 16 layers, tied embeddings: 2.35 GB of bf16
    "llama2k": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True),
    # Llama-3-8B's widths (GQA 8 of 32 heads) with SmolLM2's vocabulary: an 8B layer on a CPU
    "llama4k": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=False),
    # Llama-3-8B itself (16.1 GB of bf16)
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # the default test's shape (tests/test_stream_memory.py): small layers, Llama 3's vocabulary (tied)
    "small": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False),
}
MiB = 2**20


def bound_bytes(checkpoint_bytes: int) -> int:
    """Issue 43's bound on the peak resident memory of a streamed run: a third of the checkpoint plus 512 MiB."""
    return checkpoint_bytes // 3 + 512 * MiB


def write_llama_checkpoint(folder: Path, shape: dict, *, shard_bytes: int = 500 * 10**6, seed: int = 0,
                           device: str = "cpu") -> int:
    """A random bf16 Llama of ``shape`` as sharded safetensors, config.json and a small tokenizer; returns the
    bytes of the safetensors files. Tensors are drawn (N(0, 0.02); norms 1) a block of rows at a time into
    bf16 and each shard is written as soon as it is full: at most one shard is held."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.checkpoint.read import parameters_on_meta

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(max_position_embeddings=4096, **shape)
    config.dtype = torch.bfloat16
    with parameters_on_meta():  # names and shapes only
        skeleton = LlamaForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    names = [n for n, _ in skeleton.named_parameters()]  # tied weights appear once
    shard: dict[str, torch.Tensor] = {}
    shards: list[list[str]] = []
    size = 0

    def flush() -> None:
        save_file(shard, str(folder / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
        shards.append(list(shard))
        shard.clear()

    for name in names:
        param = skeleton.get_parameter(name)
        tensor = torch.empty(param.shape, dtype=torch.bfloat16)
        if param.ndim == 1:
            tensor.fill_(1.0)
        else:
            step = max(1, (1 << 22) // param.shape[1])
            for r in range(0, param.shape[0], step):
                block = torch.randn(min(step, param.shape[0] - r), param.shape[1], generator=gen, device=device)
                tensor[r : r + step] = block.mul_(0.02).to(torch.bfloat16).cpu()
        nbytes = tensor.numel() * 2
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = tensor
        size += nbytes
    flush()
    weight_map = {}
    for i, keys in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"part-{i}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(str(folder))
    _write_tokenizer(folder)
    return total


def _write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer trained in-process (ids < 300: any vocabulary above holds them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "a model streamed from disk"] * 20,
                            trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(folder))


def quantize_cli(model: Path, output: Path, method: str, *, device: str = "cpu", stream: str = "on",
                 calib: Path = CALIB, nsamples: int = 4, seqlen: int = 256, timeout: float | None = None) -> dict:
    """``quantkit METHOD MODEL -o OUTPUT --stream STREAM --json`` in a child process: its JSON report and wall
    time. The report's ``peak_host_memory_bytes`` is the child's own VmHWM."""
    cmd = [sys.executable, "-m", "quantkit.cli.app", method, str(model), "-o", str(output), "--stream", stream,
           "--device", device, "--json", "--overwrite"]
    if method != "rtn":
        cmd += ["--calib", str(calib), "--nsamples", str(nsamples), "--seqlen", str(seqlen)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    t0 = time.perf_counter()
    # stderr (the progress) goes straight through, so a long run shows its layers as they finish
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout, cwd=str(REPO))
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); its log is above")
    report = json.loads(proc.stdout)
    return {"command": " ".join(cmd), "wall_s": wall, "report": report}


def measure(shape_name: str, methods: list[str], args: argparse.Namespace, work: Path) -> list[dict]:
    shape = dict(SHAPES[shape_name])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    reuse = args.model is not None
    model = Path(args.model) if reuse else work / f"model-{shape_name}"
    t0 = time.perf_counter()
    if reuse:
        shape = {k: v for k, v in json.loads((model / "config.json").read_text()).items() if k in shape}
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    else:
        size = write_llama_checkpoint(model, shape, shard_bytes=args.shard_mb * 10**6,
                                      device="cuda" if args.device.startswith("cuda") else "cpu")
        print(f"wrote {shape_name}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    try:
        streams = args.streams.split(",")
        for method in methods:
            for stream in streams:
                out = work / f"out-{shape_name}-{method}-{stream}"
                run = quantize_cli(model, out, method, device=args.device, stream=stream, nsamples=args.nsamples,
                                   seqlen=args.seqlen, calib=Path(args.calib))
                rep = run["report"]
                peak = rep["peak_host_memory_bytes"]
                rows.append({
                    "shape": shape_name, "config": shape, "method": method, "stream": stream,
                    "checkpoint_bytes": size, "peak_host_bytes": peak, "bound_bytes": bound_bytes(size),
                    "within_bound": peak < bound_bytes(size), "peak_host_fraction": peak / size,
                    "peak_device_bytes": rep.get("peak_device_memory_bytes", 0), "wall_s": run["wall_s"],
                    "seconds": rep.get("seconds"), "command": run["command"],
                    "output_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
                })
                print(_row_text(rows[-1]), flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep and not reuse:
            shutil.rmtree(model, ignore_errors=True)
    return rows


def _row_text(r: dict) -> str:
    dev = f"{r['peak_device_bytes'] / 2**30:6.2f}" if r["peak_device_bytes"] else "     -"
    return (f"{r['shape']:<8} {r['config']['num_hidden_layers']:>3} {r['checkpoint_bytes'] / 2**30:7.2f} "
            f"{r['method']:<5} {r['stream']:<4} {r['peak_host_bytes'] / MiB:8.0f} {r['bound_bytes'] / MiB:8.0f} "
            f"{100 * r['peak_host_fraction']:6.1f}% {dev} {r['wall_s']:8.1f}")


HEADER = (f"{'shape':<8} {'lay':>3} {'ckpt GiB':>7} {'meth':<5} {'strm':<4} {'peak MiB':>8} {'bound':>8} "
          f"{'of ckpt':>7} {'dev GiB':>6} {'wall s':>8}")


def versions() -> dict:
    import safetensors
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}


def host() -> dict:
    info = {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    try:
        info["mem_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _default_calib() -> Path:
    for path in (CALIB, REPO / "shared" / "data" / "wikitext2" / "valid.tokens.txt"):
        if path.is_file():
            return path
    return CALIB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), default=None,
                   help="model shape (repeatable; default llama2k)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--method", action="append", choices=("rtn", "gptq"), default=None,
                   help="repeatable; default both")
    p.add_argument("--device", default="cpu", help="where layers are processed (cpu, cuda)")
    p.add_argument("--streams", default="on", help="comma-separated --stream values to run (default on; on,off "
                   "compares with the whole model loaded)")
    p.add_argument("--calib", default=str(_default_calib()), help="calibration text for GPTQ (default: wikitext-2 "
                   "validation from ../shared or ./shared)")
    p.add_argument("--model", default=None, help="an existing checkpoint folder to measure (skips writing one)")
    p.add_argument("--nsamples", type=int, default=4, help="GPTQ calibration windows (default 4)")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--shard-mb", type=int, default=500, help="source shard size, MB (default 500)")
    p.add_argument("--workdir", default=None, help="where the models go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the written models")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/stream_memory_<date>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    shapes = args.shape or ["llama2k"]
    if args.model is not None and len(shapes) != 1:
        raise SystemExit("--model measures one checkpoint: give one --shape (its name labels the rows)")
    methods = args.method or ["rtn", "gptq"]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="qk-stream-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    try:
        for name in shapes:
            rows += measure(name, methods, args, work)
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(HEADER)
    for r in rows:
        print(_row_text(r))
    record = {"bench": "stream_memory", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": host(),
              "versions": versions(), "device": args.device, "nsamples": args.nsamples, "seqlen": args.seqlen,
              "note": "peak = the quantizing process's VmHWM; times depend on how busy the machine was",
              "runs": rows}
    out = Path(args.out) if args.out else RESULTS / f"stream_memory_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
