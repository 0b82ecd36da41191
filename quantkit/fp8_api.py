"""``quantize_fp8``: a model to an FP8 checkpoint (compressed-tensors), through the same parts as the INT4 methods:
model loading (whole or streamed from disk), calibration windows (static activations only), the one walker with
:class:`quantkit.methods.fp8.FP8Method`, and the one checkpoint writer (:mod:`quantkit.checkpoint.fp8`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.config import CalibConfig, LoadConfig, QuantkitError, resolve_device
from quantkit.methods.fp8 import FP8Config, FP8Method
from quantkit.run_report import RunReport

log = logging.getLogger(__name__)

# Linears that stay 16-bit unless asked: MoE routers (their outputs pick experts; vLLM keeps them 16-bit).
ROUTER_NAMES = ("gate", "router")


def is_router(name: str) -> bool:
    """A decoder layer's router by its last path component (``mlp.gate``, ``block_sparse_moe.gate``, ``router``)."""
    return name.rpartition(".")[2] in ROUTER_NAMES


@dataclass(frozen=True, kw_only=True)
class FP8Report(RunReport):
    """The outcome of one FP8 run (``to_dict`` is the CLI's ``--json`` object); the fields every run reports are
    :class:`quantkit.run_report.RunReport`'s."""

    config: FP8Config
    ignored: list[str]
    method: str = "fp8"
    unquantized: list[str] = field(default_factory=list)  # weights no method reached (quantkit.coverage)
    compression_ratio: float = 0.0  # 16-bit bytes of all weights / bytes as written

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "method": "fp8", "weights": self.config.weights,
                "activations": self.config.activations, "block": list(self.config.block),
                "n_quantized": self.n_quantized, "ignored": self.ignored, "unquantized": self.unquantized,
                "compression_ratio": self.compression_ratio, "seconds": self.seconds(), **self.memory(),
                "engines": {"vllm": "CompressedTensorsW8A8Fp8", "sglang": "CompressedTensorsW8A8Fp8"}}


