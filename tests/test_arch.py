"""Architecture records and generic discovery."""

from __future__ import annotations

import pytest
from torch import nn

from quantkit.arch import arch_for, find_decoder_layers, find_linears, require_arch, sequential_groups
from quantkit.config import QuantkitError


def test_known_families_and_unknown_error():
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"):
        assert arch_for(model_type) is not None
    assert arch_for("gemma3_text").norm_offset == 1.0
    with pytest.raises(QuantkitError, match="not supported"):
        require_arch("bert")


def test_generic_discovery_on_a_foreign_model():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])  # not blocks of linears... but linears
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

    prefix, layers = find_decoder_layers(Net())
    assert prefix == "blocks" and len(layers) == 3
    linears = find_linears(layers[0])
    assert list(linears) == ["a", "b"]
    assert sequential_groups(None, linears) == [["a"], ["b"]]


def test_no_layers_is_a_clear_error():
    with pytest.raises(QuantkitError, match="decoder layers"):
        find_decoder_layers(nn.Sequential(nn.ReLU()))
