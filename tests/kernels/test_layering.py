"""The kernels package imports in one direction: no module imports one that imports it back (lazy imports inside
functions count too), and every module imports by its installed name."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
MODULES = sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__")


def _imports(module: str) -> set[str]:
    """The quantkit.kernels modules ``module`` imports anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse((KERNELS / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "quantkit.kernels":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("quantkit.kernels."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("quantkit.kernels."))
    return found & set(MODULES)


def test_kernel_modules_have_no_import_cycles():
    graph = {m: _imports(m) for m in MODULES}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for dep in graph[m]:
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("module", MODULES)
def test_every_kernel_module_imports_by_its_installed_name(module):
    importlib.import_module(f"quantkit.kernels.{module}")
