"""GPTQ's single calibration pass on an accelerator: taken when the device's free memory holds it, and a pass
that runs out of memory all the same goes on group by group with the same result."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from quantkit.calibrate.records import LayerInputs
from quantkit.config import QuantScheme
from quantkit.methods import gptq_method
from quantkit.methods.gptq import GPTQConfig
from quantkit.methods.gptq_method import GPTQMethod, single_pass_fits


@pytest.fixture
def tiny_model_and_calib():
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    return model, calib


def _cuda_ctx(tokens: int, hidden: int, widths: list[tuple[int, int]], attention: str = "sdpa") -> SimpleNamespace:
    """What ``single_pass_fits`` reads of a layer's context: device, linears, inputs (meta: no memory), the
    attention's implementation."""
    linears = {f"l{i}": nn.Linear(i_f, o_f, bias=False, device="meta") for i, (i_f, o_f) in enumerate(widths)}
    h = torch.empty(tokens // 2048, 2048, hidden, dtype=torch.bfloat16, device="meta")
    config = SimpleNamespace(_attn_implementation=attention, num_attention_heads=32)
    return SimpleNamespace(device=torch.device("cuda"), linears=linears, inputs=LayerInputs([h], {}),
                           layer=SimpleNamespace(self_attn=SimpleNamespace(config=config)))


def _free_memory(monkeypatch, free: int, reserved: int = 0, allocated: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_single_pass_fits_an_8b_layer_on_an_80gb_card_not_on_a_24gb_one(monkeypatch):
    ctx = _cuda_ctx(128 * 2048, 4096, [(4096, 4096), (4096, 14336), (14336, 4096)])
    _free_memory(monkeypatch, 72 << 30)  # an H100 80 GB with the walker's own few GB in use
    assert single_pass_fits(ctx)
    _free_memory(monkeypatch, 22 << 30)
    assert not single_pass_fits(ctx)
    # what the caching allocator holds unused counts as free
    _free_memory(monkeypatch, 22 << 30, reserved=60 << 30, allocated=10 << 30)
    assert single_pass_fits(ctx)
    # twice the tokens need about twice the memory
    assert not single_pass_fits(_cuda_ctx(256 * 2048, 4096, [(4096, 14336), (14336, 4096)]))
    # eager attention holds every window's 32 x 2048 x 2048 scores as well: 172 GB more
    _free_memory(monkeypatch, 72 << 30)
    assert not single_pass_fits(_cuda_ctx(128 * 2048, 4096, [(4096, 14336), (14336, 4096)], attention="eager"))
    _free_memory(monkeypatch, 300 << 30)
    assert single_pass_fits(_cuda_ctx(128 * 2048, 4096, [(4096, 14336), (14336, 4096)], attention="eager"))


def test_single_pass_is_never_chosen_off_cuda(monkeypatch):
    ctx = _cuda_ctx(2048, 64, [(64, 64)])
    ctx.device = torch.device("mps")
    _free_memory(monkeypatch, 1 << 40)
    assert not single_pass_fits(ctx)  # (the config's default for CUDA: tests/test_walker_activations.py)


def _raise_oom_once_at(model: nn.Module, module_name: str) -> list[int]:
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    model.model.layers[0].get_submodule(module_name).register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("where", ["mlp.up_proj", "solve of mlp.down_proj"])
def test_out_of_memory_in_the_single_pass_goes_on_group_by_group(tiny_model_and_calib, where, monkeypatch, caplog):
    """A single pass cut by an OOM (in the forward, or inside a group's solve) finishes the layer with group
    passes, later layers skip the single pass, and the weights are those of the group-by-group path."""
    from quantkit.calibrate.walker import walk

    model, calib = tiny_model_and_calib
    scheme = QuantScheme(4, 32, False)
    reference = walk(copy.deepcopy(model), GPTQMethod(scheme, GPTQConfig(single_pass_max_tokens=0)), device="cpu",
                     token_ids=calib, batch_size=4)
    cut = copy.deepcopy(model)
    if where == "mlp.up_proj":
        _raise_oom_once_at(cut, "mlp.up_proj")
    else:
        real = gptq_method.gptq_quantize
        failed = []

        def solve(w, H, *args, **kwargs):
            if "down_proj" in kwargs.get("name", "") and not failed:
                failed.append(kwargs["name"])
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(w, H, *args, **kwargs)

        monkeypatch.setattr(gptq_method, "gptq_quantize", solve)
    passes = []
    real_pass = gptq_method._single_pass
    monkeypatch.setattr(gptq_method, "_single_pass", lambda work: passes.append(work.ctx.index) or real_pass(work))
    method = GPTQMethod(scheme, GPTQConfig())
    with caplog.at_level(logging.WARNING, logger="quantkit.methods.gptq_method"):
        result = walk(cut, method, device="cpu", token_ids=calib, batch_size=4)
    assert passes == [0]  # layer 0 tried, the later layers went group by group at once
    assert method.single_pass_memory.refused_tokens == calib.numel()
    warnings = [r.getMessage() for r in caplog.records if "out of device memory" in r.getMessage()]
    assert len(warnings) == 1 and "model.layers.0" in warnings[0]
    assert set(result.weights) == set(reference.weights)
    for name, q in result.weights.items():
        mismatch = (q.dequantize() != reference.weights[name].dequantize()).float().mean().item()
        assert mismatch < 0.01, name


def test_out_of_memory_after_a_group_released_its_weights_is_not_papered_over(tiny_model_and_calib, monkeypatch):
    """Inside a solve whose stacked linears were already released (a streamed layer), nothing sound is left to
    solve again: the error goes on."""
    model, calib = tiny_model_and_calib
    work = SimpleNamespace(ctx=SimpleNamespace(comm=SimpleNamespace(world_size=1),
                                               groups=[["q"], ["gate", "up"]],
                                               linears={"q": nn.Linear(4, 4), "gate": nn.Linear(4, 8),
                                                        "up": nn.Linear(4, 8)}),
                           weights={})
    assert gptq_method._can_fall_back(work, {1})
    work.ctx.linears["gate"].weight.data = torch.empty(0)  # released while its stack was solved
    assert not gptq_method._can_fall_back(work, {1})
    assert gptq_method._can_fall_back(work, {0})
    work.weights["q"] = object()  # installed before the error
    assert not gptq_method._can_fall_back(work, {0})
    work.ctx.comm.world_size = 2  # ranks: the collectives of the other ranks could not be matched
    assert not gptq_method._can_fall_back(work, set())
