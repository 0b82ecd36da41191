"""The whole serving benchmark (what ``quantkit bench`` and ``bench/bench_serve.py`` run): one record out.

Each phase's numbers are handed to ``on_result`` as soon as they exist, so a run cut short still
leaves what it measured.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantkit.config import QuantkitError
from quantkit.tools import bench

log = logging.getLogger(__name__)
FORMATS = ("int4", "fp8", "bf16")  # the runtime rows a record may hold, in table order


def _card() -> dict:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _require_runtime_family(folder: str) -> None:
    from quantkit.runtime.spec import unsupported_message

    config = Path(folder) / "config.json"
    if config.is_file():
        try:
            refusal = unsupported_message(json.loads(config.read_text()).get("model_type"))
        except (json.JSONDecodeError, AttributeError):
            return  # the loader says what is wrong with it
        if refusal:
            raise QuantkitError(refusal)


def _logits_check(runtime, reference_fn, vocab: int) -> float:
    """Relative error of the runtime's logits against another implementation on the same weights."""
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    got = runtime.forward_logits(ids.to(runtime.device))
    with torch.inference_mode():
        ref = reference_fn(ids.to(runtime.device)).float()
    return ((got - ref).norm() / ref.norm()).item()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run(
    target: str,
    *,
    shape: bool,
    batches: tuple[int, ...] = (1, 8, 32),
    steps: int = 128,
    prefill_tokens: int = 2048,
    baselines: bool = True,
    on_result: Callable[[dict], None] | None = None,
    formats: tuple[str, ...] = FORMATS,
    context: int = bench.DECODE_CONTEXT,
    kv_cache_dtype: str = "auto",
) -> dict:
    """Benchmark ``target`` (a shape name from ``bench.SHAPES`` when ``shape``, else a checkpoint folder).
    ``formats``: the runtime rows to time (a shape: any of :data:`FORMATS`; a checkpoint: its own format and/or
    bf16, its dequantization). ``context``: prompt tokens before the timed decode steps; ``kv_cache_dtype``:
    "auto" or "fp8" (``runtime.kv_budget.KV_DTYPES``)."""
    from quantkit.runtime.kv_budget import check_kv_dtype

    check_kv_dtype(kv_cache_dtype)
    if context < 1:
        raise QuantkitError(f"--context must be >= 1, got {context}")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise QuantkitError(f"--formats takes a comma-separated subset of {', '.join(FORMATS)}, "
                            f"got {','.join(formats)!r}")
    if not shape:  # an architecture the runtime does not implement: say so first, on any machine
        _require_runtime_family(target)
    if not torch.cuda.is_available():
        raise QuantkitError("quantkit bench measures the GPU runtime and needs CUDA")
    if shape and target not in bench.SHAPES:
        raise QuantkitError(f"unknown shape {target!r}; known: {', '.join(bench.SHAPES)}")
    record: dict = {
        "target": target,
        "card": _card(),
        "batches": list(batches),
        "steps": steps,
        "prefill_tokens": prefill_tokens,
        "formats": list(formats),
        "decode_context": context,
        "kv_cache_dtype": kv_cache_dtype,
    }
    decode = DecodeSettings(context, kv_cache_dtype)

    def publish(key: str, value) -> None:
        record[key] = value
        bw = record.get("copy_bandwidth_gbs", 0) * 1e9
        record["roofline_tps"] = {k: bw / record[k]["weight_bytes_per_token"] for k in FORMATS if k in record}
        log.info("%s: %s", key, value)
        if on_result is not None:
            on_result(record)

    publish("copy_bandwidth_gbs", bench.copy_bandwidth("cuda"))
    if shape:
        _shape_phases(target, batches, steps, prefill_tokens, baselines, publish, formats, decode)
    else:
        _checkpoint_phases(target, batches, steps, prefill_tokens, baselines, publish, formats, decode)
    return record


@dataclass(frozen=True)
class DecodeSettings:
    """How every runtime row of one run decodes (``bench.bench_runtime``'s keyword arguments of the same names)."""

    context: int = bench.DECODE_CONTEXT  # prompt tokens each row holds before the timed steps
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8"

    def positions(self, prefill_tokens: int, steps: int) -> int:
        """The runtime's positions for a run: what its engine holds (``bench.positions_needed``), 4096 at least."""
        return max(4096, bench.positions_needed(prefill_tokens, steps, self.context))


