"""``quantkit eval perplexity MODEL_OR_DIR``."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from quantkit.cli.options import (
    Device,
    Dtype,
    Json,
    SeqLen,
    TextField,
    Threads,
    TrustRemoteCode,
    apply_threads,
    say_threads,
)

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
    text_field: TextField = "text", json_: Json = False, threads: Threads = None,
) -> None:
    """Perplexity by the GPTQ paper's protocol: non-overlapping windows of --seqlen, exp of the mean token NLL."""
    choice = apply_threads(threads)  # before torch is imported
    from quantkit import api
    from quantkit.cli.display import console, library_logs
    from quantkit.cli.progress_view import ProgressView
    from quantkit.config import LoadConfig

    load = LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    _check_before_load([model], data, seqlen, bos)
    say_threads(choice)
    con = console(stderr=json_)
    view = ProgressView(con)
    state: dict = {}

    def on_window(done: int, total: int, running_ppl: float, seconds: float) -> None:
        if "task" not in state:
            state["task"] = view.phase("perplexity", total, "windows")
            if total > 1:
                from quantkit.progress import format_duration

                hint = "" if max_windows is not None else "; --max-windows N evaluates fewer"
                view.print(f"{total} windows of {seqlen} tokens: about {format_duration(seconds * (total - 1))} "
                           f"more{hint}")
        view.update(state["task"], done, extra=f"ppl {running_ppl:.3f}")

    with view, library_logs(view):
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
    text_field: TextField = "text", json_: Json = False, threads: Threads = None,
) -> None:
    """KL divergence of the quantized model's next-token distributions from the base model's: mean, 99th
    percentile, and the share of positions whose top-1 token changed."""
    choice = apply_threads(threads)  # before torch is imported
    from quantkit import api
    from quantkit.cli.display import console, library_logs
    from quantkit.cli.progress_view import ProgressView
    from quantkit.config import LoadConfig

    load = LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    _check_before_load([base, quantized], data, seqlen, bos)
    say_threads(choice)
    con = console(stderr=json_)
    view = ProgressView(con)
    state: dict = {}

    def on_window(done: int, total: int, *rest) -> None:
        if "task" not in state:
            state["task"] = view.phase("KL divergence", total, "windows")
        view.update(state["task"], done)

    with view, library_logs(view):
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


def _check_before_load(models: list[str], data: str, seqlen: int, bos: str) -> None:
    """What needs no weights, before any model loads: options, the data, the models' paths and positions."""
    from quantkit import api, preflight
    from quantkit.errors import QuantkitError
    from quantkit.eval.perplexity import EVAL_SOURCES

    if bos not in ("auto", "on", "off"):
        raise QuantkitError(f"--bos must be auto, on or off, got {bos!r}")
    api.check_text_source(str(data), EVAL_SOURCES, "--data")
    for model in models:
        preflight.check_model_spec(model)
        preflight.check_seqlen(model, seqlen)
