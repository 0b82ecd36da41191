"""``quantkit rtn|gptq|awq MODEL -o OUT``: one shared runner, three thin option sets."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from quantkit.cli.options import (
    BatchSize,
    Bits,
    Calib,
    Device,
    Dtype,
    GroupSize,
    Json,
    LmHead,
    ModelArg,
    NSamples,
    Output,
    Overwrite,
    SaveStats,
    Seed,
    Stream,
    TextField,
    Threads,
    TrustRemoteCode,
    apply_threads,
    say_threads,
)


def _run(method: str, model: str, output: Path, *, bits: int, group_size: int | None, sym: bool, device: str,
         dtype: str, trust_remote_code: bool, overwrite: bool, as_json: bool, options: dict[str, Any] | None = None,
         calib: str = "self", nsamples: int | None = None, seqlen: int | None = None, seed: int = 0,
         text_field: str = "text", batch_size: int = 8, save_stats: Path | None = None,
         quantize_lm_head: bool = False, gpus: int | None = None, activations: str = "auto",
         stream: str = "auto", threads: int | None = None, moe: Any = None) -> None:
    choice = apply_threads(threads)  # before torch is imported; said once the checks below pass
    from quantkit import api, preflight
    from quantkit.cli import display
    from quantkit.config import LoadConfig, QuantScheme, resolve_device
    from quantkit.distributed.launch import is_secondary_rank, launch_cli, needs_launch

    # Every check that needs no weights, before anything is printed or loaded.
    preflight.check_scheme(bits, group_size, sym)
    api.check_output(output, overwrite)
    scheme = api.AutoScheme(bits=bits, sym=sym) if group_size is None else QuantScheme(bits, group_size, sym)
    load = LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code, stream=stream)
    calib_config = api.default_calibration(method, calib, resolve_device(device), nsamples=nsamples, seqlen=seqlen,
                                           seed=seed, text_field=text_field)
    needs_calib = method != "rtn"
    preflight.check_quantize(model, bits=bits, group_size=group_size, sym=sym,
                             seqlen=calib_config.seqlen if needs_calib else None,
                             calib_source=calib_config.source if needs_calib else None)
    say_threads(choice)
    if needs_launch(gpus):  # start `gpus` ranks through torchrun, each running this same command line
        if choice.source == "auto":  # the ranks share the free cores (they read OMP_NUM_THREADS)
            import os

            os.environ["OMP_NUM_THREADS"] = str(max(1, choice.threads // gpus))
        launch_cli(method, gpus)
        return
    console = display.console(stderr=as_json)
    with display.LayerProgress(console, method) as progress, display.library_logs(progress.view):
        report = api.quantize(model, output, method=method, scheme=scheme, method_options=options,
                              calib=calib_config, load=load, overwrite=overwrite, batch_size=batch_size,
                              on_layer=progress.on_layer, on_calib_progress=progress.on_calibration,
                              quantize_lm_head=quantize_lm_head, gpus=gpus, activations=activations, moe=moe)
    if is_secondary_rank():  # rank 0 alone reports
        return
    if save_stats is not None:
        display.save_layer_stats(report, save_stats, console)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        display.print_quantize_summary(console, report)


Activations = Annotated[str, typer.Option(
    "--activations", metavar="auto|device|host",
    help="Where calibration hidden states live between layers: on the GPU (device), in pinned host memory "
         "(host), or auto (on the GPU when inputs and outputs take at most a quarter of its memory).")]

# Help texts say why each default was chosen (numbers: README, "Quality and speed", SmolLM2 W4).
_SYM_HELP = ("Symmetric grid (default: vLLM and SGLang serve symmetric GPTQ with Marlin/Machete) or asymmetric "
             "(zero points: lower perplexity, but those engines fall back to their float16-only gptq_gemm).")
_RTN_SYM_HELP = ("Symmetric grid (default: Marlin/Machete in vLLM and SGLang) or asymmetric (lower error, served "
                 "by their slower gptq_gemm).")
_DESC_ACT_HELP = ("Act-order: quantize columns by decreasing Hessian diagonal (default: the largest gain measured, "
                  "SmolLM2 sym g64 28.32 -> 24.05).")
_STATIC_HELP = ("With act-order, fix each group's scale before reordering so g_idx stays contiguous. Default: on "
                "with --sym (no reordering at inference), off with --asym (a permuted g_idx, lower perplexity; "
                "asymmetric GPTQ gets gptq_gemm, which reorders anyway).")
_MSE_HELP = ("Search each group's range (shrink up to 20%) for the least error (default: about 15% more time, "
             "SmolLM2 g64 23.01 -> 22.50).")

_MOE_CALIB_HELP = ("MoE models: send every calibration token through every expert (all: each expert's Hessian from "
                   "all tokens, the layer passes on only routed outputs; lower error on the measured tiny MoE, "
                   "docs/moe.md) or only the routed tokens (routed).")
_MOE_MIN_HELP = ("MoE models: an expert whose Hessian saw fewer tokens than this (routed mode) is rounded to nearest "
                 "instead, named in a warning.")


class MseWeight(str, Enum):
    """``GPTQConfig.mse_weight``'s values (``quantkit.methods.gptq.MSE_WEIGHTS``; not imported here: torch)."""

    none = "none"
    hessian = "hessian"
    residual = "residual"


