"""What the walker tests share: a tiny random Llama, one walk over 8 x 32 random tokens, and each method with the
small search grids those tests use."""

from __future__ import annotations

import torch

from quantkit.calibrate.walker import walk
from quantkit.config import QuantScheme
from quantkit.methods.awq import AWQConfig
from quantkit.methods.awq_method import AWQMethod
from quantkit.methods.gptq import GPTQConfig
from quantkit.methods.gptq_method import GPTQMethod


def tiny_llama(layers: int):
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers)).eval()


def walk_tiny(model, method, device="cpu", **kw):
    ids = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
    return walk(model, method, device=device, token_ids=ids, batch_size=2, **kw)


def small_method(kind: str):
    """GPTQ (sym g32, act-order) or AWQ (asym g32, 4-point grids, 64 clip tokens): a fresh method each call."""
    scheme = QuantScheme(4, 32, kind == "gptq")
    if kind == "gptq":
        return GPTQMethod(scheme, GPTQConfig(desc_act=True))
    return AWQMethod(scheme, AWQConfig(grid=4, clip_grid=4, clip_tokens=64))
