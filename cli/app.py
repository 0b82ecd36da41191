"""The ``quantkit`` command: a thin typer shell over :mod:`quantkit.api`.

Exit codes: 0 success, 2 bad usage or bad input (typer's usage errors, ``QuantkitError``), 1 failure
while running, 130 interrupted (Ctrl-C).

Start-up cost: ``quantkit --help`` and a mistyped option must answer in well under a second, so this
module and every command module import only typer and the standard library at module level. Each
command function imports what it needs (torch, transformers, rich, quantkit.api) in its body. A new
command module follows the same rule and is registered below with one line.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from quantkit.cli import (
    batch_cmd,
    bench_cmd,
    eval_cmds,
    fp8_cmd,
    generate_cmd,
    inspect_cmd,
    quantize_cmds,
    serve_cmd,
    verify_cmd,
)

# One help text format for every command: plain click output (wraps at the terminal width, never
# cuts option names, no type labels on flags) and -h as well as --help.
CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="quantkit",
    help="Post-training 4-bit quantization of LLMs: GPTQ, AWQ and RTN into packed INT4 safetensors "
    "that transformers, vLLM and SGLang load.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=CONTEXT,
)


def _print_version(value: bool) -> None:
    if value:
        from quantkit.version import __version__

        typer.echo(f"quantkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Only --version lives here; the help text is the app's."""


quantize_cmds.register(app)
fp8_cmd.register(app)
inspect_cmd.register(app)
serve_cmd.register(app)
verify_cmd.register(app)
generate_cmd.register(app)
bench_cmd.register(app)
app.add_typer(eval_cmds.eval_app, name="eval")
app.add_typer(batch_cmd.batch_app, name="batch")

EXIT_INTERRUPTED = 130


def _interrupted() -> None:
    typer.secho("interrupted", fg="red", err=True)
    sys.exit(EXIT_INTERRUPTED)


def main() -> None:
    """Console-script entry point: maps errors onto exit codes and one readable line."""
    from quantkit.errors import QuantkitError

    try:
        code = app(standalone_mode=False, prog_name="quantkit")
    except KeyboardInterrupt:  # outside a command (typer turns one inside into exit code 130)
        _interrupted()
    except QuantkitError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:  # end of input at a prompt
        typer.secho("aborted", err=True)
        sys.exit(1)
    except typer.TyperException as exc:  # typer's own usage errors: its message names the option; exit 2
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        else:
            typer.secho(f"error: {exc.format_message()}", fg="red", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:
        if os.environ.get("QUANTKIT_DEBUG"):
            raise
        typer.secho(f"quantkit failed: {type(exc).__name__}: {exc} (set QUANTKIT_DEBUG=1 for the traceback)",
                    fg="red", err=True)
        sys.exit(1)
    # Without standalone mode typer returns an exit code instead of raising: Ctrl-C inside a command
    # comes back as 130 (the KeyboardInterrupt itself is caught inside typer).
    if code == EXIT_INTERRUPTED:
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
