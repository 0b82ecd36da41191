"""The user documentation says only what the code accepts.

For README.md, docs/*.md and bench/README.md:
- every shell command in a fenced code block that runs ``quantkit ...`` names an existing (sub)command and only
  options that command accepts (checked against the click command tree of ``quantkit.cli.app``; nothing is run);
- every ``python bench/SCRIPT.py ...`` names a script at bench/'s top level and only options its argparse parser
  declares (read from the script's source);
- every code block preceded by ``<!-- quote: PATH -->`` equals that file's content;
- every relative link, and every backticked repository path (``kernels/w4a16.py``, ``bench/results/...``), exists.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
SHELL_LANGS = {"bash", "sh", "shell", "console", ""}
QUOTE = re.compile(r"^<!--\s*quote:\s*(\S+)\s*-->$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:bench|kernels|quantkit|cli|calib_data|tests|examples|docs)/[A-Za-z0-9_./-]*$")
NOT_IN_CHECKOUT = ("bench/runs",)  # written by the benchmarks, git-ignored
OPTION = re.compile(r"^--?[A-Za-z]")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHONS = {"python", "python3", ".venv/bin/python"}


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    line: int  # 1-based line of the opening fence
    quote: str | None  # the path of a <!-- quote: PATH --> marker right above the fence


def code_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text, in order."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        fence = re.match(r"^(```+)\s*(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence.group(1)):
            body.append(lines[i])
            i += 1
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = QUOTE.match(above)
        blocks.append(Block(fence.group(2), "\n".join(body) + "\n" if body else "", start + 1,
                            marker.group(1) if marker else None))
        i += 1
    return blocks


def shell_commands(block: Block) -> list[list[str]]:
    """Each simple command of a shell block as argv (continuations joined, comments dropped, split at ;, &&, |),
    leading VAR=value assignments removed."""
    if block.lang not in SHELL_LANGS:
        return []
    lexer = shlex.shlex(block.body.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, current = [], []
    for token in lexer:
        if set(token) <= set(";&|()<>"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    out = []
    for argv in commands:
        while argv and ENV_ASSIGNMENT.match(argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def _split_lines(block: Block) -> list[list[str]]:
    """Commands of a shell block, one logical line at a time (so one line's command never runs into the next)."""
    logical = block.body.replace("\\\n", " ").split("\n")
    return [argv for line in logical for argv in shell_commands(Block(block.lang, line, block.line, None))]


def _is_group(command) -> bool:
    return isinstance(getattr(command, "commands", None), dict)


def _accepted(command, ctx_settings: dict) -> set[str]:
    """The option names ``command`` accepts (typer ships its own copy of click, so this reads the parameters by
    their attributes, not by their class)."""
    names = set(ctx_settings.get("help_option_names", ["--help"]))
    for param in command.params:
        if getattr(param, "param_type_name", "") == "option":
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def check_quantkit(argv: list[str], root) -> list[str]:
    """Problems of one ``quantkit ...`` argv against the command tree: unknown subcommands or options."""
    settings = root.context_settings or {}
    command, path, args = root, ["quantkit"], argv[1:]
    problems = []
    while _is_group(command):
        first = next((k for k, a in enumerate(args) if not OPTION.match(a)), len(args))
        for opt in args[:first]:  # the group's own options come before its subcommand
            if opt.split("=", 1)[0] not in _accepted(command, settings):
                problems.append(f"{' '.join(path)}: no option {opt}")
        if first == len(args):
            return problems
        name = args[first]
        if name in command.commands:
            args = args[first + 1:]
        elif type(command).__name__ == "_RunByDefault" and "run" in command.commands:
            name, args = "run", args[first:]  # `quantkit batch RECIPE` is `quantkit batch run RECIPE`
        else:
            return problems + [f"{' '.join(path)}: no command {name!r}"]
        command, path = command.commands[name], [*path, name]
    for opt in (a for a in args if OPTION.match(a)):
        if opt.split("=", 1)[0] not in _accepted(command, settings):
            problems.append(f"{' '.join(path)}: no option {opt}")
    return problems


def script_options(script: Path) -> set[str]:
    """The option strings a bench script's argparse parser declares (``add_argument("--x", ...)``), and -h/--help."""
    names = {"-h", "--help"}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                         and a.value.startswith("-"))
    return names


def check_bench(argv: list[str], repo: Path) -> list[str]:
    """Problems of one ``python bench/SCRIPT.py ...`` argv: a missing script or an option it does not declare."""
    script = repo / argv[1]
    if script.parent != repo / "bench" or not script.is_file():
        return [f"{argv[1]}: no such script at bench/'s top level"]
    known = script_options(script)
    return [f"{argv[1]}: no option {a}" for a in argv[2:] if OPTION.match(a) and a.split("=", 1)[0] not in known]


