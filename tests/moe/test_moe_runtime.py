"""The serving runtime on tiny MoE checkpoints: logits against transformers' own modeling code, and verify."""

from __future__ import annotations

import pytest
import torch

from quantkit.checkpoint.read import load_quantized
from quantkit.checkpoint.save import save_quantized
from quantkit.runtime.loader import load_runtime_model
from tests.conftest import rel_err, tiny_tokenizer
from tests.moe.test_moe_quantize import SCHEME, quantized


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def moe_checkpoint(request, tmp_path_factory):
    from tests.moe.moe_tiny import tiny_moe

    tokenizer = tiny_tokenizer()
    model, result = quantized(request.param, model=tiny_moe(request.param, vocab_size=len(tokenizer)))
    out = tmp_path_factory.mktemp(request.param) / "q"
    save_quantized(model, result.weights, out, method="gptq", scheme=SCHEME, tokenizer=tokenizer)
    return out


def ids():
    return torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(7))


def test_runtime_reference_matches_transformers(moe_checkpoint):
    runtime, _ = load_runtime_model(str(moe_checkpoint), device="cpu", dtype="float32", backend="reference")
    assert any(layer.moe is not None for layer in runtime.weights.layers)
    hf, _ = load_quantized(moe_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(ids()).logits
    assert rel_err(runtime.forward_logits(ids()), ref) < 1e-5


def test_runtime_16bit_fused_experts_match_transformers(tmp_path):
    from tests.moe.moe_tiny import tiny_moe

    model = tiny_moe("qwen2_moe")
    model.save_pretrained(tmp_path / "fp")
    tiny_tokenizer(128).save_pretrained(tmp_path / "fp")
    runtime, _ = load_runtime_model(str(tmp_path / "fp"), device="cpu", dtype="float32", backend="reference")
    with torch.no_grad():
        ref = model(ids()).logits
    assert rel_err(runtime.forward_logits(ids()), ref) < 1e-5


def test_olmoe_whole_projection_qk_norm_and_clip_match_transformers(tmp_path):
    """OLMoE normalizes q and k over all heads at once (norm weights [heads * head_dim]) and may clamp
    q, k and v; a clamp that bites (0.05 on outputs of about 0.1) must change nothing against transformers."""
    from tests.moe.moe_tiny import tiny_moe

    model = tiny_moe("olmoe", clip_qkv=0.05)
    with torch.no_grad():
        for layer in model.model.layers:  # norms away from one, so that a per-head norm would differ
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "fp")
    tiny_tokenizer(128).save_pretrained(tmp_path / "fp")
    runtime, _ = load_runtime_model(str(tmp_path / "fp"), device="cpu", dtype="float32", backend="reference")
    assert (runtime.spec.qk_norm, runtime.spec.clip_qkv, runtime.spec.moe_renormalize) == ("full", 0.05, False)
    with torch.no_grad():
        ref = model(ids()).logits
        unclipped = tiny_moe("olmoe")
        unclipped.load_state_dict(model.state_dict())
        assert rel_err(unclipped(ids()).logits, ref) > 1e-3  # the clamp bites
    assert rel_err(runtime.forward_logits(ids()), ref) < 1e-5


def test_verify_passes_on_moe(moe_checkpoint):
    from quantkit.tools.verify import verify

    report = verify(str(moe_checkpoint), references=("transformers",), device="cpu", dtype="float32",
                    backend="reference", decode_tokens=4)
    assert report.passed, report.to_dict()


def test_nbytes_counts_active_experts_only(moe_checkpoint):
    runtime, _ = load_runtime_model(str(moe_checkpoint), device="cpu", dtype="float32", backend="reference")
    moe = next(layer.moe for layer in runtime.weights.layers if layer.moe is not None)
    per_expert = moe.experts.nbytes() // moe.experts.num_experts
    assert moe.nbytes_per_token() >= moe.top_k * per_expert
    assert moe.nbytes_per_token() < moe.experts.nbytes()
