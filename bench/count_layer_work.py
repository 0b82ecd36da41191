"""What does `quantkit gptq` do per decoder layer that bench/bench_quantize_8b.py does not? Counts, not timings.

Issue 37: on one H200 the shortest `quantkit gptq MODEL -o OUT --calib FILE` took ~2.1 s a layer of the 8B
shape against ~1.56 s in bench_quantize_8b.py. This script runs both paths on the CPU on a small random
Llama (built in-process, bf16, saved as safetensors for the CLI), with the GPTQ group-by-group calibration an
accelerator takes (``single_pass_max_tokens=0``), and counts per decoder layer, by phase:

* forwards of the decoder layer over the calibration batches (whole, or stopped early by a capture);
* Hessian accumulations; matrix-product FLOPs (mm/addmm/bmm/linear/attention) by phase;
* host syncs: ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``float()`` of a tensor), and the calls
  that synchronize only on CUDA: GPTQ's ``_clock`` (before h44speed a device-wide ``torch.cuda.synchronize``,
  which also waited for the walker's side-stream copies), ``PhaseClock`` laps (the compute stream), the solve
  timeline's event reads;
* requests to bring a tensor to the host (``.to("cpu")``, ``.cpu()``; no-ops here, blocking copies on a GPU);
* dtype conversions and new tensors of activation size (one calibration batch of hidden states or more);
* where the model's host weights live (anonymous memory or a private, copy-on-write map of the file): the
  walker writes every finished layer back into them.

The solve's column loop (the torch loop here, one Triton launch per block on CUDA) is counted as calls only.

    python bench/count_layer_work.py                 # CLI vs bench (its options) vs bench (the CLI's options)
    python bench/count_layer_work.py --json out.json
    python bench/count_layer_work.py --finite-chunk 5350   # the finite checks cut in as many blocks as on 8B

The finite checks (``all_finite``) read their tensors in blocks of 4M values: an 8B layer's weights and
Hessians make 113 blocks, this shape's one block a tensor. ``--finite-chunk`` shrinks the block so that this
shape's down_proj Hessian (512 x 512) makes 49 blocks, as the 8B one (14336 x 14336) does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
NSAMPLES, SEQLEN, BATCH = 32, 64, 8
BENCH_OPTIONS = {"desc_act": True, "static_groups": False, "mse": False}  # docs/speed.md's 1.56 s run
CLI_OPTIONS = {"desc_act": True, "static_groups": True, "mse": True, "mse_weight": "hessian"}  # defaults
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "addr", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}


class Tally:
    """Counts by (phase, item); the phase is a stack of names pushed by wrapped functions."""

    def __init__(self, act_numel: int) -> None:
        self.act_numel = act_numel  # one calibration batch of hidden states
        self.stack: list[str] = ["other"]
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.sites: Counter = Counter()  # (item, file:line of the first quantkit/cli frame)
        self.counting = True

    @property
    def phase(self) -> str:
        return self.stack[-1]

    def add(self, item: str, n: float = 1, site: bool = False) -> None:
        if self.counting:
            self.counts[self.phase][item] += n
            if site:
                self.sites[item, _site()] += n

    @contextlib.contextmanager
    def under(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()


def _site() -> str:
    """file:line of the innermost caller in quantkit's own code (not torch, not this script)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/quantkit/" in name and "count_layer_work" not in name:
            return f"{name.split('/quantkit/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


def _flops(name: str, args, out) -> float:
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        return 2.0 * a.numel() * b.shape[-1]
    if name.startswith("_scaled_dot_product"):
        q, k = args[0], args[1]  # [b, h, S, d]
        return 4.0 * q.numel() * k.shape[-2]  # QK^T and PV (causal masking not subtracted)
    return 0.0


