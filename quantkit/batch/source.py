"""Reading a recipe file: TOML or YAML into plain data, plus the line of every key where it can be found.

``read_recipe_file`` returns ``(data, lines)``: ``lines`` maps a key path such as ``("jobs", 2, "bits")``
to its 1-based line. YAML's composer gives every node's position; Python's TOML parser gives none, so
for TOML the lines come from a scan of table headers and ``key =`` lines (inline tables get none).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from quantkit.config import QuantkitError

KeyPath = tuple
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def read_recipe_file(path: str | Path) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise QuantkitError(f"recipe {path} not found: give a .toml or .yaml file")
    text = path.read_text()
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return _read_toml(text, path), _toml_lines(text)
    if suffix in (".yaml", ".yml"):
        return _read_yaml(text, path)
    raise QuantkitError(f"recipe {path}: use a .toml, .yaml or .yml file")


def _read_toml(text: str, path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise QuantkitError(f"recipe {path} is not valid TOML: {exc}") from None


def _read_yaml(text: str, path: Path) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise QuantkitError(f"recipe {path} is not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise QuantkitError(f"recipe {path}: the top level must be a mapping of output, models, defaults, eval, "
                            "grid, jobs")
    lines: dict[KeyPath, int] = {}
    if node is not None:
        _yaml_lines(node, (), lines)
    return data, lines


def _yaml_lines(node: Any, prefix: KeyPath, lines: dict[KeyPath, int]) -> None:
    import yaml

    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*prefix, key_node.value)
            lines[key] = key_node.start_mark.line + 1
            _yaml_lines(value_node, key, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*prefix, index)] = item.start_mark.line + 1
            _yaml_lines(item, (*prefix, index), lines)


_TOML_ARRAY_TABLE = re.compile(r"^\s*\[\[\s*([A-Za-z0-9_.-]+)\s*\]\]")
_TOML_TABLE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.-]+)\s*\]")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_-]+|\"[^\"]+\")\s*=")


def _toml_lines(text: str) -> dict[KeyPath, int]:
    lines: dict[KeyPath, int] = {}
    counts: dict[str, int] = {}
    table: KeyPath = ()
    for number, line in enumerate(text.splitlines(), start=1):
        if match := _TOML_ARRAY_TABLE.match(line):
            name = match.group(1)
            table = (*name.split("."), counts.get(name, 0))
            counts[name] = counts.get(name, 0) + 1
            lines[table] = number
        elif match := _TOML_TABLE.match(line):
            table = tuple(match.group(1).split("."))
            lines[table] = number
        elif match := _TOML_KEY.match(line):
            lines[(*table, match.group(1).strip('"'))] = number
    return lines


def expand_env(value: str) -> str:
    """``${VAR}`` and ``${VAR:-default}`` from the environment; an unset variable without default raises KeyError."""

    def substitute(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise KeyError(name)

    return _ENV.sub(substitute, value)
