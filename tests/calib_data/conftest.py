"""Fixtures of the self-generated calibration tests: a tiny tokenizer and a tiny random Llama sized to it."""

import pytest
import torch

from tests.conftest import tiny_llama_config, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture()
def model(tokenizer):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=128)).eval()
