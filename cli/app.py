"""The ``quantkit`` command: a thin typer shell over :mod:`quantkit.api`.

Exit codes: 0 success, 2 bad usage or bad input (``QuantkitError``), 1 failure while running.
"""

from __future__ import annotations

import os
import sys

import typer

from quantkit.cli import bench_cmd, eval_cmds, generate_cmd, inspect_cmd, quantize_cmds

app = typer.Typer(
    name="quantkit",
    help="Post-training 4-bit quantization of LLMs: GPTQ, AWQ and RTN into packed INT4 safetensors "
    "that transformers, vLLM and SGLang load.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
quantize_cmds.register(app)
inspect_cmd.register(app)
generate_cmd.register(app)
bench_cmd.register(app)
app.add_typer(eval_cmds.eval_app, name="eval")


def main() -> None:
    """Console-script entry point: maps errors onto exit codes and one readable line."""
    from quantkit.config import QuantkitError

    try:
        app(standalone_mode=False)
    except QuantkitError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)
    except (typer.Exit, SystemExit) as exc:
        code = getattr(exc, "exit_code", getattr(exc, "code", 0))
        sys.exit(code or 0)
    except typer.Abort:
        typer.secho("aborted", err=True)
        sys.exit(1)
    except Exception as exc:  # click's usage errors carry their own exit code (2)
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if os.environ.get("QUANTKIT_DEBUG"):
            raise
        typer.secho(f"quantkit failed: {type(exc).__name__}: {exc} (set QUANTKIT_DEBUG=1 for the traceback)",
                    fg="red", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
