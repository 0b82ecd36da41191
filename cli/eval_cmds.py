"""``quantkit eval perplexity MODEL_OR_DIR``."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from quantkit.cli.options import Device, Dtype, Json, SeqLen, TextField, TrustRemoteCode

eval_app = typer.Typer(help="Measure what quantization cost.", no_args_is_help=True, rich_markup_mode=None)


@eval_app.command("perplexity")
def perplexity(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A quantized checkpoint folder, a model folder, hub id or .gguf file.")],
    data: Annotated[str, typer.Option("--data", help="wikitext2 (WikiText-2 test from the Hugging Face hub: needs the "
                                      "network and `datasets`, or their cache) or a local .txt/.jsonl/.parquet file.")] = "wikitext2",
    seqlen: SeqLen = 2048,
    max_windows: Annotated[int | None, typer.Option(
        "--max-windows", show_default="all",
        help="Evaluate at most this many windows. Default: every window of the text (WikiText-2 test: 140 of 2048 "
        "tokens, about half an hour for a 135M model on a 2-core CPU); the estimated time is printed first.")] = None,
    bos: Annotated[str, typer.Option("--bos", help="Start every window with BOS: auto (if the tokenizer expects one), on, off.")] = "auto",
    device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
    text_field: TextField = "text", json_: Json = False,
) -> None:
    """Perplexity by the GPTQ paper's protocol: non-overlapping windows of --seqlen, exp of the mean token NLL."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from quantkit import api
    from quantkit.cli.display import console, library_logs
    from quantkit.config import LoadConfig

    load = LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    con = console(stderr=json_)
    progress = Progress(TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
                        TimeRemainingColumn(), console=con)
    state: dict = {}

    def on_window(done: int, total: int, running_ppl: float, seconds: float) -> None:
        if "task" not in state:
            state["task"] = progress.add_task("ppl", total=total)
            if total > 1:
                from quantkit.progress import format_duration

                hint = "" if max_windows is not None else "; --max-windows N evaluates fewer"
                progress.console.print(f"{total} windows of {seqlen} tokens: about "
                                       f"{format_duration(seconds * (total - 1))} more{hint}", highlight=False)
        progress.update(state["task"], completed=done)

    with progress, library_logs(con):
        result = api.evaluate_perplexity(model, data=data, seqlen=seqlen, max_windows=max_windows, bos=bos,
                                         load=load, text_field=text_field, on_window=on_window)
    out = {"model": model, "data": data, "ppl": result.ppl, "mean_nll": result.mean_nll,
           "tokens": result.n_tokens, "windows": result.n_windows, "seqlen": result.seqlen,
           "bos_prepended": result.bos_prepended, "seconds": result.seconds}
    if json_:
        typer.echo(json.dumps(out, indent=2))
        return
    bos_note = "BOS first" if result.bos_prepended else "no BOS"
    con.print(f"[bold]perplexity {result.ppl:.4f}[/bold]  ({result.n_tokens} tokens, {result.n_windows} windows of "
              f"{result.seqlen}, {bos_note}), {result.seconds:.1f} s")


@eval_app.command("kld")
def kld(
    base: Annotated[str, typer.Argument(metavar="BASE", help="The unquantized model: folder, hub id or .gguf file.")],
    quantized: Annotated[str, typer.Argument(metavar="QUANTIZED", help="A quantized checkpoint folder of that model (or any model with its vocabulary).")],
    data: Annotated[str, typer.Option("--data", help="wikitext2 (hub) or a local .txt/.jsonl/.parquet file.")] = "wikitext2",
    seqlen: SeqLen = 512,
    max_windows: Annotated[int, typer.Option("--max-windows", help="Compare on at most this many windows.")] = 8,
    bos: Annotated[str, typer.Option("--bos", help="Start every window with BOS: auto (if the tokenizer expects one), on, off.")] = "auto",
    device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
    text_field: TextField = "text", json_: Json = False,
) -> None:
    """KL divergence of the quantized model's next-token distributions from the base model's: mean, 99th
    percentile, and the share of positions whose top-1 token changed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from quantkit import api
    from quantkit.cli.display import console, library_logs
    from quantkit.config import LoadConfig

    load = LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    con = console(stderr=json_)
    progress = Progress(TextColumn("KL divergence"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
                        TimeRemainingColumn(), console=con)
    state: dict = {}

    def on_window(done: int, total: int, *rest) -> None:
        if "task" not in state:
            state["task"] = progress.add_task("kld", total=total)
        progress.update(state["task"], completed=done)

    with progress, library_logs(con):
        result = api.evaluate_kld(base, quantized, data=data, seqlen=seqlen, max_windows=max_windows, bos=bos,
                                  load=load, text_field=text_field, on_window=on_window)
    out = {"base": base, "quantized": quantized, "data": data, **result.to_dict()}
    if json_:
        typer.echo(json.dumps(out, indent=2))
        return
    stats = result.stats
    con.print(f"[bold]KL divergence mean {stats.mean_kld:.5f}[/bold]  p99 {stats.p99_kld:.5f}  top-1 changed "
              f"{100 * stats.top1_changed:.2f}%  on {stats.n_tokens} tokens in {result.n_windows} windows of "
              f"{result.seqlen}, {result.seconds:.1f} s")
