"""``quantkit bench CKPT_OR_SHAPE``: decode and prefill throughput of the serving runtime (GPU)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        target: Annotated[str | None, typer.Argument(metavar="CKPT", help="A quantized checkpoint folder (or use --shape).")] = None,
        shape: Annotated[str | None, typer.Option("--shape", help="Random weights of a known shape: llama3-8b, "
                                                                  "qwen3-30b-a3b (MoE), smollm2-135m (built on the "
                                                                  "GPU, no download).")] = None,
        batches: Annotated[str, typer.Option("--batches", help="Decode batch sizes, comma-separated.")] = "1,8,32",
        steps: Annotated[int, typer.Option("--steps", help="Decode steps at batch 1.")] = 128,
        prefill_tokens: Annotated[int, typer.Option("--prefill-tokens", help="Prompt length of the prefill test.")] = 2048,
        baselines: Annotated[bool, typer.Option("--baselines/--no-baselines",
                                                help="Also time transformers generate on the same weights.")] = True,
        formats: Annotated[str, typer.Option("--formats", help="Runtime rows to time, comma-separated: int4, fp8, "
                                                               "bf16 (a checkpoint: its own format and bf16).")]
        = "int4,fp8,bf16",
        context: Annotated[int, typer.Option("--context", help="Prompt tokens each decode row holds before the timed "
                                                               "steps (the attention's share grows with it).")] = 128,
        kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto (the model's dtype) or fp8 (e4m3 "
                                                                             "codes, a scale a token and KV head).")]
        = "auto",
        out: Annotated[Path | None, typer.Option("--out", help="JSON path (a PNG plot is written beside it).")] = None,
    ) -> None:
        """int4 and fp8 against bf16 in one run (a checkpoint: itself against its bf16 dequantization): decode tok/s by batch, prefill tok/s, peak memory, copy bandwidth."""
        from quantkit.config import QuantkitError
        from quantkit.tools import bench_run

        if (target is None) == (shape is None):
            raise QuantkitError("give a checkpoint folder or --shape NAME (one of them)")
        try:
            sizes = tuple(int(b) for b in batches.split(","))
        except ValueError as exc:
            raise QuantkitError(f"--batches must be integers separated by commas, got {batches!r}") from exc
        name = shape or Path(target).name
        path = out or Path(f"bench_serve_{name}_{datetime.date.today()}.json")
        partial = path.with_suffix(".partial.json")

        def save(record: dict) -> None:
            partial.write_text(json.dumps(record, indent=2))

        record = bench_run.run(shape or target, shape=shape is not None, batches=sizes, steps=steps,
                               prefill_tokens=prefill_tokens, baselines=baselines, on_result=save,
                               formats=tuple(f.strip() for f in formats.split(",") if f.strip()), context=context,
                               kv_cache_dtype=kv_cache_dtype)
        path.write_text(json.dumps(record, indent=2))
        partial.unlink(missing_ok=True)
        typer.echo(bench_run.format_table(record))
        try:
            bench_run.plot(record, path.with_suffix(".png"))
        except ImportError:
            typer.echo("matplotlib is not installed: no plot")
        typer.echo(f"wrote {path}")