_VIEWS = {"view", "_unsafe_view", "t", "transpose", "reshape", "expand", "slice", "select", "detach", "alias",
          "permute", "unsqueeze", "squeeze", "as_strided", "diagonal", "split", "unbind", "_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """aten ops by phase: matmul FLOPs, host syncs, dtype conversions, activation-sized results."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        t = self.tally
        if t.phase == "solve loop":
            return out
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            t.add("host syncs (.item/bool/float of a tensor)", site=True)
        elif name in _MATMULS:
            t.add("matmul GFLOP", _flops(name, args, out) / 1e9)
        elif name == "_to_copy" and isinstance(out, torch.Tensor) and args[0].dtype != out.dtype:
            big = out.numel() >= t.act_numel
            t.add(f"dtype conversions{' (activation-sized)' if big else ''}")
        if isinstance(out, torch.Tensor) and out.numel() >= t.act_numel and name not in _VIEWS:
            if not name.endswith("_"):  # in-place ops allocate nothing
                t.add("activation-sized new tensors")
        if isinstance(out, torch.Tensor) and name not in _VIEWS and name not in _MATMULS:
            t.add("elementwise values written (M)", out.numel() / 1e6)
        return out


def _to_host_hook(tally: Tally):
    """Counts ``Tensor.to(cpu)`` / ``.cpu()`` / ``.tolist()`` requests: free on the CPU, a blocking copy from a
    GPU (``tolist`` reads the data without an aten op the dispatch counter would see)."""
    orig_to, orig_cpu, orig_tolist = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.tolist

    def to(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args else None)
        if isinstance(dev, str) and dev == "cpu":  # the host named as such (the work device is a torch.device)
            tally.add("to-host requests (blocking D2H on a GPU)", site=True)
        return orig_to(self, *args, **kwargs)

    def cpu(self, *args, **kwargs):
        tally.add("to-host requests (blocking D2H on a GPU)", site=True)
        return orig_cpu(self, *args, **kwargs)

    def tolist(self, *args, **kwargs):
        tally.add("to-host requests (blocking D2H on a GPU)", site=True)
        return orig_tolist(self, *args, **kwargs)

    return {"to": (orig_to, to), "cpu": (orig_cpu, cpu), "tolist": (orig_tolist, tolist)}


def _wrap(tally: Tally, module, attr: str, phase: str | None, item: str | None = None):
    orig = getattr(module, attr)

    def wrapped(*args, **kwargs):
        if item:
            tally.add(item)
        if phase is None:
            return orig(*args, **kwargs)
        with tally.under(phase):
            return orig(*args, **kwargs)

    return module, attr, orig, wrapped


def instrument(tally: Tally, finite_chunk: int | None = None) -> contextlib.ExitStack:
    """Patch the walk's functions so ops land in named phases and the CUDA-only syncs are counted
    (``finite_chunk``: the finite checks' block size, None for the library's)."""
    from quantkit.calibrate import activations, walker
    from quantkit.calibrate.pipeline import LayerPipeline
    from quantkit.checkpoint import save
    from quantkit.methods import gptq, gptq_factor, gptq_method
    from quantkit.models import lazy
    from quantkit.qtensor import QuantizedWeight

    stack = contextlib.ExitStack()
    if finite_chunk is not None:
        real_all_finite = gptq_factor.all_finite

        def all_finite(t, chunk_elements=finite_chunk):
            return real_all_finite(t, chunk_elements)

        for module in (gptq, gptq_factor):
            module.all_finite = all_finite
            stack.callback(setattr, module, "all_finite", real_all_finite)
    patches = [
        _wrap(tally, walker, "capture_layer_inputs", "input capture (once)"),
        _wrap(tally, LayerPipeline, "take", "move in"),
        _wrap(tally, LayerPipeline, "finish", "move out"),
        _wrap(tally, walker, "propagate", "propagate"),
        _wrap(tally, walker, "install_weight", "install"),
        _wrap(tally, gptq_method, "collect_hessians", "group passes + Hessians"),
        _wrap(tally, gptq.HessianAccumulator, "add", None, "Hessian accumulations (batches)"),
        _wrap(tally, gptq_method, "gptq_quantize", "gptq_quantize", "gptq_quantize calls (stacks)"),
        _wrap(tally, gptq, "all_finite", "finite checks"),
        _wrap(tally, gptq_factor, "all_finite", "finite checks"),
        _wrap(tally, gptq, "damped_inverse_factor", "factor"),
        _wrap(tally, gptq, "_static_params", "static-group search"),
        _wrap(tally, gptq, "solve_columns", "solve loop", "column solves"),
        _wrap(tally, gptq, "_row_errors_packed", "error stats (rtn, gptq, energy)"),
        _wrap(tally, gptq_method._LayerWork, "_install", "pack + install"),
        _wrap(tally, QuantizedWeight, "from_codes", None, "packings"),
        _wrap(tally, gptq_method, "relative_error", None, "relative_error floats (a read each)")
        if hasattr(gptq_method, "relative_error") else  # h45walk: device scalars, read together by finish_errors
        _wrap(tally, gptq_method, "relative_error_tensor", None, "relative_error scalars (read once a layer)"),
        _wrap(tally, gptq_method, "_clock", None, "syncs on CUDA: gptq _clock (device-wide until h44speed)"),
        _wrap(tally, activations.PhaseClock, "_now", None, "stream syncs on CUDA (PhaseClock)"),
        _wrap(tally, save, "save_quantized", "save"),
    ]
    patches.append(_wrap(tally, lazy, "open_model", "load"))
    if hasattr(gptq_method._LayerWork, "finish_errors"):  # h45walk: a layer's error floats read together
        patches.append(_wrap(tally, gptq_method._LayerWork, "finish_errors", "error floats read"))
    if hasattr(gptq_method, "_Timeline"):  # h44speed: the solve's times from CUDA events, read once a layer
        patches.append(_wrap(tally, gptq_method._Timeline, "wait", None, "syncs on CUDA: solve-time event wait"))
    for module, attr, orig, new in patches:
        setattr(module, attr, new)
        stack.callback(setattr, module, attr, orig)
    for name, (orig, new) in _to_host_hook(tally).items():
        setattr(torch.Tensor, name, new)
        stack.callback(setattr, torch.Tensor, name, orig)
    # As on an accelerator: group-by-group calibration, no single pass (the CPU default).
    orig_limit = gptq.GPTQConfig.single_pass_limit
    gptq.GPTQConfig.single_pass_limit = lambda self, device: 0
    stack.callback(setattr, gptq.GPTQConfig, "single_pass_limit", orig_limit)
    stack.enter_context(OpCounter(tally))
    return stack


def hook_layers(model, tally: Tally) -> list:
    """Count decoder-layer forwards (started) and the tokens each linear multiplies, by phase."""
    from quantkit.arch import find_decoder_layers, find_linears

    _, layers = find_decoder_layers(model)
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(lambda m, a: tally.add("decoder-layer forwards (batches)")))
        for lin in find_linears(layer).values():
            handles.append(lin.register_forward_pre_hook(
                lambda m, a: tally.add("linear token-rows (k)", a[0].numel() / a[0].shape[-1] / 1e3)))
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            handles.append(attn.register_forward_pre_hook(lambda m, a, k: tally.add("attention calls (batches)"),
                                                          with_kwargs=True))
    return handles


