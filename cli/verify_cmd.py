"""``quantkit verify CKPT``: the served path's logits against independent references (exit 1 beyond tolerance)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from quantkit.cli.options import Device, Dtype, Json, SeqLen, Threads, TrustRemoteCode, apply_threads, say_threads


def register(app: typer.Typer) -> None:
    @app.command("verify")
    def verify(
        model: Annotated[str, typer.Argument(metavar="MODEL", help="A quantized checkpoint folder (or a 16-bit model folder, hub id, .gguf).")],
        prompts: Annotated[Path | None, typer.Option("--prompts", help="A text file, one prompt per line (default: 4 built-in prompts).")] = None,
        reference: Annotated[list[str] | None, typer.Option("--reference", help="runtime (the runtime's reference ops, fp32) and/or transformers (its modeling code, fp32 on the CPU); default: both on CUDA, transformers on the CPU.")] = None,
        backend: Annotated[str, typer.Option("--backend", help="The served path: auto (kernels on CUDA, reference elsewhere), kernels, reference.")] = "auto",
        rtol: Annotated[float | None, typer.Option("--rtol", help="Largest relative logits error that passes (default: 1e-3 fp32, 2e-2 fp16, 5e-2 bf16).")] = None,
        min_top1: Annotated[float, typer.Option("--min-top1", help="Least top-1 agreement that passes (flips at logit ties forgiven).")] = 0.98,
        base: Annotated[str | None, typer.Option("--base", help="The unquantized model: adds perplexity and KL divergence on --data.")] = None,
        data: Annotated[str | None, typer.Option("--data", help="Local .txt/.jsonl/.parquet text for --base (required with it: verify never downloads).")] = None,
        decode_tokens: Annotated[int, typer.Option("--decode-tokens", help="Greedy tokens per prompt decoded by the engine (KV cache, decode kernels, CUDA graphs) and checked against the reference's argmax; 0: skip.")] = 16,
        seqlen: SeqLen = 512,
        max_windows: Annotated[int, typer.Option("--max-windows", help="Windows of --data scored with --base.")] = 4,
        device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False, json_: Json = False,
        threads: Threads = None,
    ) -> None:
        """Run prompts through the path `serve` uses and through independent references; compare logits
        (max/mean/relative error, top-1 agreement) and greedy decoded tokens. Exit 1 when beyond the tolerance."""
        choice = apply_threads(threads)  # before torch is imported
        from quantkit import preflight
        from quantkit.cli.display import console, library_logs
        from quantkit.cli.progress_view import ProgressView
        from quantkit.tools import verify as verify_mod

        prompt_list = verify_mod.read_prompts(prompts) if prompts is not None else verify_mod.DEFAULT_PROMPTS
        for name in (model, base):
            if name is not None:
                preflight.check_model_spec(name)
                if base is not None:  # --seqlen sizes the windows of --data scored with --base
                    preflight.check_seqlen(name, seqlen)
        say_threads(choice)
        con = console(stderr=json_)
        with ProgressView(con) as view, library_logs(view):  # plain lines and a heartbeat in a log
            report = verify_mod.verify(model, prompts=prompt_list, references=tuple(reference or ("auto",)),
                                       device=device, dtype=dtype, backend=backend, base=base, data=data,
                                       seqlen=seqlen, max_windows=max_windows, trust_remote_code=trust_remote_code,
                                       rtol=rtol, min_top1=min_top1, decode_tokens=decode_tokens)
        if json_:
            typer.echo(json.dumps(report.to_dict(), indent=2, default=str))
        else:
            _print_report(con, report)
        if not report.passed:
            raise typer.Exit(1)


def _print_report(con, report) -> None:
    from rich.table import Table

    table = Table(title=f"{report.model}: served path ({report.backend}, {report.dtype}, {report.device}) "
                        f"against references, {sum(report.prompt_tokens)} positions")
    for column in ("reference", "prompt", "positions", "max abs err", "mean abs err", "rel err", "top-1",
                   "top-1 (ties)", "result"):
        table.add_column(column, justify="left" if column in ("reference", "prompt", "result") else "right",
                         overflow="fold")  # whole numbers, never "4.22e..."
    for path in report.paths:
        rows = [(str(i + 1), c, "") for i, c in enumerate(path.per_prompt)]
        rows.append(("all", path.overall, "[green]pass[/green]" if path.passed else "[red]FAIL[/red]"))
        for label, c, verdict in rows:
            table.add_row(path.reference, label, str(c.n_positions), f"{c.max_abs_err:.3g}", f"{c.mean_abs_err:.3g}",
                          f"{c.rel_err:.3g}", f"{c.top1_agreement:.1%}", f"{c.top1_with_ties(path.tolerance):.1%}",
                          verdict)
    con.print(table)
    tol = report.paths[0].tolerance if report.paths else None
    if tol is not None:
        con.print(f"tolerance: rel err <= {tol.max_rel_err:.0e} and top-1 (flips at logit ties forgiven) "
                  f">= {tol.min_top1:.0%} over all positions")
    if report.base is not None:
        b = report.base
        con.print(f"against {b.base} on {b.n_windows} windows of {b.seqlen} tokens of {b.data}: perplexity "
                  f"base {b.ppl_base:.4f}, served {b.ppl_quant:.4f}; KL mean {b.kld.mean_kld:.4g}, "
                  f"p99 {b.kld.p99_kld:.4g}, top-1 changed {b.kld.top1_changed:.2%} of {b.kld.n_tokens} tokens")
    for path in report.paths:
        if path.decode is not None:
            d = path.decode
            con.print(f"greedy decode through the engine against {path.reference}: {d.n_exact}/{d.n_tokens} tokens "
                      f"equal, {d.agreement(path.tolerance):.1%} with ties forgiven")
    for note in report.notes:
        con.print(f"note: {note}")
    for path in report.paths:
        if not path.passed:
            con.print(f"[red]verify failed against {path.reference}: {'; '.join(path.problems)}[/red]")
    if report.passed:
        con.print("[green]verify passed[/green]")
