"""No silent partial quantization: weights the walker does not reach are named, and the ratio is the real one."""

from __future__ import annotations

import logging

import pytest
import torch

from quantkit import api
from quantkit.checkpoint.inspect import inspect_checkpoint
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


def test_cli_gptq_on_mixtral_reports_expert_tokens_and_plots(tmp_path):
    import json

    from tests.test_cli import quantkit

    src = save_tiny(tmp_path / "mixtral", "mixtral", intermediate_size=64, num_local_experts=8,
                    num_experts_per_tok=2)
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"the expert {i} reads tokens and the router picks two of eight" for i in range(80)))
    stats = tmp_path / "stats.json"
    proc = quantkit("gptq", src, "-o", tmp_path / "q", "--group-size", "32", "--calib", text, "--nsamples", "4",
                    "--seqlen", "32", "--moe-calib", "routed", "--moe-min-tokens", "1000", "--save-stats", stats,
                    "--json", "--device", "cpu")
    report = json.loads(proc.stdout)
    assert report["unquantized"] == [] and report["n_quantized"] == 2 * (4 + 3 * 8)
    tokens = report["expert_tokens"]["model.layers.0"]
    assert sum(tokens["routed"]) == 4 * 32 * 2 and tokens["rtn_fallback"] == list(range(8))  # floor above all
    assert "block_sparse_moe.experts.0" in proc.stderr  # the warning names the experts
    saved = json.loads(stats.read_text())
    assert saved["expert_tokens"]["model.layers.1"]["routed"] == report["expert_tokens"]["model.layers.1"]["routed"]
    assert stats.with_suffix(".experts.png").stat().st_size > 0
    info = json.loads(quantkit("inspect", tmp_path / "q", "--json").stdout)
    assert info["moe"]["packed_experts"] == 16
    assert "vLLM Marlin MoE tp=1" in quantkit("inspect", tmp_path / "q").stdout
    assert quantkit("gptq", src, "-o", tmp_path / "bad", "--moe-calib", "some", check_code=2).returncode == 2


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_streamed_moe_equals_whole(tmp_path, model_type):
    """Layer by layer from the files' per-expert tensors (as transformers saves them): the same checkpoint."""
    from safetensors.torch import load_file

    from quantkit.config import LoadConfig

    extra = dict(num_local_experts=8) if model_type == "mixtral" else dict(num_experts=8, moe_intermediate_size=64,
                                                                            head_dim=16)
    src = save_tiny(tmp_path / "src", model_type, intermediate_size=64, num_experts_per_tok=2, **extra)
    calib = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    outs = {}
    for stream in ("on", "off"):
        report = api.quantize(str(src), tmp_path / stream, method="gptq", scheme=SCHEME, calib_tokens=calib,
                              load=LoadConfig(stream=stream, device="cpu"), progress=False)
        assert report.streamed == (stream == "on") and report.unquantized == []
        outs[stream] = load_file(str(tmp_path / stream / "model.safetensors"))
    assert outs["on"].keys() == outs["off"].keys()
    for key, t in outs["off"].items():
        assert torch.equal(outs["on"][key], t), key