def file_backed_share(model) -> float:
    """Fraction of the decoder layers' parameter bytes held in a file mapping (safetensors mmap) rather
    than anonymous memory."""
    from quantkit.arch import find_decoder_layers

    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps.append((lo, hi, len(parts) > 5 and parts[5].startswith("/")))
    _, layers = find_decoder_layers(model)
    total = mapped = 0
    for p in layers.parameters():
        n = p.numel() * p.element_size()
        total += n
        mapped += n * any(lo <= p.data_ptr() < hi and f for lo, hi, f in maps)
    return mapped / max(total, 1)


def write_back_faults(model) -> float:
    """Minor page faults per MiB when the last decoder layer's host weights are written in place (what the
    walker's ``copy_home`` does with every finished layer): ~0 for resident anonymous memory, ~256 (one per
    4 KiB page) for a private file map, whose every first write copies the page. Values are unchanged (x * 1)."""
    import resource

    from quantkit.arch import find_decoder_layers

    _, layers = find_decoder_layers(model)
    params = list(layers[-1].parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in params)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.no_grad():
        for p in params:
            p.data.mul_(1)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (n_bytes / 2**20)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "a model rounds its weights"] * 50,
                            trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def cli_run(folder: Path, calib: Path, out: Path, tally: Tally, finite_chunk: int | None = None) -> dict:
    """`quantkit gptq FOLDER -o OUT --calib FILE` in-process (typer), with the counters on."""
    from typer.testing import CliRunner

    from quantkit import api
    from quantkit.cli.app import app

    share = {}
    real_walk = api.walk

    def walk(model, *a, **k):
        share["file_backed"] = file_backed_share(model)
        share["write_back_faults_per_mib"] = write_back_faults(model)
        handles = hook_layers(model, tally)
        try:
            with tally.under("walk (per-layer work)"):
                return real_walk(model, *a, **k)
        finally:
            for h in handles:
                h.remove()

    api.walk = walk
    try:
        with instrument(tally, finite_chunk):
            res = CliRunner().invoke(app, ["gptq", str(folder), "-o", str(out), "--calib", str(calib),
                                           "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN),
                                           "--batch-size", str(BATCH), "--dtype", "bf16", "--device", "cpu",
                                           "--threads", "1"])
    finally:
        api.walk = real_walk
    if res.exit_code != 0:
        raise SystemExit(f"the CLI failed ({res.exit_code}):\n{res.output}\n{res.exception!r}")
    return share