_MSE_WEIGHT_DEFAULT = "hessian"
_MSE_WEIGHT_HELP = ("Weight each column's error in the --mse search by its input's energy H_jj, squared error "
                    "(hessian: SmolLM2 asym g64 22.63 -> 22.17 on an H200), or not (none: |error|^2.4, the peers' "
                    "observer); residual: 1/U_jj^2 (22.71).")


def register(app: typer.Typer) -> None:
    @app.command("rtn")
    def rtn(model: ModelArg, output: Output, bits: Bits = 4, group_size: GroupSize = None,
            sym: Annotated[bool, typer.Option("--sym/--asym", help=_RTN_SYM_HELP)] = True,
            device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
            overwrite: Overwrite = False, json_: Json = False, save_stats: SaveStats = None,
            quantize_lm_head: LmHead = False, stream: Stream = "auto", threads: Threads = None) -> None:
        """Round-to-nearest baseline: per-group min/max (asym) or absmax (sym) scales, no calibration."""
        _run("rtn", model, output, bits=bits, group_size=group_size, sym=sym, device=device, dtype=dtype,
             trust_remote_code=trust_remote_code, overwrite=overwrite, as_json=json_, save_stats=save_stats,
             quantize_lm_head=quantize_lm_head, stream=stream, threads=threads)

    @app.command("gptq")
    def gptq(model: ModelArg, output: Output, bits: Bits = 4, group_size: GroupSize = None,
             sym: Annotated[bool, typer.Option("--sym/--asym", help=_SYM_HELP)] = True,
             calib: Calib = "self", nsamples: NSamples = None,
             seqlen: Annotated[int | None, typer.Option(
                 "--seqlen", show_default="2048; 512 for --calib self on a CPU", help="Tokens per window.")] = None,
             seed: Seed = 0, text_field: TextField = "text",
             damp: Annotated[float, typer.Option("--damp", help="Dampening, fraction of the mean Hessian diagonal.")] = 0.01,
             block_size: Annotated[int, typer.Option("--block-size", help="Columns per lazy-update block.")] = 128,
             desc_act: Annotated[bool, typer.Option("--desc-act/--no-desc-act", help=_DESC_ACT_HELP)] = True,
             static_groups: Annotated[bool | None, typer.Option("--static-groups/--no-static-groups", help=_STATIC_HELP,
                                                                show_default="on with --sym, off with --asym")] = None,
             true_sequential: Annotated[bool, typer.Option("--true-sequential/--no-true-sequential", help="Quantize attention, then o_proj, then MLP on already quantized inputs.")] = True,
             mse: Annotated[bool, typer.Option("--mse/--no-mse", help=_MSE_HELP)] = True,
             mse_weight: Annotated[MseWeight | None, typer.Option("--mse-weight", help=_MSE_WEIGHT_HELP,
                                                                  show_default=_MSE_WEIGHT_DEFAULT)] = None,
             device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
             batch_size: BatchSize = 8, overwrite: Overwrite = False, json_: Json = False,
             save_stats: SaveStats = None, quantize_lm_head: LmHead = False,
             gpus: Annotated[int | None, typer.Option("--gpus", help="Ranks to share the work (torchrun; one GPU each, gloo on the CPU).")] = None,
             activations: Activations = "auto",
             stream: Stream = "auto", threads: Threads = None,
             moe_calib: Annotated[str, typer.Option("--moe-calib", metavar="all|routed", help=_MOE_CALIB_HELP)] = "all",
             moe_min_tokens: Annotated[int, typer.Option("--moe-min-tokens", help=_MOE_MIN_HELP)] = 8,
    ) -> None:
        """GPTQ: column-by-column rounding with inverse-Hessian error compensation."""
        from quantkit.methods.moe import MoECalibConfig

        moe = MoECalibConfig(mode=moe_calib, min_tokens=moe_min_tokens)
        options = dict(damp=damp, block_size=block_size, desc_act=desc_act, true_sequential=true_sequential, mse=mse)
        if static_groups is not None:  # else the grid's default (quantkit.defaults.default_options)
            options["static_groups"] = static_groups
        if mse_weight is not None:  # else the default (quantkit.defaults.DEFAULT_OPTIONS)
            options["mse_weight"] = mse_weight.value
        _run("gptq", model, output, bits=bits, group_size=group_size, sym=sym, device=device, dtype=dtype,
             trust_remote_code=trust_remote_code, overwrite=overwrite, as_json=json_, options=options, calib=calib,
             nsamples=nsamples, seqlen=seqlen, seed=seed, text_field=text_field, batch_size=batch_size,
             save_stats=save_stats, quantize_lm_head=quantize_lm_head, gpus=gpus, activations=activations,
             stream=stream, threads=threads, moe=moe)

    @app.command("awq")
    def awq(model: ModelArg, output: Output, bits: Bits = 4, group_size: GroupSize = None,
            sym: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric or asymmetric grid (default: AWQ's "
                                              "zero points, its measured best).")] = False,
            calib: Calib = "self", nsamples: NSamples = None,
            seqlen: Annotated[int | None, typer.Option("--seqlen", show_default="512", help="Tokens per window.")] = None,
            seed: Seed = 0, text_field: TextField = "text",
            grid: Annotated[int, typer.Option("--grid", help="Points of the scale-exponent grid over [0, 1].")] = 20,
            clip: Annotated[bool, typer.Option("--clip/--no-clip", help="Search a clipping range per group (default: 24.72 -> 24.36 on SmolLM2 g128).")] = True,
            gptq: Annotated[bool, typer.Option("--gptq/--no-gptq", help="Round with GPTQ after the AWQ scaling.")] = False,
            fmt: Annotated[str | None, typer.Option("--format", help="Checkpoint layout: gptq (default) or awq (AWQ GEMM: awq_marlin in vLLM/SGLang).")] = None,
            device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
            batch_size: BatchSize = 8, overwrite: Overwrite = False, json_: Json = False,
            save_stats: SaveStats = None, quantize_lm_head: LmHead = False,
            gpus: Annotated[int | None, typer.Option("--gpus", help="Ranks to share the work (torchrun; one GPU each, gloo on the CPU).")] = None,
            activations: Activations = "auto",
            stream: Stream = "auto", threads: Threads = None,
    ) -> None:
        """AWQ: activation-aware scaling of salient input channels, folded into the previous op, then rounding."""
        options: dict[str, Any] = dict(grid=grid, clip=clip, gptq=gptq)
        if fmt is not None:
            options["format"] = fmt
        _run("awq", model, output, bits=bits, group_size=group_size, sym=sym, device=device, dtype=dtype,
             trust_remote_code=trust_remote_code, overwrite=overwrite, as_json=json_, options=options, calib=calib,
             nsamples=nsamples, seqlen=seqlen, seed=seed, text_field=text_field, batch_size=batch_size,
             save_stats=save_stats, quantize_lm_head=quantize_lm_head, gpus=gpus, activations=activations,
             stream=stream, threads=threads)
