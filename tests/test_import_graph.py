"""The package's import graph, built from the source files with pyproject's package-dir mapping
(``quantkit.kernels`` lives in ``kernels/``, ``quantkit.cli`` in ``cli/``, ``quantkit.calib_data`` in ``calib_data/``).

Every ``import`` counts, those inside functions too (a lazy import is still a dependency: it only moves the
moment it runs); imports under ``if TYPE_CHECKING:`` do not (they never run). An edge goes to the module
named, not to the packages above it that Python initializes on the way (those ``__init__`` files hold
docstrings, or for the root the lazy public names).

Asserted:
* no cycle between modules;
* no cycle between wings (a wing is ``quantkit.X`` for a sub-package or top-level module X; for ``quantkit.kernels``
  each kernel module is its own wing, because the kernels are independent ops side by side, and so are the CLI's
  command modules): data flows one way, from the primitives up to the API;
* ``quantkit.api`` is imported only by the CLI (``quantkit.cli.*``), the root package (whose lazy
  ``quantkit.quantize`` etc. are the API itself) and the batch runner, which runs the public ``quantize`` once
  per job exactly as the CLI's ``quantize`` command does (it is the batch front end, a caller of the API).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = "quantkit.api"
API_IMPORTERS = ("quantkit", "quantkit.batch.runner")  # besides the CLI (see the module docstring)
PER_MODULE_WINGS = ("quantkit.kernels", "quantkit.cli")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def package_dirs(root: Path) -> dict[str, Path]:
    """``{package: folder}`` for each package pyproject ships whose folder is mapped (its own or a parent's)."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool.get("package-dir", {})
    return {name: root / mapping[name] for name in mapping}


def module_files(dirs: dict[str, Path]) -> dict[str, Path]:
    """``{module name: file}`` for every ``.py`` under the mapped folders (nested packages included)."""
    modules: dict[str, Path] = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if name in modules and modules[name] != path:  # a mapped folder inside another: the mapping wins
                continue
            modules[name] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping ``if TYPE_CHECKING:`` bodies (their ``else`` still counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules) -> str | None:
    """``name`` or the longest known module above it (``quantkit.x.attr`` -> ``quantkit.x``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, source: str, modules, is_package: bool = False) -> set[str]:
    """The known modules that ``source`` (the text of module ``name``) imports."""
    found: set[str] = set()
    for node in _imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            # `from pkg import sub` imports the module pkg.sub; `from mod import attr` imports mod.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != name:
                found.add(known)
    return found


def build_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for the whole shipped package."""
    files = module_files(package_dirs(root))
    return {name: imports_of(name, path.read_text(), files, path.name == "__init__.py")
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph``, or None (iterative depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if state.get(start):
            continue
        path, iters = [start], [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def wing_of(module: str) -> str:
    for prefix in PER_MODULE_WINGS:
        if module == prefix or module.startswith(prefix + "."):
            return ".".join(module.split(".")[:3])
    return ".".join(module.split(".")[:2])


def wing_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    wings: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = wings.setdefault(wing_of(module), set())
        edges.update(wing_of(t) for t in targets if wing_of(t) != wing_of(module))
    return wings


@pytest.fixture(scope="module")
def graph():
    return build_graph()


def test_the_graph_sees_the_mapped_folders_and_lazy_imports(graph):
    assert {"quantkit.kernels.w4a16", "quantkit.cli.app", "quantkit.calib_data.sources", "quantkit.api"} <= set(graph)
    assert not any(name.startswith(("kernels.", "cli.", "calib_data.")) for name in graph)
    # quantkit/__init__.py imports the API only inside __getattr__: a lazy import is an edge.
    assert API in graph["quantkit"]


def test_no_cycle_between_modules(graph):
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_cycle_between_wings(graph):
    cycle = find_cycle(wing_graph(graph))
    assert cycle is None, " -> ".join(cycle)


def test_only_the_cli_imports_the_api(graph):
    importers = sorted(m for m, targets in graph.items() if API in targets)
    assert importers, "the CLI imports quantkit.api: an empty list means the graph missed it"
    library = [m for m in importers if not m.startswith("quantkit.cli.") and m not in API_IMPORTERS]
    assert not library, f"library modules import {API}: {library}; move what they need down into its layer"


# The checker itself, on small synthetic packages.

def test_find_cycle_on_synthetic_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is not a cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": set(), "a": {"b"}, "b": {"b"}}) == ["b", "b"]


def _planted_package(tmp_path: Path, lazy_cycle: bool) -> Path:
    tmp_path.mkdir()
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"pkg" = "src"\n"pkg.ext" = "ext"\n')
    for folder in ("src", "src/sub", "ext"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "src" / "sub" / "a.py").write_text("from pkg.ext import b\n")
    (tmp_path / "ext" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from pkg.sub.a import x\n")
    back = "def f():\n    from ..sub.a import thing\n" if lazy_cycle else "import os\n"
    (tmp_path / "ext" / "c.py").write_text(back)
    (tmp_path / "ext" / "b.py").write_text((tmp_path / "ext" / "b.py").read_text() + "from . import c\n")
    return tmp_path


def test_the_checker_finds_a_planted_cycle_through_a_mapped_folder_and_a_lazy_relative_import(tmp_path):
    clean = build_graph(_planted_package(tmp_path / "clean", lazy_cycle=False))
    assert clean["pkg.sub.a"] == {"pkg.ext.b"} and clean["pkg.ext.b"] == {"pkg.ext.c"}  # TYPE_CHECKING: no edge
    assert find_cycle(clean) is None
    planted = build_graph(_planted_package(tmp_path / "planted", lazy_cycle=True))
    assert find_cycle(planted) == ["pkg.ext.b", "pkg.ext.c", "pkg.sub.a", "pkg.ext.b"]
    assert find_cycle(wing_graph(clean)) is None
    assert find_cycle(wing_graph(planted)) == ["pkg.ext", "pkg.sub", "pkg.ext"]
