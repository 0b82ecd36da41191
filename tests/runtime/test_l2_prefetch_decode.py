"""The decode step's L2 prefetch of each next linear's weights (QUANTKIT_L2_PREFETCH_MB, kernels/l2_prefetch.py):
which tensors it asks for, in which order and how many bytes (CPU, the launcher recorded), that only decode asks,
and on the GPU that it changes no logit, under CUDA graphs too, for 16-bit, INT4 and FP8 linears."""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels.l2_prefetch as l2_prefetch_module
from quantkit.runtime.loader import load_runtime_model
from quantkit.runtime.model import KVCache


def _decode_once(model, prompt_len: int = 5):
    dev = model.device
    cache = KVCache.allocate(model.spec, 2, 16, model.dtype, dev)
    model.prefill([list(range(1, prompt_len + 1))], [0], cache)
    tokens = torch.tensor([7], device=dev)
    positions = torch.tensor([prompt_len], dtype=torch.int32, device=dev)
    slots = torch.tensor([0], dtype=torch.int32, device=dev)
    return model.decode(tokens, positions, slots, cache)


@pytest.mark.parametrize("plan", ["each", "pairs"])
def test_decode_asks_for_each_next_linear_in_order_and_nothing_else_does(tiny_family, monkeypatch, plan):
    """Each plan's launches, in order, as (data pointer, bytes) ranges: "each" one launch a linear, right after
    the one before it; "pairs" o with gate/up after q/k/v, down with the next q/k/v (or lm_head) after gate/up."""
    folder, _ = tiny_family("llama")
    monkeypatch.setenv("QUANTKIT_L2_PREFETCH_PLAN", plan)
    model, _ = load_runtime_model(str(folder), device="cpu")
    assert model.l2_prefetch_bytes == 0  # the default, and always off the GPU
    cap = 3000
    model.l2_prefetch_bytes = cap  # as on a GPU with a budget: the launcher is recorded instead of run
    launches = []
    monkeypatch.setattr(l2_prefetch_module, "l2_prefetch",
                        lambda ranges: launches.append([(t.data_ptr(), b) for t, b in ranges]) or 0)
    forward = model.forward_logits(torch.tensor([[1, 2, 3]]))
    assert launches == []  # prefill and full passes stream no weight twice: nothing to prefetch
    logits = _decode_once(model)
    assert torch.isfinite(logits).all() and forward.shape[-1] == logits.shape[-1]

    def wants(*linears):
        ranges = []
        for linear in linears:
            left = cap
            for t in linear.streamed_weights():
                if left <= 0:
                    break
                ranges.append((t.data_ptr(), left))
                left -= min(t.numel() * t.element_size(), left)
        return ranges

    layers = model.weights.layers
    expected = []
    for i, lw in enumerate(layers):
        following = layers[i + 1].qkv if i + 1 < len(layers) else model.weights.lm_head
        if plan == "each":
            expected += [wants(lw.o), wants(lw.gate_up), wants(lw.down), wants(following)]
        else:
            expected += [wants(lw.o, lw.gate_up), wants(lw.down, following)]
    assert launches == expected
    assert all(0 < r[1] <= cap for launch in launches for r in launch)


def test_streamed_weights_are_what_each_kind_of_linear_reads():
    from quantkit.runtime.linear import Linear

    dense = torch.zeros(8, 16)
    assert Linear(8, dense=dense).streamed_weights() == [dense]
    parts = Linear(16, parts=[Linear(8, dense=dense), Linear(8, dense=dense + 1)])
    assert [t.shape for t in parts.streamed_weights()] == [(8, 16), (8, 16)]

    class Packed:
        qweight = torch.zeros(8, 2, dtype=torch.int32)

    assert Linear(8, packed=Packed()).streamed_weights() == [Packed.qweight]


def test_switch_is_refused_outside_its_choices(tiny_family, monkeypatch):
    folder, _ = tiny_family("llama")
    monkeypatch.setenv("QUANTKIT_L2_PREFETCH_MB", "12")
    with pytest.raises(ValueError, match="QUANTKIT_L2_PREFETCH_MB"):
        load_runtime_model(str(folder), device="cpu")
    monkeypatch.setenv("QUANTKIT_L2_PREFETCH_MB", "16")
    model, _ = load_runtime_model(str(folder), device="cpu")
    assert model.l2_prefetch_bytes == 0  # the CPU has no L2 to ask


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_prefetch_changes_no_logit_and_adds_its_launches(monkeypatch, fmt):
    """The kernels backend, eager and under the engine's CUDA graphs: decode logits bit for bit the same with and
    without the prefetch, either plan; the prefetch adds its launches (four a layer, or two in pairs) and nothing
    else."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.runtime.engine import Engine
    from quantkit.tools import bench

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if fmt == "fp8":
        bench.quantize_fp8_in_place(hf)
    results = {}
    for mb, plan in (("0", "each"), ("16", "each"), ("16", "pairs")):
        monkeypatch.setenv("QUANTKIT_L2_PREFETCH_MB", mb)
        monkeypatch.setenv("QUANTKIT_L2_PREFETCH_PLAN", plan)
        runtime = bench.runtime_from_hf(hf, None, max_positions=512)
        assert runtime.l2_prefetch_bytes == int(mb) << 20 and runtime.l2_prefetch_pairs == (plan == "pairs")
        with torch.inference_mode():
            eager = _decode_once(runtime)
            launches = bench.kernel_times(lambda rt=runtime: _decode_once(rt))["launches"]
        engine = Engine(runtime, None, max_batch=2, max_seq_len=128, cuda_graphs=True, graph_buckets=(1, 2))
        agreement = bench.greedy_agreement(engine)
        results[mb + plan] = (eager, launches, agreement)
        del engine, runtime
    none, each, pairs = results["0each"], results["16each"], results["16pairs"]
    assert torch.equal(none[0], each[0]) and torch.equal(none[0], pairs[0])
    layers = cfg.num_hidden_layers
    assert (each[1], pairs[1]) == (none[1] + 4 * layers, none[1] + 2 * layers), results
    assert none[2] == each[2] == pairs[2]
