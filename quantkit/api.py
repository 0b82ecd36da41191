"""What scripts and the CLI call: quantize a model, load a checkpoint, measure perplexity.

Every function here is a thin composition of the library's parts: model loading, calibration data,
the walker with one method, the checkpoint writer and reader, the perplexity evaluator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantkit.calibrate.tokens import calibration_tokens, check_seqlen, max_positions  # noqa: F401  (re-exported)
from quantkit.calibrate.walker import LayerEvent, walk
from quantkit.checkpoint.settings import is_quantized_checkpoint  # noqa: F401  (re-exported)
from quantkit.config import CalibConfig, LoadConfig, QuantkitError, QuantScheme, resolve_device
from quantkit.defaults import (  # noqa: F401  (re-exported: the API's defaults are part of its surface)
    ASYM_DEFAULT_OPTIONS,
    AUTO_GROUP_SIZES,
    DEFAULT_CALIB_SIZE,
    DEFAULT_OPTIONS,
    DEFAULT_SYM,
    SELF_CALIB_CPU_SIZE,
    AutoScheme,
    choose_group_size,
    default_calibration,
    default_options,
)
from quantkit.distributed.launch import reports_rank_failures
from quantkit.distributed.launch import setup as setup_ranks
from quantkit.distributed.launch import teardown as teardown_ranks
from quantkit.methods.registry import METHOD_NAMES, build_method  # noqa: F401  (re-exported)
from quantkit.models.load import load_any  # noqa: F401  (re-exported)
from quantkit.preflight import check_output, check_text_source  # noqa: F401  (re-exported)
from quantkit.run_report import RunReport

if TYPE_CHECKING:
    from quantkit.models.load import LoadedModel

log = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True)
class QuantizeReport(RunReport):
    """The outcome of one INT4 quantization run (``to_dict`` is the CLI's ``--json`` object); the fields every run
    reports are :class:`quantkit.run_report.RunReport`'s."""

    scheme: QuantScheme
    partial_group_layers: list[str]
    engine_kernels: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    unquantized: list[str] = field(default_factory=list)  # weights no method reached (quantkit.coverage)
    compression_ratio: float = 0.0  # over all of the model's weights, 16-bit bytes / bytes written

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output, "method": self.method, "bits": self.scheme.bits,
            "group_size": self.scheme.group_size, "sym": self.scheme.sym, "n_quantized": self.n_quantized,
            "seconds": self.seconds(), "peak_memory_bytes": self.peak_memory_bytes, **self.memory(),
            "partial_group_layers": self.partial_group_layers,
            "engine_kernels": self.engine_kernels,
            "options": self.options,
            "unquantized": self.unquantized,
            "expert_tokens": _expert_tokens(self.layer_stats),
            "compression_ratio": round(self.compression_ratio, 4),
        }


def _expert_tokens(layer_stats: list[dict[str, Any]]) -> dict[str, Any]:
    from quantkit.moe.stats import expert_tokens

    return expert_tokens(layer_stats)


def partial_group_layers(model: torch.nn.Module, scheme: QuantScheme) -> list[str]:
    """Decoder linears whose input size the group size does not divide (a partial last group)."""
    from quantkit.arch import find_decoder_layers, find_linears

    if scheme.group_size == -1:
        return []
    prefix, layers = find_decoder_layers(model)
    return [
        f"{prefix}.{i}.{name}"
        for i, layer in enumerate(layers)
        for name, linear in find_linears(layer).items()
        if linear.in_features % scheme.group_size
    ]


def warn_partial_groups(names: list[str], model: torch.nn.Module, group_size: int) -> None:
    if not names:
        return
    modules = dict(model.named_modules())
    widths = sorted({modules[n].in_features for n in names})
    log.warning(
        "%d linear layers (input sizes %s, e.g. %s) are not a multiple of group size %d: their last group is "
        "partial and is stored through g_idx. quantkit's reader and kernels serve them; vLLM and SGLang's GPTQ "
        "kernels require input sizes divisible by the group size and will refuse this checkpoint "
        "(use --group-size 64 or 32 for them).",
        len(names), widths, names[0], group_size,
    )


