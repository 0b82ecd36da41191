"""No silent partial quantization: weights the walker does not reach are named, and the ratio is the real one."""

from __future__ import annotations

import logging

import pytest
import torch

from quantkit import api
from quantkit.checkpoint_inspect import inspect_checkpoint
from quantkit.config import QuantScheme
from tests.conftest import tiny_tokenizer

SCHEME = QuantScheme(bits=4, group_size=32, sym=True)


def save_tiny(folder, model_type, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               tie_word_embeddings=False, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def quantize_rtn(src, out, caplog):
    with caplog.at_level(logging.WARNING, logger="quantkit.coverage"):
        report = api.quantize(str(src), out, method="rtn", scheme=SCHEME, progress=False)
    warned = " ".join(r.getMessage() for r in caplog.records if r.name == "quantkit.coverage")
    return report, warned


def check_partial(report, warned, out, n_linears):
    experts = [n for n in report.unquantized if "experts" in n]
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= set(experts)
    assert "NOT quantized" in warned and "model.layers.0.mlp.experts.gate_up_proj" in warned
    assert report.n_quantized == n_linears  # every nn.Linear the walker found
    # the real ratio over all weights: far from 4x when most weights (the experts) stay 16-bit
    assert 1.0 < report.compression_ratio < 1.6
    info = inspect_checkpoint(out)
    assert "model.layers.0.mlp.experts.gate_up_proj" in info.unquantized_modules
    assert info.compression_ratio == pytest.approx(report.compression_ratio, rel=0.05)


def test_unknown_moe_family_names_its_fused_experts(tmp_path, caplog):
    src = save_tiny(tmp_path / "phimoe", "phimoe", intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)
    report, warned = quantize_rtn(src, tmp_path / "q", caplog)
    check_partial(report, warned, tmp_path / "q", 2 * 5)  # attention, and phimoe's router (an nn.Linear)


def test_mixtral_without_moe_record_is_not_silently_partial(tmp_path, caplog, monkeypatch):
    """What a family without an MoE record gets: the experts named, the real ratio (the issue's 1.01x case)."""
    import quantkit.arch as arch

    monkeypatch.setattr(arch, "ARCHITECTURES", tuple(a for a in arch.ARCHITECTURES if a.moe is None))
    src = save_tiny(tmp_path / "mixtral", "mixtral", intermediate_size=64, num_local_experts=8,
                    num_experts_per_tok=2)
    report, warned = quantize_rtn(src, tmp_path / "q", caplog)
    check_partial(report, warned, tmp_path / "q", 2 * 4)
    assert "model.layers.0.mlp.gate.weight" in report.unquantized  # the router, too: no record says it stays


def test_mixtral_with_record_is_whole(tmp_path, caplog):
    src = save_tiny(tmp_path / "mixtral", "mixtral", intermediate_size=64, num_local_experts=8,
                    num_experts_per_tok=2)
    report, warned = quantize_rtn(src, tmp_path / "q", caplog)
    assert report.unquantized == [] and not warned
    assert report.n_quantized == 2 * (4 + 3 * 8)
    assert report.compression_ratio > 2.0  # embeddings and lm_head (16-bit) weigh a lot in a tiny model
    assert inspect_checkpoint(tmp_path / "q").compression_ratio > 2.0  # on disk: also the files' headers
    assert report.to_dict()["compression_ratio"] == pytest.approx(report.compression_ratio, abs=1e-4)


def test_dense_llama_nothing_unreached(tiny_llama_dir, tmp_path, caplog):
    report, warned = quantize_rtn(tiny_llama_dir, tmp_path / "q", caplog)
    assert report.unquantized == [] and not warned