@dataclass(frozen=True)
class _ShapeFormat:
    """One runtime row of a shape run: how the fresh random model becomes this format, and what is checked."""

    key: str  # the record's row: "int4", "fp8" or "bf16"
    check: str  # the record key of the runtime's logits error against the model it was built from
    quantize: Callable | None  # model -> the runtime's quant info, changing the model in place; None: as built
    baseline: str | None  # the record key of transformers' generate on this model (when baselines are on)


def _int4(hf):
    return bench.quantize_randomly(hf)


def _fp8(hf) -> None:
    bench.quantize_fp8_in_place(hf)  # FP8 e4m3 weights per channel, activations per token (quantkit fp8's default)


# int4 first (the number the run is for); the bf16 model is a third random model of the same shape (its linears
# are what the int4 model's QuantLinears replaced)
_SHAPE_FORMATS = (
    _ShapeFormat("int4", "check_int4_rel_err_vs_quantlinear", _int4, "transformers_quantlinear"),
    _ShapeFormat("fp8", "check_fp8_rel_err_vs_fp8linear", _fp8, None),
    _ShapeFormat("bf16", "check_bf16_rel_err_vs_transformers", None, "transformers_bf16"),
)


def _shape_phases(target, batches, steps, prefill_tokens, baselines, publish, formats=FORMATS,
                  decode: DecodeSettings = DecodeSettings()) -> None:
    """Each format on its own random model, each phase published as soon as it exists."""
    from quantkit.tools import random_moe

    if random_moe.is_moe_shape(bench.SHAPES.get(target, {})):
        _moe_shape_phases(target, batches, steps, prefill_tokens, publish, formats, decode)
        return
    positions = decode.positions(prefill_tokens, steps)
    for fmt in (f for f in _SHAPE_FORMATS if f.key in formats):
        hf = bench.random_hf_model(target, "cuda")
        quant = None
        if fmt.quantize is not None:
            quant = fmt.quantize(hf)
            _free()
        runtime = bench.runtime_from_hf(hf, quant, max_positions=positions)
        publish(fmt.check, _logits_check(runtime, lambda ids, hf=hf: hf(ids).logits, hf.config.vocab_size))
        publish(fmt.key, bench.bench_runtime(runtime, batches, steps, prefill_tokens, split=True, **asdict(decode)))
        del runtime
        _free()
        if baselines and fmt.baseline is not None:
            publish(fmt.baseline, bench.hf_generate_tps(hf))
        del hf
        _free()


def _moe_shape_phases(target, batches, steps, prefill_tokens, publish, formats=FORMATS,
                      decode: DecodeSettings = DecodeSettings()) -> None:
    """A MoE shape: each format's runtime straight from random tensors (``tools/random_moe.py`` says why), so no
    transformers model to check the logits against or to time ``generate`` on (the GPU tests compare the kernels
    backend with the reference backend on tiny MoE checkpoints of every format)."""
    from quantkit.tools.random_moe import random_moe_runtime

    publish("baselines", "none: MoE shapes are built without a transformers model (tools/random_moe.py)")
    positions = decode.positions(prefill_tokens, steps)
    for key in (k for k in FORMATS if k in formats):
        runtime = random_moe_runtime(bench.SHAPES[target], key, "cuda", max_positions=positions, name=target)
        publish(key, bench.bench_runtime(runtime, batches, steps, prefill_tokens, split=True, **asdict(decode)))
        del runtime
        _free()


def _checkpoint_phases(target, batches, steps, prefill_tokens, baselines, publish, formats=FORMATS,
                       decode: DecodeSettings = DecodeSettings()) -> None:
    from quantkit.checkpoint.fp8 import is_fp8_checkpoint
    from quantkit.runtime.loader import load_runtime_model

    quantized = "fp8" if is_fp8_checkpoint(target) else "int4"
    if not set(formats) & {"bf16", quantized}:
        raise QuantkitError(f"{target} is an {quantized} checkpoint: --formats can time {quantized} and bf16 (its "
                            f"dequantization), got {','.join(formats)!r}")
    positions = decode.positions(prefill_tokens, steps)
    for key, dequantize in (("bf16", True), (quantized, False)):
        if key not in formats:
            continue
        runtime, _ = load_runtime_model(
            target, device="cuda", dtype="bfloat16", dequantize=dequantize, max_positions=positions
        )
        split = key != "bf16"
        publish(key, bench.bench_runtime(runtime, batches, steps, prefill_tokens, split=split, **asdict(decode)))
        del runtime
        _free()
    if baselines:
        from quantkit.checkpoint.read import load_quantized

        hf, _ = load_quantized(target, device="cuda", dtype=torch.bfloat16)
        publish("transformers_quantlinear", bench.hf_generate_tps(hf))