def quantized_input_sizes(model: torch.nn.Module, quantize_lm_head: bool = False) -> list[int]:
    """Input sizes of every linear that will be quantized (the decoder's, and lm_head's when asked)."""
    from quantkit.arch import find_decoder_layers, find_linears

    _, layers = find_decoder_layers(model)
    sizes = {linear.in_features for layer in layers for linear in find_linears(layer).values()}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if quantize_lm_head and head is not None:
        sizes.add(head.in_features)
    return sorted(sizes)


def resolve_scheme(scheme: QuantScheme | AutoScheme | None, method: str, loaded: LoadedModel,
                   quantize_lm_head: bool) -> QuantScheme:
    """A fixed scheme as given; an automatic one with its group size chosen for this model (logged)."""
    if isinstance(scheme, QuantScheme):
        return scheme
    sizes = quantized_input_sizes(loaded.model, quantize_lm_head)
    resolved = (scheme or AutoScheme()).resolve(method, sizes)
    log.info("group size %d: the largest of %s dividing every quantized input size (%s); --group-size sets "
             "another", resolved.group_size, "/".join(map(str, AUTO_GROUP_SIZES)), ", ".join(map(str, sizes)))
    return resolved


def serving_kernels(scheme: QuantScheme, weights: dict, partial: list[str], layout: str) -> dict[str, str]:
    """The vLLM / SGLang kernel the written checkpoint gets (``quantkit.checkpoint.engines``)."""
    from quantkit.checkpoint.engines import CheckpointTraits, engine_kernels

    act_order = any(getattr(qw, "act_order", False) for qw in weights.values())
    return engine_kernels(CheckpointTraits(bits=scheme.bits, group_size=scheme.group_size, sym=scheme.sym,
                                           act_order=act_order, partial_groups=bool(partial), layout=layout))


@reports_rank_failures
def quantize(
    model: str,
    output: str | Path,
    *,
    method: str = "gptq",
    scheme: QuantScheme | AutoScheme | None = None,
    method_options: dict[str, Any] | None = None,
    calib: CalibConfig | None = None,
    load: LoadConfig = LoadConfig(),
    overwrite: bool = False,
    batch_size: int = 8,
    on_layer: Callable[[LayerEvent], None] | None = None,
    on_calib_progress: Callable[[int, int], None] | None = None,
    quantize_lm_head: bool = False,
    gpus: int | None = None,
    calib_tokens: torch.Tensor | None = None,
    progress: bool | None = None,
    activations: str = "auto",
    moe: Any = None,
) -> QuantizeReport:
    """Quantize ``model`` (folder, hub id or .gguf) with ``method`` and write a GPTQ-layout checkpoint.

    Defaults are the best measured settings (:func:`default_options`, ``DEFAULT_SYM``): ``scheme=None``
    is 4 bits with the group size chosen for the model (:class:`AutoScheme`); ``calib=None`` is
    :func:`default_calibration` (sized to the device). ``on_layer`` receives a
    :class:`~quantkit.calibrate.walker.LayerEvent` after each decoder layer and ``on_calib_progress(done, total)``
    follows self-generated calibration. Without them, progress is logged (``quantkit.progress``);
    ``progress=None`` also shows those lines on stderr in interactive sessions, ``False`` never.

    ``gpus``: under torchrun, the ranks share the work (``quantkit.distributed``; None: as many as
    torchrun started, else one process); rank 0 alone writes the checkpoint. ``calib_tokens``
    (``[nsamples, seqlen]``) replaces drawing windows from ``calib``: a batch computes them once per model.
    ``activations``: where the calibration hidden states live between layers: "auto" (on the device
    when they fit, see :func:`quantkit.calibrate.activations.offload_activations`), "device" or "host" (pinned).
    ``moe``: a :class:`quantkit.methods.moe.MoECalibConfig` for MoE models (None: its defaults).
    """
    from quantkit.progress import LogProgress, is_interactive, visible_logs

    show = is_interactive() if progress is None else progress
    logged = LogProgress()
    with visible_logs(show and on_layer is None):
        return _quantize(model, output, method=method, scheme=scheme, method_options=method_options, calib=calib,
                         load=load, overwrite=overwrite, batch_size=batch_size,
                         on_layer=on_layer or logged.on_layer,
                         on_calib_progress=on_calib_progress or logged.on_calibration,
                         quantize_lm_head=quantize_lm_head, gpus=gpus, calib_tokens=calib_tokens,
                         activations=activations, moe=moe)


