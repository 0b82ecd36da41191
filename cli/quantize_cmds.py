"""``quantkit rtn|gptq|awq MODEL -o OUT``: one shared runner, three thin option sets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from quantkit.cli import display
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
    SeqLen,
    Sym,
    TextField,
    TrustRemoteCode,
)


def _run(method: str, model: str, output: Path, *, bits: int, group_size: int, sym: bool, device: str, dtype: str,
         trust_remote_code: bool, overwrite: bool, as_json: bool, options: dict[str, Any] | None = None,
         calib: str = "self", nsamples: int = 128, seqlen: int = 2048, seed: int = 0, text_field: str = "text",
         batch_size: int = 8, save_stats: Path | None = None, quantize_lm_head: bool = False,
         gpus: int | None = None) -> None:
    from quantkit import api
    from quantkit.config import CalibConfig, LoadConfig, QuantScheme
    from quantkit.distributed.launch import is_secondary_rank, launch_cli, needs_launch

    scheme = QuantScheme(bits=bits, group_size=group_size, sym=sym)
    load = LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    calib_config = CalibConfig(source=calib, nsamples=nsamples, seqlen=seqlen, seed=seed, text_field=text_field)
    api.check_output(output, overwrite)  # fail before loading anything
    if needs_launch(gpus):  # start `gpus` ranks through torchrun, each running this same command line
        launch_cli(method, gpus)
        return
    console = display.console(stderr=as_json)
    with display.LayerProgress(console, method) as progress, display.library_logs(console):
        report = api.quantize(model, output, method=method, scheme=scheme, method_options=options,
                              calib=calib_config, load=load, overwrite=overwrite, batch_size=batch_size,
                              on_layer=progress.on_layer, on_calib_progress=progress.on_calibration,
                              quantize_lm_head=quantize_lm_head, gpus=gpus)
    if is_secondary_rank():  # rank 0 alone reports
        return
    if save_stats is not None:
        display.save_layer_stats(report, save_stats, console)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        display.print_quantize_summary(console, report)


def register(app: typer.Typer) -> None:
    @app.command("rtn")
    def rtn(model: ModelArg, output: Output, bits: Bits = 4, group_size: GroupSize = 128, sym: Sym = True,
            device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
            overwrite: Overwrite = False, json_: Json = False, save_stats: SaveStats = None,
            quantize_lm_head: LmHead = False) -> None:
        """Round-to-nearest baseline: per-group min/max (asym) or absmax (sym) scales, no calibration."""
        _run("rtn", model, output, bits=bits, group_size=group_size, sym=sym, device=device, dtype=dtype,
             trust_remote_code=trust_remote_code, overwrite=overwrite, as_json=json_, save_stats=save_stats,
             quantize_lm_head=quantize_lm_head)

    @app.command("gptq")
    def gptq(model: ModelArg, output: Output, bits: Bits = 4, group_size: GroupSize = 128, sym: Sym = True,
             calib: Calib = "self", nsamples: NSamples = 128, seqlen: SeqLen = 2048, seed: Seed = 0,
             text_field: TextField = "text",
             damp: Annotated[float, typer.Option("--damp", help="Dampening, fraction of the mean Hessian diagonal.")] = 0.01,
             block_size: Annotated[int, typer.Option("--block-size", help="Columns per lazy-update block.")] = 128,
             desc_act: Annotated[bool, typer.Option("--desc-act/--no-desc-act", help="Act-order: columns by decreasing Hessian diagonal.")] = False,
             static_groups: Annotated[bool, typer.Option("--static-groups", help="Fix group scales before act-order (no kernel reordering).")] = False,
             true_sequential: Annotated[bool, typer.Option("--true-sequential/--no-true-sequential", help="Quantize attention, then o_proj, then MLP on already quantized inputs.")] = True,
             mse: Annotated[bool, typer.Option("--mse", help="Search each group's range for the least quantization error.")] = False,
             device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
             batch_size: BatchSize = 8, overwrite: Overwrite = False, json_: Json = False,
             save_stats: SaveStats = None, quantize_lm_head: LmHead = False,
             gpus: Annotated[int | None, typer.Option("--gpus", help="Ranks to share the work (torchrun; one GPU each, gloo on the CPU).")] = None,
    ) -> None:
        """GPTQ: column-by-column rounding with inverse-Hessian error compensation."""
        options = dict(damp=damp, block_size=block_size, desc_act=desc_act, static_groups=static_groups,
                       true_sequential=true_sequential, mse=mse)
        _run("gptq", model, output, bits=bits, group_size=group_size, sym=sym, device=device, dtype=dtype,
             trust_remote_code=trust_remote_code, overwrite=overwrite, as_json=json_, options=options, calib=calib,
             nsamples=nsamples, seqlen=seqlen, seed=seed, text_field=text_field, batch_size=batch_size,
             save_stats=save_stats, quantize_lm_head=quantize_lm_head, gpus=gpus)

    @app.command("awq")
    def awq(model: ModelArg, output: Output, bits: Bits = 4, group_size: GroupSize = 128, sym: Sym = False,
            calib: Calib = "self", nsamples: NSamples = 128, seqlen: SeqLen = 512, seed: Seed = 0,
            text_field: TextField = "text",
            grid: Annotated[int, typer.Option("--grid", help="Points of the scale-exponent grid over [0, 1].")] = 20,
            clip: Annotated[bool, typer.Option("--clip/--no-clip", help="Search a clipping range per group.")] = True,
            gptq: Annotated[bool, typer.Option("--gptq", help="Round with GPTQ after the AWQ scaling.")] = False,
            fmt: Annotated[str | None, typer.Option("--format", help="Checkpoint layout: gptq (default) or awq (AWQ GEMM).")] = None,
            device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
            batch_size: BatchSize = 8, overwrite: Overwrite = False, json_: Json = False,
            save_stats: SaveStats = None, quantize_lm_head: LmHead = False,
            gpus: Annotated[int | None, typer.Option("--gpus", help="Ranks to share the work (torchrun; one GPU each, gloo on the CPU).")] = None,
    ) -> None:
        """AWQ: activation-aware scaling of salient input channels, folded into the previous op, then rounding."""
        options: dict[str, Any] = dict(grid=grid, clip=clip, gptq=gptq)
        if fmt is not None:
            options["format"] = fmt
        _run("awq", model, output, bits=bits, group_size=group_size, sym=sym, device=device, dtype=dtype,
             trust_remote_code=trust_remote_code, overwrite=overwrite, as_json=json_, options=options, calib=calib,
             nsamples=nsamples, seqlen=seqlen, seed=seed, text_field=text_field, batch_size=batch_size,
             save_stats=save_stats, quantize_lm_head=quantize_lm_head, gpus=gpus)
