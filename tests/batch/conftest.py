"""Fixtures of the batch tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.batch.recipes import write_recipe


@pytest.fixture
def tiny_recipe(tmp_path, tiny_llama_dir, tiny_text_file) -> Path:
    return write_recipe(tmp_path / "recipe.toml", tiny_llama_dir, tiny_text_file, tmp_path / "out")