def _quantize(model: str, output: str | Path, *, method: str, scheme: QuantScheme | AutoScheme | None,
              method_options: dict[str, Any] | None, calib: CalibConfig | None, load: LoadConfig, overwrite: bool,
              batch_size: int, on_layer: Callable, on_calib_progress: Callable,
              quantize_lm_head: bool, gpus: int | None, calib_tokens: torch.Tensor | None,
              activations: str = "auto", moe: Any = None) -> QuantizeReport:
    from quantkit.checkpoint.save import save_quantized
    from quantkit.models.lazy import open_model, peak_host_memory_bytes, plan_loading, stream_to_writer
    from quantkit.models.load import quiet_transformers

    t_start = time.perf_counter()
    out = check_output(output, overwrite)
    if method == "fp8":  # its own driver and layout (compressed-tensors); the scheme does not apply
        from quantkit.fp8_api import quantize_fp8
        from quantkit.methods.fp8 import fp8_config

        return quantize_fp8(model, out, config=fp8_config(method_options or {}), calib=calib, load=load,
                            overwrite=overwrite, batch_size=batch_size, on_layer=on_layer,
                            on_calib_progress=on_calib_progress, quantize_lm_head=quantize_lm_head,
                            activations=activations, calib_tokens=calib_tokens)
    method_options = dict(method_options or {})
    layout = method_options.pop("format", "gptq")
    if method not in METHOD_NAMES:
        raise QuantkitError(f"unknown method {method!r}; choose one of {', '.join(METHOD_NAMES)}")
    from quantkit.calibrate.activations import ACTIVATIONS

    if activations not in ACTIVATIONS:
        raise QuantkitError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    # Options are checked before the model loads (the scheme may still depend on the model).
    from quantkit import preflight

    auto_bits = scheme.bits if isinstance(scheme, AutoScheme) else 4
    probe = build_method(method, scheme if isinstance(scheme, QuantScheme) else QuantScheme(bits=auto_bits),
                         method_options)
    preflight.check_model_spec(model)  # a missing model is said before the loading line, not after it
    if quantize_lm_head:
        preflight.check_output_head_rows(preflight.vocab_size(model),
                                         scheme.bits if isinstance(scheme, QuantScheme) else auto_bits)
    comm, device = setup_ranks(gpus, resolve_device(load.device))
    calib = calib or default_calibration(method, device=device)
    if probe.needs_calibration:
        from quantkit.calib_data.sources import NAMED_SOURCES

        check_text_source(calib.source, NAMED_SOURCES, "--calib")
        if calib_tokens is None:
            preflight.check_seqlen(model, calib.seqlen)  # from config.json alone; again once loaded
    plan = plan_loading(model, load, world_size=comm.world_size, self_calibration=probe.needs_calibration
                        and calib_tokens is None and calib.source == "self")
    log.info("loading: %s", plan.reason)
    loaded, source = open_model(model, load, plan)
    if method == "awq":
        # AWQ folds scales through per-family records; without one it would only clip and round.
        from quantkit.arch import require_arch

        require_arch(getattr(loaded.model.config, "model_type", "?"))
    from quantkit.methods.moe_prepare import prepare_layout, wrap_method

    prepare_layout(loaded.model)  # MoE: experts as per-expert linears (a streamed model already is)
    scheme = resolve_scheme(scheme, method, loaded, quantize_lm_head)
    head = loaded.model.get_output_embeddings() if quantize_lm_head else None
    if head is not None:  # GGUF files and hub ids not cached have no config.json to read it from before the load
        preflight.check_output_head_rows(head.weight.shape[0], scheme.bits)
    quant_method = wrap_method(loaded.model, build_method(method, scheme, method_options), moe)
    t_loaded = time.perf_counter()

    token_ids = None
    if quant_method.needs_calibration:
        token_ids = calib_tokens
        if token_ids is None:
            token_ids = calibration_tokens(calib, loaded, on_calib_progress) if comm.rank == 0 else None
            token_ids = comm.broadcast_object(token_ids, src=0)  # every rank calibrates on rank 0's windows
    t_calib = time.perf_counter()

    partial = partial_group_layers(loaded.model, scheme)
    warn_partial_groups(partial, loaded.model, scheme.group_size)
    writer = None if source is None else stream_to_writer(loaded, source, out, scheme=scheme, layout=layout,
                                                          overwrite=overwrite)
    try:
        result = walk(loaded.model, quant_method, device=device, token_ids=token_ids, batch_size=batch_size,
                      on_layer=on_layer if comm.rank == 0 else None, quantize_lm_head=quantize_lm_head, comm=comm,
                      activations=activations, source=source)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    t_quant = time.perf_counter()
    from quantkit.coverage import warn_unreached, weight_coverage

    coverage = weight_coverage(loaded.model, result.weights)
    warn_unreached(coverage)

    extra = {"source_model": model, "method": method, "layer_seconds": result.seconds}
    if token_ids is not None:
        extra["calibration"] = {"source": calib.source, "nsamples": int(token_ids.shape[0]),
                                "seqlen": int(token_ids.shape[1]), "seed": calib.seed}
    checkpoint_extra = getattr(quant_method, "checkpoint_extra", None)
    if checkpoint_extra is not None:
        extra.update(checkpoint_extra())
    loaded.restore_config()  # the checkpoint carries the model's own use_cache, not the calibration setting
    comm.barrier()  # every rank finished its share before rank 0 writes
    if comm.rank == 0:
        with quiet_transformers():
            save_quantized(loaded.model, result.weights, out, tokenizer=loaded.tokenizer, method=method,
                           scheme=scheme, extra=extra, overwrite=overwrite, layout=layout, writer=writer)
    teardown_ranks(comm)
    t_end = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return QuantizeReport(
        output=str(out), method=method, scheme=scheme, n_quantized=len(result.weights),
        seconds_total=t_end - t_start, seconds_load=t_loaded - t_start, seconds_calibration=t_calib - t_loaded,
        seconds_quantize=t_quant - t_calib, seconds_save=t_end - t_quant, peak_memory_bytes=peak,
        partial_group_layers=partial, layer_stats=result.layer_stats, streamed=source is not None,
        peak_host_memory_bytes=peak_host_memory_bytes(),
        engine_kernels=serving_kernels(scheme, result.weights, partial, layout),
        options={**default_options(method, scheme), **method_options, "format": layout},
        unquantized=list(coverage.unreached), compression_ratio=coverage.compression_ratio,
    )