def plot(record: dict, path) -> None:
    """Decode tokens/s by batch size, int4 and fp8 against bf16 (with transformers' batch-1 numbers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    batches = record["batches"]
    xs = range(len(batches))
    keys = [k for k in FORMATS if k in record]
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        values = [record[key]["decode_tps"][str(b)] for b in batches]
        ax.bar([x + width * i for x in xs], values, width=width, label=f"runtime {key}")
    for key, style in (("transformers_quantlinear", "--"), ("transformers_bf16", ":")):
        if key in record:
            ax.axhline(record[key]["decode_tps"], linestyle=style, color="gray", label=f"{key} (batch 1)")
    ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in xs], [str(b) for b in batches])
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"{record['target']} on {record['card']['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(record: dict) -> str:
    """The record as a Markdown table (tokens/s), the form the README quotes."""
    batches = record["batches"]
    head = "| model | " + " | ".join(f"decode b={b}" for b in batches) + " | prefill | weight GB/token | peak GB |"
    lines = [head, "|" + "---|" * (len(batches) + 4)]
    for key in FORMATS:
        if key in record:
            r = record[key]
            cells = " | ".join(f"{r['decode_tps'][str(b)]:.0f}" for b in batches)
            lines.append(
                f"| runtime {key} | {cells} | {r['prefill_tps']:.0f} | {r['weight_bytes_per_token'] / 1e9:.2f}"
                f" | {r['peak_memory_bytes'] / 1e9:.1f} |"
            )
    for key in ("transformers_quantlinear", "transformers_bf16"):
        if key in record:
            r = record[key]
            lines.append(
                f"| {key} generate | {r['decode_tps']:.1f} | "
                + " | ".join("-" for _ in batches[1:])
                + f" | {r['prefill_tps']:.0f} (128 tok) | | |"
            )
    lines.append(
        f"copy bandwidth {record.get('copy_bandwidth_gbs', 0):.0f} GB/s; rooflines "
        + ", ".join(f"{k} {v:.0f} tok/s" for k, v in record.get("roofline_tps", {}).items())
    )
    for key in FORMATS:
        if "greedy_vs_prefill" in record.get(key, {}):
            lines.append(f"{key} greedy decode vs prefill path: {record[key]['greedy_vs_prefill']}")
    for key in FORMATS:
        if "linear_kernels" in record.get(key, {}):
            lines.append(f"{key} kernels by batch: " + "; ".join(
                f"{name} " + ", ".join(f"{b}: {k}" for b, k in by_batch.items())
                for name, by_batch in record[key]["linear_kernels"].items()))
    for key in FORMATS:
        if "time_split_ms" in record.get(key, {}):
            lines.append(f"{key} batch-1 step (ms): "
                         + ", ".join(f"{k} {v:.3f}" for k, v in record[key]["time_split_ms"].items()))
        if "prefill_split_ms" in record.get(key, {}):
            lines.append(f"{key} prefill split (ms): "
                         + ", ".join(f"{k} {v:.2f}" for k, v in record[key]["prefill_split_ms"].items()))
        if "step_kernels" in record.get(key, {}):
            k = record[key]["step_kernels"]
            lines.append(f"{key} batch-1 step, eager, by kernel: {k['launches']} launches, {k['sum_us'] / 1e3:.3f} ms "
                         "of kernels; " + "; ".join(f"{r['name'][:40]} x{r['calls']} {r['us']:.0f} us"
                                                    for r in k["kernels"][:6]))
    if "fp8" in record and "bf16" in record:
        f, b = record["fp8"], record["bf16"]
        lines.append("fp8 / bf16: " + ", ".join(f"decode b={n} {f['decode_tps'][str(n)] / b['decode_tps'][str(n)]:.2f}x"
                                                for n in batches)
                     + f", prefill {f['prefill_tps'] / b['prefill_tps']:.2f}x (issue #42 asks >= 1.7x at b=1, "
                       ">= 1.4x prefill)")
    return "\n".join(lines)
