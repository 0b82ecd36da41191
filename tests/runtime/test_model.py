"""The runtime's decoder against transformers on the same weights (CPU, float32, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantkitError
from quantkit.runtime.loader import load_engine, load_runtime_model
from quantkit.runtime.model import KVCache
from tests.conftest import rel_err

FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tiny_family):
    folder, hf = tiny_family(family)
    model, _ = load_runtime_model(str(folder), device="cpu")
    ids = torch.randint(0, hf.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits.float()
    got = model.forward_logits(ids)
    assert got.shape == expected.shape
    assert rel_err(got, expected) < 1e-5


def test_spec_reads_family_facts(tiny_family):
    gemma, _ = tiny_family("gemma2")
    model, _ = load_runtime_model(str(gemma), device="cpu")
    s = model.spec
    assert s.norm_offset == 1.0 and s.sandwich_norms and s.activation == "gelu_tanh"
    assert s.attn_softcap == 5.0 and s.final_softcap == 3.0 and s.softmax_scale == pytest.approx(24**-0.5)
    assert [s.window_left(i) for i in range(2)] == [4, -1]  # Gemma 2 alternates, sliding first
    qwen, _ = tiny_family("qwen2")
    assert load_runtime_model(str(qwen), device="cpu")[0].spec.qkv_bias


@pytest.mark.parametrize("kind", ["rtn", "gptq-act-order"])
def test_quantized_logits_match_quantlinear(kind, tiny_quantized):
    import quantkit

    folder = tiny_quantized(kind)
    hf, _ = quantkit.load_quantized(folder, device="cpu", dtype=torch.float32)
    model, _ = load_runtime_model(str(folder), device="cpu")
    assert model.quant is not None and model.quant.bits == 4
    ids = torch.randint(0, hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids).logits.float()
    assert rel_err(model.forward_logits(ids), expected) < 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_prefill_then_decode_equals_full_forward(family, tiny_family):
    """Cached decoding (slots, positions, sliding window) gives the logits of the full causal pass."""
    folder, _ = tiny_family(family)
    model, _ = load_runtime_model(str(folder), device="cpu")
    ids = torch.randint(0, model.spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    full = model.forward_logits(ids)
    cache = KVCache.allocate(model.spec, 4, 32, torch.float32, "cpu")
    prompt_len = 6
    first = model.prefill([ids[0, :prompt_len].tolist(), ids[1, :prompt_len - 2].tolist()], [2, 0], cache)
    assert rel_err(first[0], full[0, prompt_len - 1]) < 1e-5
    assert rel_err(first[1], full[1, prompt_len - 3]) < 1e-5
    lengths = [prompt_len, prompt_len - 2]
    for _ in range(4):
        tokens = torch.tensor([ids[0, lengths[0]], ids[1, lengths[1]]])
        logits = model.decode(tokens, torch.tensor(lengths, dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
                              cache)
        assert rel_err(logits[0], full[0, lengths[0]]) < 1e-5
        assert rel_err(logits[1], full[1, lengths[1]]) < 1e-5
        lengths = [n + 1 for n in lengths]


def test_load_errors_say_what_to_do(tmp_path):
    with pytest.raises(QuantkitError, match="no config.json"):
        load_runtime_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(QuantkitError, match="runtime serves"):
        load_runtime_model(str(tmp_path), device="cpu")
    with pytest.raises(QuantkitError, match="backend"):
        load_engine(str(tmp_path), device="cpu", backend="fast")