def evaluate_perplexity(
    model: str,
    *,
    data: str = "wikitext2",
    seqlen: int = 2048,
    max_windows: int | None = None,
    bos: str = "auto",
    load: LoadConfig = LoadConfig(),
    text_field: str = "text",
    on_window: Callable | None = None,
):
    """Perplexity of a model or quantized checkpoint on a named source or local file (GPTQ protocol).

    ``bos``: ``auto`` starts every window with BOS when the model's tokenizer expects one; ``on``/``off`` force it.
    ``on_window(done, total, running_ppl, seconds)`` follows the windows (``seconds`` since the first began).
    """
    from quantkit.eval.perplexity import EVAL_SOURCES, load_eval_tokens, needs_bos, perplexity

    if bos not in ("auto", "on", "off"):
        raise QuantkitError(f"--bos must be auto, on or off, got {bos!r}")
    if max_windows is not None and max_windows < 1:
        raise QuantkitError(f"--max-windows must be at least 1, got {max_windows}")
    check_text_source(str(data), EVAL_SOURCES, "--data")  # before the model load, which takes long
    device = resolve_device(load.device)
    net, tokenizer = load_any(model, load)
    if tokenizer is None:
        raise QuantkitError(f"{model} has no tokenizer files; perplexity needs one")
    token_ids = load_eval_tokens(data, tokenizer, text_field=text_field)
    check_seqlen(net, seqlen)
    use_bos = needs_bos(tokenizer, net.config) if bos == "auto" else bos == "on"
    if use_bos and tokenizer.bos_token_id is None:
        raise QuantkitError("--bos on, but the tokenizer has no BOS token")
    started = time.perf_counter()

    def timed(done: int, total: int, running_ppl: float) -> None:
        on_window(done, total, running_ppl, time.perf_counter() - started)

    return perplexity(net.to(device), token_ids, seqlen=seqlen, max_windows=max_windows,
                      bos_token_id=tokenizer.bos_token_id if use_bos else None, device=device,
                      on_window=timed if on_window is not None else None)


