"""Does an independent GPTQ reader (GPTQModel) see the same model in a quantkit checkpoint as we do?

Question: are the bit order, the zero-point convention (v1: stored minus one) and config.json of our
checkpoints read the same way by GPTQModel as by quantkit? The script loads one checkpoint with both,
runs the same token ids through each, and compares the logits with a float32 reference (quantkit's
exact dequantization in float32): a matching layout gives differences of the size a 16-bit forward
pass gives anyway, a wrong nibble order or an off-by-one zero gives differences of the size of the
logits themselves.

Runs in a separate venv that has GPTQModel (its dependencies pin their own torch); quantkit is
imported from this repository by path, so it needs no install there::

    python3 -m venv /work/venv-gptqmodel
    /work/venv-gptqmodel/bin/pip install torch==2.13.0 gptqmodel==7.6.0
    GPTQMODEL_CPU_WORKERS=2 /work/venv-gptqmodel/bin/python bench/verify_independent_reader.py --make-tiny /tmp/tiny-w4
    GPTQMODEL_CPU_WORKERS=2 /work/venv-gptqmodel/bin/python bench/verify_independent_reader.py CHECKPOINT_DIR

GPTQModel quirks on the CPU: its torch kernel needs float16/bfloat16 activations, and it refuses an
asymmetric (sym=false) v1 checkpoint unless ``meta.quantizer`` names gptqmodel >= 0.9 as producer
(older v1 producers wrapped zero points); the script reports that refusal instead of working around it.
Prints a table and writes JSON under bench/runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(min(2, os.cpu_count() or 1)))

import torch  # noqa: E402  (after the environment GPTQModel reads at import)


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``vocab_size`` made-up words (GPTQModel insists on a tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def make_tiny_checkpoint(
    output: Path, sym: bool, group_size: int, dtype: torch.dtype, seed: int, keep_16bit: tuple[str, ...] = ()
) -> Path:
    """A random 2-layer Llama, RTN-quantized with quantkit's primitives, saved by quantkit's writer.

    Linears whose full name ends with an entry of ``keep_16bit`` stay unquantized (declared through
    ``modules_in_block_to_quantize`` and ``dynamic``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.arch import find_decoder_layers, find_linears
    from quantkit.checkpoint.save import save_quantized
    from quantkit.config import QuantScheme
    from quantkit.primitives import compute_qparams, quantize
    from quantkit.qtensor import QuantizedWeight

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    scheme = QuantScheme(bits=4, group_size=group_size, sym=sym)
    prefix, layers = find_decoder_layers(model)
    weights = {}
    for i, layer in enumerate(layers):
        for rel, linear in find_linears(layer).items():
            if f"{prefix}.{i}.{rel}".endswith(keep_16bit) and keep_16bit:
                continue
            w = linear.weight.detach().float()
            scales, zeros, g_idx = compute_qparams(w, scheme.bits, scheme.group_size, scheme.sym)
            codes = quantize(w, scales, zeros, g_idx, scheme.bits)
            weights[f"{prefix}.{i}.{rel}"] = QuantizedWeight.from_codes(codes, scales, zeros, g_idx, scheme)
    tokenizer = tiny_tokenizer(config.vocab_size)
    return save_quantized(
        model, weights, output, tokenizer=tokenizer, method="rtn", scheme=scheme, overwrite=True
    )


def quantkit_logits(path: Path, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from quantkit.checkpoint.save import load_quantized

    model, _ = load_quantized(path, dtype=dtype)
    with torch.no_grad():
        return model(ids).logits.float()


def gptqmodel_logits(
    path: Path, ids: torch.Tensor, dtype: torch.dtype, backend: str
) -> tuple[torch.Tensor, str]:
    from gptqmodel import GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    model = GPTQModel.load(str(path), device="cpu", backend=backend, dtype=dtype)
    kernels = sorted({type(m).__name__ for m in model.model.modules() if isinstance(m, BaseQuantLinear)})
    with torch.no_grad():
        return model.model(ids).logits.float(), ",".join(kernels)


def off_by_one_copy(path: Path, into: Path) -> Path:
    """A copy of the checkpoint whose stored zero points are one too high (the v1 "minus one" forgotten).

    The negative control: a reader of this copy must disagree with quantkit's reading of the original
    by about a quantization step times the activations, showing that the comparison can fail.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from quantkit.pack import pack_rows, unpack_rows

    bits = json.loads((path / "config.json").read_text())["quantization_config"]["bits"]
    shutil.copytree(path, into, dirs_exist_ok=True)
    for file in into.glob("*.safetensors"):
        tensors = load_file(file)
        for key in [k for k in tensors if k.endswith(".qzeros")]:
            stored = unpack_rows(tensors[key].t().contiguous(), bits)  # [out, G]
            tensors[key] = pack_rows((stored + 1).clamp(max=2**bits - 1), bits).t().contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})
    return into


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    diff = (a - b).abs()
    return {
        "max_abs": diff.max().item(),
        "max_rel": (diff.max() / b.abs().max()).item(),
        "mean_abs": diff.mean().item(),
        "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a quantkit checkpoint folder")
    parser.add_argument("--make-tiny", type=Path, help="first write a tiny random Llama checkpoint here")
    parser.add_argument("--asym", action="store_true", help="with --make-tiny: asymmetric quantization")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument(
        "--keep-16bit", nargs="*", default=[], help="with --make-tiny: name suffixes left unquantized"
    )
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--backend", default="gptq_torch", help="GPTQModel backend (gptq_torch, auto, ...)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--control", action="store_true", help="also read an off-by-one-zero copy (must differ)"
    )
    parser.add_argument(
        "--json", type=Path, help="result file (default bench/runs/independent_reader_*.json)"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    path = args.checkpoint
    if args.make_tiny is not None:
        keep = tuple(args.keep_16bit)
        path = make_tiny_checkpoint(args.make_tiny, not args.asym, args.group_size, dtype, args.seed, keep)
    if path is None:
        parser.error("give a checkpoint folder or --make-tiny FOLDER")

    config = json.loads((path / "config.json").read_text())
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config["vocab_size"], (2, args.tokens), generator=generator)
    result: dict = {
        "checkpoint": str(path),
        "quantization_config": {k: v for k, v in config["quantization_config"].items() if k != "quantkit"},
        "dtype": args.dtype,
        "backend": args.backend,
        "tokens": list(ids.shape),
        "torch": torch.__version__,
    }
    reference = quantkit_logits(path, ids, torch.float32)
    ours = quantkit_logits(path, ids, dtype)
    result["quantkit_vs_fp32"] = compare(ours, reference)
    try:
        import gptqmodel

        result["gptqmodel"] = gptqmodel.__version__
        start = time.perf_counter()
        theirs, kernels = gptqmodel_logits(path, ids, dtype, args.backend)
        result["gptqmodel_seconds"] = round(time.perf_counter() - start, 2)
        result["gptqmodel_kernels"] = kernels
        result["gptqmodel_vs_fp32"] = compare(theirs, reference)
        result["gptqmodel_vs_quantkit"] = compare(theirs, ours)
        result["logit_scale"] = reference.abs().max().item()
        if args.control:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                broken, _ = gptqmodel_logits(
                    off_by_one_copy(path, Path(tmp) / "ckpt"), ids, dtype, args.backend
                )
            result["control_off_by_one_zero_vs_quantkit"] = compare(broken, ours)
    except Exception as exc:  # noqa: BLE001  (report why the independent reader failed, verbatim)
        result["gptqmodel_error"] = f"{type(exc).__name__}: {exc}"

    print(f"checkpoint {path}  ({args.dtype}, backend {args.backend})")
    for name in (
        "quantkit_vs_fp32",
        "gptqmodel_vs_fp32",
        "gptqmodel_vs_quantkit",
        "control_off_by_one_zero_vs_quantkit",
    ):
        if name in result:
            r = result[name]
            print(
                f"  {name:36s} max_abs {r['max_abs']:.3e}  max_rel {r['max_rel']:.3e}  argmax {r['argmax_agree']:.3f}"
            )
    if "gptqmodel_error" in result:
        print(f"  GPTQModel could not load it: {result['gptqmodel_error']}")
    out = (
        args.json or REPO / "bench" / "runs" / f"independent_reader_{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  wrote {out}")
    return 0 if "gptqmodel_vs_quantkit" in result else 1


if __name__ == "__main__":
    sys.exit(main())
