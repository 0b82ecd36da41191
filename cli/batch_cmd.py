"""``quantkit batch RECIPE`` (run a recipe) and ``quantkit batch report RECIPE_OR_DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup


class _RunByDefault(TyperGroup):
    """``quantkit batch RECIPE`` means ``quantkit batch run RECIPE``."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


batch_app = typer.Typer(cls=_RunByDefault, no_args_is_help=True,
                        help="Quantize many models x methods x settings from a recipe (TOML/YAML), resumably, "
                        "and compare them: `quantkit batch RECIPE`, `quantkit batch report RECIPE_OR_DIR`.")

Recipe = Annotated[Path, typer.Argument(metavar="RECIPE", help="Recipe file (.toml, .yaml): [defaults], [[grid]], [[jobs]], [eval].")]
OutputOverride = Annotated[Path | None, typer.Option("--output", "-o", help="Batch folder (overrides the recipe's output).")]


@batch_app.command("run")
def run(
    recipe: Recipe,
    output: OutputOverride = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and list the jobs with their folders; run nothing.")] = False,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Skip jobs whose result record is complete (default); --no-resume redoes every job.")] = True,
    json_: Annotated[bool, typer.Option("--json", help="Print the final table as JSON on stdout.")] = False,
) -> None:
    """Run every job of RECIPE: quantize, measure perplexity and KL divergence, record; then print the report.
    A failed job is recorded and the batch goes on; the exit code is 1 if any job failed."""
    from quantkit.batch.recipe import load_recipe
    from quantkit.cli.display import console

    plan = load_recipe(recipe, output=output)
    con = console(stderr=json_)
    if dry_run:
        _print_plan(con, plan, resume)
        return
    result = _run_with_progress(con, plan, resume)
    _print_report(con, plan.output, json_)
    if result.failed:
        con.print(f"[red]{len(result.failed)} of {len(result.results)} jobs failed:[/red] "
                  + ", ".join(r.name for r in result.failed))
        raise typer.Exit(1)


@batch_app.command("report")
def report(
    target: Annotated[Path, typer.Argument(metavar="RECIPE_OR_DIR", help="A recipe file or a batch output folder.")],
    json_: Annotated[bool, typer.Option("--json", help="Print the table as JSON on stdout.")] = False,
) -> None:
    """Write report.md, report.csv, report.json and report.png in the batch folder, and print the table."""
    from quantkit.batch.recipe import recipe_output
    from quantkit.cli.display import console
    from quantkit.config import QuantkitError

    folder = target if target.is_dir() else recipe_output(target) if target.is_file() else None
    if folder is None:
        raise QuantkitError(f"{target} is neither a recipe file nor a batch output folder")
    _print_report(console(stderr=json_), folder, json_)


def _print_plan(con, plan, resume: bool) -> None:
    from quantkit.batch.records import checkpoint_path, complete_result

    con.print(f"{len(plan.jobs)} jobs into {plan.output}:")
    for index, job in enumerate(plan.jobs, start=1):
        done = resume and complete_result(plan.output, job.name, job.settings(), plan.eval.to_dict()) is not None
        con.print(f"  {index:>3}. {job.name:<40} -> {checkpoint_path(plan.output, job.name)}"
                  + ("  (complete: skipped)" if done else ""), highlight=False, soft_wrap=True)
    eval_ = plan.eval
    con.print(f"eval: perplexity on {', '.join(eval_.perplexity) or 'nothing'} ({eval_.max_windows} windows of "
              f"{eval_.seqlen}); KL " + (f"on {eval_.kld_max_windows} windows of {eval_.kld_source}" if eval_.kld
                                          else "off"), highlight=False, soft_wrap=True)


def _run_with_progress(con, plan, resume: bool):
    """One progress view for the whole batch: jobs k of n, each job's layers and evaluation windows
    (rich bars on a terminal, throttled plain lines in a log)."""
    from quantkit.batch.runner import BatchObserver, run_batch
    from quantkit.cli.display import LayerProgress, library_logs
    from quantkit.cli.progress_view import ProgressView

    view = ProgressView(con)
    state: dict = {}

    def job_started(k: int, n: int, job) -> None:
        if "jobs" not in state:
            state["jobs"] = view.phase("batch", n, "jobs")
        if view.plain:
            view.print(f"job {k} of {n}: {job.name}")
        else:
            con.rule(f"job {k} of {n}: {job.name}")
        state["layers"] = LayerProgress(con, job.method, view=view)

    def job_finished(k: int, n: int, result) -> None:
        state.pop("layers", None)
        state.pop("windows", None)
        if result.reused:
            view.print(f"job {k} of {n}: complete from an earlier run, skipped")
        elif result.ok:
            ppl = ", ".join(f"ppl {v:.3f}" for v in result.perplexity.values())
            kl = f", KL {result.kld['mean_kld']:.5f}" if result.kld else ""
            view.print(f"job {k} of {n}: done in {result.seconds:.0f} s, {result.bits_per_weight:.3f} bits per weight"
                       f"{', ' + ppl if ppl else ''}{kl}")
        else:
            view.print(f"job {k} of {n} failed: {result.error}", style="red")
        view.update(state["jobs"], k)

    def stage(text: str) -> None:
        state.pop("windows", None)
        state["stage"] = text
        view.print(f"  {text}")

    def on_window(done: int, total: int, *rest) -> None:
        if "windows" not in state:
            state["windows"] = view.phase(state.get("stage", "eval"), total, "windows")
        view.update(state["windows"], done)

    def on_layer(event) -> None:
        state["layers"].on_layer(event)

    observer = BatchObserver(job_started=job_started, job_finished=job_finished, stage=stage, on_layer=on_layer,
                             on_window=on_window)
    with view, library_logs(view):
        return run_batch(list(plan.jobs), plan.output, eval=plan.eval, resume=resume, observer=observer)


def _print_report(con, folder: Path, as_json: bool) -> None:
    from quantkit.batch.report import markdown_table, rows_as_json, table_rows, write_report

    paths = write_report(folder)
    rows = table_rows(folder)
    if as_json:
        typer.echo(rows_as_json(rows))
    else:
        con.print(markdown_table(rows), highlight=False, markup=False, soft_wrap=True)
    con.print("wrote " + ", ".join(str(p) for p in paths.values()), highlight=False)