def evaluate_kld(
    base: str,
    quantized: str,
    *,
    data: str = "wikitext2",
    seqlen: int = 512,
    max_windows: int | None = 8,
    bos: str = "auto",
    load: LoadConfig = LoadConfig(),
    text_field: str = "text",
    on_window: Callable | None = None,
):
    """KL divergence of ``quantized``'s next-token distributions from ``base``'s on windows of ``data``
    (:class:`~quantkit.eval.kld.KLDResult`). Both models are loaded; base logits are computed chunk by chunk."""
    from quantkit.eval.kld import LiveReference, kld_windows, model_kld
    from quantkit.eval.perplexity import _vocab_size, load_eval_tokens, needs_bos

    if bos not in ("auto", "on", "off"):
        raise QuantkitError(f"--bos must be auto, on or off, got {bos!r}")
    from dataclasses import replace

    from quantkit.config import resolve_dtype

    device = resolve_device(load.device)
    # Both models in one dtype (auto: float32 on the CPU, bfloat16 on CUDA), whatever the checkpoint stores.
    load = replace(load, dtype=str(resolve_dtype(load.dtype, device)).removeprefix("torch."))
    base_net, tokenizer = load_any(base, load)
    quant_net, _ = load_any(quantized, load)
    if tokenizer is None:
        raise QuantkitError(f"{base} has no tokenizer files; KL divergence needs one")
    base_vocab = _vocab_size(base_net, base_net.get_output_embeddings())
    quant_vocab = _vocab_size(quant_net, quant_net.get_output_embeddings())
    if base_vocab != quant_vocab:
        raise QuantkitError(f"{base} has {base_vocab} output tokens but {quantized} has {quant_vocab}: "
                            "KL divergence compares a model with a quantized copy of itself")
    use_bos = needs_bos(tokenizer, base_net.config) if bos == "auto" else bos == "on"
    if use_bos and tokenizer.bos_token_id is None:
        raise QuantkitError("--bos on, but the tokenizer has no BOS token")
    token_ids = load_eval_tokens(data, tokenizer, text_field=text_field)
    windows = kld_windows(token_ids, seqlen=seqlen, max_windows=max_windows,
                          bos_token_id=tokenizer.bos_token_id if use_bos else None)
    reference = LiveReference(base_net.to(device), windows, device)
    return model_kld(reference, quant_net.to(device), windows, device=device, on_window=on_window)


def load_quantized(path: str | Path, *, device: str = "cpu", dtype: torch.dtype | str | None = None):
    """(model, tokenizer) from a GPTQ (v1/v2) or AutoAWQ GEMM checkpoint, quantized linears served by QuantLinear.

    ``dtype``: None keeps the checkpoint's saved dtype, ``"auto"`` is bfloat16 on CUDA and float32 on the
    CPU, or a dtype (name) forces one. Weights missing from the files, or tensors the model does not
    have, are a ``QuantkitError`` naming them.
    """
    from quantkit.checkpoint.read import load_quantized as read_checkpoint

    return read_checkpoint(path, device=device, dtype=dtype)


def inspect(path: str | Path):
    """What a checkpoint holds (see ``quantkit.checkpoint.inspect.inspect_checkpoint``)."""
    from quantkit.checkpoint.inspect import inspect_checkpoint

    return inspect_checkpoint(path)
