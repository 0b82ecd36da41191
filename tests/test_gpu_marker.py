"""The ``gpu`` marker skips a test by itself where CUDA is missing (tests/conftest.py), and it is the only
CUDA guard: no test file carries its own ``skipif(not torch.cuda.is_available())``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent


@pytest.mark.gpu
def test_a_gpu_test_runs_only_with_cuda():
    assert torch.cuda.is_available()  # without CUDA the marker skipped this test before it ran


def test_no_test_guards_cuda_by_itself():
    guard = re.compile(r"mark\.skipif\(\s*not\s+(CUDA\b|torch\.cuda\.is_available\(\))")
    offenders = [f"{path.relative_to(TESTS)}:{n}" for path in sorted(TESTS.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if guard.search(line)]
    assert not offenders, f"use @pytest.mark.gpu instead of a CUDA skipif: {offenders}"


class _Item:
    """What the hook reads of a collected test: its markers."""

    def __init__(self, *markers):
        self.markers = list(markers)

    def get_closest_marker(self, name):
        return next((m for m in self.markers if m.name == name), None)

    def add_marker(self, marker):
        self.markers.append(getattr(marker, "mark", marker))


@pytest.mark.parametrize("cuda", [False, True])
def test_the_hook_skips_marked_items_exactly_when_cuda_is_missing(monkeypatch, cuda):
    from tests.conftest import pytest_collection_modifyitems

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    marked, plain = _Item(pytest.mark.gpu.mark), _Item(pytest.mark.slow.mark)
    pytest_collection_modifyitems(None, [marked, plain])
    assert [m.name for m in marked.markers] == (["gpu"] if cuda else ["gpu", "skip"])
    assert [m.name for m in plain.markers] == ["slow"]
