"""``quantkit fp8 MODEL -o OUT``: E4M3 weights and activations in the compressed-tensors layout vLLM and SGLang load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from quantkit.cli.options import (
    BatchSize,
    Device,
    Dtype,
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

_WEIGHTS_HELP = ("Weight scales: channel (one per output channel, llm-compressor's FP8_DYNAMIC), tensor (one per "
                 "linear), or block (one per --block of weights, DeepSeek-V3 style).")
_CALIB_HELP = ("Calibrate one static activation scale per linear on this text (self, wikitext2, c4, ... or a local "
               "file). Without it activations are quantized per token at run time (no calibration).")


def _summary(con, report) -> None:
    from rich.table import Table

    from quantkit.cli.display import human_bytes

    table = Table(title=f"quantkit fp8: {report.output}", show_header=False)
    cfg = report.config
    act = "static per tensor (calibrated)" if cfg.activations == "static" else "dynamic per token"
    weights = f"block {cfg.block[0]}x{cfg.block[1]}" if cfg.weights == "block" else f"per {cfg.weights}"
    table.add_row("scheme", f"FP8 e4m3 weights {weights}, activations {act}")
    table.add_row("quantized linears", str(report.n_quantized))
    table.add_row("kept 16-bit", ", ".join(report.ignored) or "-")
    table.add_row("time", f"{report.seconds_total:.1f} s (load {report.seconds_load:.1f}, calibration "
                  f"{report.seconds_calibration:.1f}, layers {report.seconds_quantize:.1f}, "
                  f"save {report.seconds_save:.1f})")
    table.add_row("loading", "streamed from disk, layer by layer" if report.streamed else "whole model in memory")
    table.add_row("peak host memory", human_bytes(report.peak_host_memory_bytes))
    table.add_row("vLLM / SGLang", "compressed-tensors CompressedTensorsW8A8Fp8 (compute capability 8.9+)")
    con.print(table)


def register(app: typer.Typer) -> None:
    @app.command("fp8")
    def fp8(model: ModelArg, output: Output,
            weights: Annotated[str, typer.Option("--weights", metavar="channel|tensor|block", help=_WEIGHTS_HELP)]
            = "channel",
            block: Annotated[tuple[int, int], typer.Option("--block", help="Rows and columns of a weight block.")]
            = (128, 128),
            calib: Annotated[str | None, typer.Option("--calib", help=_CALIB_HELP)] = None,
            nsamples: NSamples = None,
            seqlen: Annotated[int | None, typer.Option("--seqlen", show_default="2048; 512 for --calib self on a "
                                                       "CPU", help="Tokens per calibration window.")] = None,
            seed: Seed = 0, text_field: TextField = "text",
            quantize_router: Annotated[bool, typer.Option("--quantize-router", help="Also quantize MoE routers "
                                                          "(gate/router linears); default: 16 bits.")] = False,
            device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
            batch_size: BatchSize = 8, overwrite: Overwrite = False, json_: Json = False,
            save_stats: SaveStats = None, quantize_lm_head: LmHead = False, stream: Stream = "auto",
            threads: Threads = None) -> None:
        """FP8 (E4M3): weights per channel, activations per token at run time; the compressed-tensors checkpoint
        vLLM and SGLang serve. Norms, embeddings, lm_head and routers stay 16-bit unless asked."""
        choice = apply_threads(threads)  # before torch is imported; said once the checks below pass
        from quantkit import api, preflight
        from quantkit.cli import display
        from quantkit.config import LoadConfig, resolve_device
        from quantkit.fp8_api import check_fp8_options, quantize_fp8

        # every option is checked before the model loads (exit 2, no traceback)
        config = check_fp8_options(weights, "static" if calib is not None else "dynamic", block)
        load = LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code, stream=stream)
        calib_config = None
        if calib is not None:
            calib_config = api.default_calibration("gptq", calib, resolve_device(device), nsamples=nsamples,
                                                   seqlen=seqlen, seed=seed, text_field=text_field)
        elif nsamples is not None or seqlen is not None:
            raise api.QuantkitError("--nsamples / --seqlen size calibration, which only --calib asks for")
        api.check_output(output, overwrite)
        if calib_config is not None:
            from quantkit.calib_data.sources import NAMED_SOURCES

            api.check_text_source(calib_config.source, NAMED_SOURCES, "--calib")
        preflight.check_model_spec(model)  # after the options, before any load
        if calib_config is not None:
            from quantkit.arch import arch_for

            spec = arch_for(preflight.model_type(model) or "")
            if spec is not None and spec.moe is not None:  # quantize_fp8 says the same after loading otherwise
                raise api.QuantkitError(f"static FP8 activation scales (--calib) are not supported on MoE experts "
                                        f"({spec.family}); drop --calib (activations are then quantized per token "
                                        "at run time, the default)")
        say_threads(choice)
        console = display.console(stderr=json_)
        with display.LayerProgress(console, "fp8") as progress, display.library_logs(console):
            report = quantize_fp8(model, output, config=config, calib=calib_config, load=load, overwrite=overwrite,
                                  batch_size=batch_size, on_layer=progress.on_layer,
                                  on_calib_progress=progress.on_calibration, quantize_lm_head=quantize_lm_head,
                                  quantize_router=quantize_router)
        if save_stats is not None:
            display.save_layer_stats(report, Path(save_stats), console)
        if json_:
            typer.echo(json.dumps(report.to_dict(), indent=2))
        else:
            _summary(console, report)
