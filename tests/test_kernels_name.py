"""Our top-level ``kernels/`` folder must never hide Hugging Face's ``kernels`` package.

transformers >= 5.25 imports that package (``transformers.integrations.hub_kernels``). Each check
runs a fresh interpreter with the repository root as its working directory, where ``python -c`` and
``python -m`` put the root first on ``sys.path``, as a user running from the checkout would.
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_from_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _hf_kernels_installed(), reason="Hugging Face's `kernels` package is not installed")
def test_hub_kernels_integration_imports_from_repo_root():
    code = (
        "import os, kernels\n"
        "from transformers.integrations import hub_kernels\n"
        "import transformers.activations\n"
        "from kernels import CUDAProperties\n"
        f"assert not os.path.realpath(kernels.__file__).startswith({str(REPO / 'kernels')!r}), kernels.__file__\n"
        "import quantkit.kernels.w4a16 as ours\n"
        f"assert os.path.realpath(ours.__file__).startswith({str(REPO / 'kernels')!r}), ours.__file__\n"
        "print('ok')\n"
    )
    done = _run_from_root(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_bare_name_without_the_hub_package_is_an_empty_namespace():
    # With nothing else on the path, `import kernels` gives what Python gives for a folder without
    # __init__.py: a module with no __file__ (transformers reads that as "not installed"), not our kernels.
    code = (
        "import sys\n"
        "sys.path[:] = [p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p]\n"
        "import kernels\n"
        "assert getattr(kernels, '__file__', None) is None, kernels.__file__\n"
        "assert not hasattr(kernels, 'w4a16')\n"
        "print('ok')\n"
    )
    done = _run_from_root(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_cli_module_starts_from_repo_root():
    # torchrun starts every rank as `python -m quantkit.cli.app` from the caller's directory.
    done = subprocess.run(
        [sys.executable, "-m", "quantkit.cli.app", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "gptq" in done.stdout