def bench_run(options: dict, tally: Tally, finite_chunk: int | None = None) -> dict:
    """bench_quantize_8b.py's path: build_model (random, resident) and walk with build_method's GPTQ."""
    from bench_quantize_8b import build_model

    from quantkit.api import build_method
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme

    model = build_model(SHAPE, None, torch.bfloat16, torch.device("cpu"))
    share = {"file_backed": file_backed_share(model), "write_back_faults_per_mib": write_back_faults(model)}
    method = build_method("gptq", QuantScheme(4, 128, True), {**options, "solver": "auto"})
    tokens = torch.randint(0, SHAPE["vocab_size"], (NSAMPLES, SEQLEN), generator=torch.Generator().manual_seed(0))
    handles = hook_layers(model, tally)
    try:
        with instrument(tally, finite_chunk), tally.under("walk (per-layer work)"):
            walk(model, method, device="cpu", token_ids=tokens, batch_size=BATCH)
    finally:
        for h in handles:
            h.remove()
    return share


def per_layer(tally: Tally) -> dict[str, dict[str, float]]:
    """Counts inside the walk divided by the number of layers; the rest (load, save, capture) whole."""
    n = SHAPE["num_hidden_layers"]
    out: dict[str, dict[str, float]] = {}
    for phase, items in tally.counts.items():
        scale = 1 if phase in ("load", "save", "input capture (once)", "other") else n
        out[phase] = {k: round(v / scale, 3) for k, v in sorted(items.items())}
    return out


def _sites(tally: Tally) -> dict[str, float]:
    n = SHAPE["num_hidden_layers"]
    return {f"{item[:9]} {site}": round(v / n, 2) for (item, site), v in sorted(tally.sites.items())}


def table(runs: dict[str, dict]) -> str:
    names = list(runs)
    keys = sorted({(p, k) for r in runs.values() for p, items in r["counts"].items() for k in items})
    width = max(len(f"{p}: {k}") for p, k in keys) + 2
    lines = [f"{'phase: item (per layer inside the walk)':<{width}}" + "".join(f"{n:>16}" for n in names)]
    for p, k in keys:
        cells = [runs[n]["counts"].get(p, {}).get(k, 0) for n in names]
        lines.append(f"{p + ': ' + k:<{width}}" + "".join(f"{c:>16g}" for c in cells))
    lines.append(f"{'layer weights in a file mapping (copy-on-write)':<{width}}"
                 + "".join(f"{runs[n]['file_backed']:>16.0%}" for n in names))
    lines.append(f"{'page faults per MiB written back into a layer':<{width}}"
                 + "".join(f"{runs[n]['write_back_faults_per_mib']:>16.0f}" for n in names))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calib", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/wikitext2/"
                                          "valid.tokens.txt"), help="text file for the CLI's --calib")
    p.add_argument("--json", default=None, help="write the counts here too")
    p.add_argument("--finite-chunk", type=int, default=None,
                   help="block size of the finite checks (default: the library's; 5350 gives 8B's block counts)")
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    act = BATCH * SEQLEN * SHAPE["hidden_size"]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16).save_pretrained(folder)
        _tokenizer().save_pretrained(folder)
        tally = Tally(act)
        share = cli_run(folder, Path(args.calib), Path(tmp) / "out", tally, args.finite_chunk)
        runs["cli"] = {"counts": per_layer(tally), "sites": _sites(tally), **share}
    for label, options in (("bench", BENCH_OPTIONS), ("bench+cli-opts", CLI_OPTIONS)):
        tally = Tally(act)
        share = bench_run(options, tally, args.finite_chunk)
        runs[label] = {"counts": per_layer(tally), "sites": _sites(tally), **share}
    print(f"{SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, intermediate "
          f"{SHAPE['intermediate_size']}, {NSAMPLES} x {SEQLEN} tokens in batches of {BATCH}, bf16, CPU, "
          "group-by-group calibration (as on an accelerator)")
    print(table(runs))
    print("\nwhere the host syncs and to-host requests come from (whole run / layers; cli)")
    for site, v in runs["cli"]["sites"].items():
        print(f"  {v:8g}  {site}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
