"""The algorithm cores import nothing of their walker glue (issue 23: no import circles, no shims)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("core, glue", [("gptq", "gptq_method"), ("awq", "awq_method")])
def test_core_does_not_import_its_walker_glue(core: str, glue: str) -> None:
    code = (
        "import sys, importlib\n"
        f"m = importlib.import_module('quantkit.methods.{core}')\n"
        f"assert 'quantkit.methods.{glue}' not in sys.modules, 'core imported its glue'\n"
        "assert 'quantkit.calibrate.walker' not in sys.modules, 'core imported the walker'\n"
        "assert not hasattr(m, '__getattr__'), 'module __getattr__ shim still present'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