def check_text(text: str, where: Path, repo: Path, root) -> list[str]:
    """Every problem of one markdown text: commands, quoted files, links and backticked paths."""
    problems = []
    blocks = code_blocks(text)
    for block in blocks:
        for argv in _split_lines(block):
            if argv[0] == "quantkit":
                problems += [f"line {block.line}: {p}" for p in check_quantkit(argv, root)]
            elif argv[0] in PYTHONS and len(argv) > 1 and argv[1].startswith("bench/"):
                problems += [f"line {block.line}: {p}" for p in check_bench(argv, repo)]
        if block.quote:
            quoted = repo / block.quote
            if not quoted.is_file():
                problems.append(f"line {block.line}: quotes {block.quote}, which does not exist")
            elif quoted.read_text() != block.body:
                problems.append(f"line {block.line}: the quote of {block.quote} differs from the file")
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for target in LINK.findall(prose):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (where.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            problems.append(f"link {target}: no such file")
    for span in CODE_SPAN.findall(prose):
        if REPO_PATH.match(span) and not span.startswith(NOT_IN_CHECKOUT) and not (repo / span).exists():
            problems.append(f"path `{span}`: no such file in the repository")
    return problems


@pytest.fixture(scope="module")
def cli_root():
    import typer

    from quantkit.cli.app import app

    return typer.main.get_command(app)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_documented_commands_links_and_quotes_hold(doc, cli_root):
    assert doc.is_file(), f"{doc} is missing"
    problems = check_text(doc.read_text(), doc, REPO, cli_root)
    assert not problems, f"{doc.relative_to(REPO)}:\n" + "\n".join(problems)


def test_the_docs_name_every_command(cli_root):
    """README's command table lists every command the CLI has."""
    readme = (REPO / "README.md").read_text()
    names = []
    for name, command in cli_root.commands.items():
        subs = command.commands if _is_group(command) else {}
        names += [f"quantkit {name} {sub}" for sub in subs if sub != "run"] or [f"quantkit {name}"]
    assert [n for n in names if f"`{n}" not in readme] == []


def test_readme_has_no_two_sections_with_one_name():
    headings = re.findall(r"^#+\s+(.*)$", re.sub(r"^```.*?^```", "", (REPO / "README.md").read_text(),
                                                  flags=re.S | re.M), flags=re.M)
    assert len(headings) == len(set(headings)), headings


def test_bench_readme_lists_every_script_and_no_top_level_file_is_named_by_date_or_run():
    bench = REPO / "bench"
    listed = (bench / "README.md").read_text()
    assert [p.name for p in sorted(bench.glob("*.py")) if f"`{p.name}`" not in listed] == []
    dated = re.compile(r"(19|20)\d\d-?\d\d-?\d\d|_run\d|_s\d\d?(_|\.|$)")
    assert [p.name for p in bench.iterdir() if dated.search(p.name)] == []
    assert [p.name for p in (bench / "results").iterdir() if dated.search(p.name)] == []


SAMPLE = """
Text with a [good link](README.md), a [dead one](docs/nowhere.md) and `kernels/nope.py`.

```bash
quantkit gptq model.gguf -o out --group-size 64 --no-such-option 3
OMP_NUM_THREADS=1 quantkit eval perplexity out --data x.txt --max-windows 4 && quantkit frobnicate x
quantkit batch examples/smollm2_sweep.toml --dry-run   # batch RECIPE means batch run RECIPE
python bench/bench_w4a16.py --quick --not-an-option
python bench/not_a_script.py --help
curl -s localhost:8000/health --whatever
```

<!-- quote: examples/smollm2_sweep.toml -->
```toml
output = "somewhere else"
```
"""


def test_the_checker_catches_planted_mistakes(cli_root):
    problems = check_text(SAMPLE, REPO / "SAMPLE.md", REPO, cli_root)
    assert problems == [
        "line 4: quantkit gptq: no option --no-such-option",
        "line 4: quantkit: no command 'frobnicate'",
        "line 4: bench/bench_w4a16.py: no option --not-an-option",
        "line 4: bench/not_a_script.py: no such script at bench/'s top level",
        "line 14: the quote of examples/smollm2_sweep.toml differs from the file",
        "link docs/nowhere.md: no such file",
        "path `kernels/nope.py`: no such file in the repository",
    ]


def test_the_extractor_splits_lines_continuations_and_operators():
    text = "```bash\nA=1 quantkit rtn m -o o \\\n    --bits 3 # comment --fake\nx && quantkit inspect o\n```\n"
    assert _split_lines(code_blocks(text)[0]) == [
        ["quantkit", "rtn", "m", "-o", "o", "--bits", "3"], ["x"], ["quantkit", "inspect", "o"]]
    assert code_blocks("```toml\na = 1\n```\n")[0] == Block("toml", "a = 1\n", 1, None)