def quantize_fp8(
    model: str,
    output: str | Path,
    *,
    config: FP8Config = FP8Config(),
    calib: CalibConfig | None = None,
    load: LoadConfig = LoadConfig(),
    overwrite: bool = False,
    batch_size: int = 8,
    on_layer: Callable | None = None,
    on_calib_progress: Callable | None = None,
    quantize_lm_head: bool = False,
    quantize_router: bool = False,
    activations: str = "auto",
    calib_tokens: torch.Tensor | None = None,
) -> FP8Report:
    """Quantize ``model`` (folder, hub id or .gguf) to FP8 e4m3 and write a compressed-tensors checkpoint.

    Weights: ``config.weights`` scales (channel default). Activations: per token at run time, or
    ``config.activations="static"``: one scale per linear from ``calib`` windows (default: the GPTQ-sized
    ``default_calibration``). lm_head and routers stay 16-bit unless ``quantize_lm_head`` / ``quantize_router``.
    ``on_layer`` gets a :class:`quantkit.calibrate.walker.LayerEvent` per decoder layer (else progress is logged).
    ``calib_tokens`` ``[nsamples, seqlen]`` replaces drawing windows from ``calib`` (a batch computes them once).
    """
    from quantkit.calibrate.tokens import calibration_tokens
    from quantkit.calibrate.walker import walk
    from quantkit.checkpoint.fp8_save import open_fp8_writer, save_fp8
    from quantkit.defaults import default_calibration
    from quantkit.models.lazy import open_model, peak_host_memory_bytes, plan_loading, stream_shard_bytes
    from quantkit.models.load import quiet_transformers
    from quantkit.preflight import check_output, check_text_source
    from quantkit.progress import LogProgress

    t_start = time.perf_counter()
    out = check_output(output, overwrite)
    method = FP8Method(config)
    device = resolve_device(load.device)
    if method.needs_calibration:
        from quantkit.calib_data.sources import NAMED_SOURCES

        calib = calib or default_calibration("gptq", device=device)
        check_text_source(calib.source, NAMED_SOURCES, "--calib")
    logged = LogProgress()
    plan = plan_loading(model, load, self_calibration=method.needs_calibration and calib_tokens is None
                        and calib.source == "self")
    log.info("loading: %s", plan.reason)
    loaded, source = open_model(model, load, plan)
    from quantkit.methods.moe_prepare import prepare_layout
    from quantkit.moe.experts import find_separate_experts

    prepare_layout(loaded.model)  # MoE: every expert as its own linear, rounded like any other (streamed: already)
    if method.needs_calibration and find_separate_experts(loaded.model):
        raise QuantkitError("static FP8 activation scales (--calib) are not supported on MoE experts; drop --calib "
                            "(activations are then quantized per token at run time, the default)")
    t_loaded = time.perf_counter()
    token_ids = None
    if method.needs_calibration:
        token_ids = calib_tokens if calib_tokens is not None else \
            calibration_tokens(calib, loaded, on_calib_progress or logged.on_calibration)
    t_calib = time.perf_counter()
    writer = None
    if source is not None:  # streamed: each decoder layer is written as soon as it is quantized
        from quantkit.checkpoint.save import add_layer

        writer = open_fp8_writer(loaded.model, out, config, overwrite=overwrite,
                                 max_shard_bytes=stream_shard_bytes(Path(loaded.source).expanduser()))
        writer.file_sources = source.writer_sources()  # embedding / head: copied file to shard, never held
        source.on_finish = lambda prefix, layer, weights: add_layer(writer, layer, prefix, weights)
    skip = (lambda name: False) if quantize_router else is_router
    try:
        result = walk(loaded.model, method, device=device, token_ids=token_ids, batch_size=batch_size, skip=skip,
                      on_layer=on_layer or logged.on_layer, quantize_lm_head=quantize_lm_head,
                      activations=activations, source=source)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    t_quant = time.perf_counter()
    extra: dict[str, Any] = {"source_model": model}
    if token_ids is not None:
        extra["calibration"] = {"source": calib.source, "nsamples": int(token_ids.shape[0]),
                                "seqlen": int(token_ids.shape[1]), "seed": calib.seed}
    loaded.restore_config()
    with quiet_transformers():
        save_fp8(loaded.model, result.weights, out, config=config, tokenizer=loaded.tokenizer, extra=extra,
                 overwrite=overwrite, writer=writer)
    from quantkit.checkpoint.fp8 import unquantized_linears
    from quantkit.coverage import warn_unreached, weight_coverage

    coverage = weight_coverage(loaded.model, result.weights)
    warn_unreached(coverage)
    t_end = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return FP8Report(output=str(out), config=config, n_quantized=len(result.weights), seconds_total=t_end - t_start,
                     seconds_load=t_loaded - t_start, seconds_calibration=t_calib - t_loaded,
                     seconds_quantize=t_quant - t_calib, seconds_save=t_end - t_quant, peak_memory_bytes=peak,
                     peak_host_memory_bytes=peak_host_memory_bytes(), streamed=source is not None,
                     ignored=unquantized_linears(loaded.model, result.weights), layer_stats=result.layer_stats,
                     unquantized=list(coverage.unreached), compression_ratio=coverage.compression_ratio)


def check_fp8_options(weights: str, activations: str, block: tuple[int, int]) -> FP8Config:
    """The config for the CLI's options, refused (QuantkitError, exit 2) before anything loads."""
    if len(block) != 2:
        raise QuantkitError(f"--block takes two numbers (rows columns), got {list(block)}")
    return FP8Config(weights=weights, activations=activations, block=tuple(block))


def install_fp8_linears(model: torch.nn.Module, weights: dict) -> torch.nn.Module:
    """Swap each linear named in ``weights`` (full name -> :class:`quantkit.methods.fp8.FP8Weight`) for an
    :class:`quantkit.fp8_linear.FP8Linear` holding that record: the in-memory quantized model, computing
    what the written checkpoint computes (activations quantized too). Returns ``model``."""
    from quantkit.fp8_linear import FP8Linear

    for name, w in weights.items():
        old = model.get_submodule(name)
        module = FP8Linear(w.in_features, w.out_features, w.strategy, block=w.block,
                           static_input=w.input_scale is not None, bias=w.bias is not None,
                           device=old.weight.device, dtype=old.weight.dtype)
        device = old.weight.device
        module._buffers.update(weight=w.weight.to(device), weight_scale=w.weight_scale.float().to(device),
                               input_scale=None if w.input_scale is None else w.input_scale.float().to(device))
        if w.bias is not None:
            module.bias.data.copy_(w.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    return model
