"""Self-generated calibration on a tiny random Llama built in-process: sampling, start token, cache."""

from __future__ import annotations

import pytest
import torch

from quantkit.calib_data import self_generated
from quantkit.calib_data.self_generated import (
    generate_calibration,
    sample_next,
    sample_sequences,
    start_token_id,
)
from quantkit.calib_data.sources import load_calibration
from quantkit.config import CalibConfig, QuantkitError
from tests.conftest import tiny_tokenizer


class _ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def _naive_sample(model, start_id, nsamples, seqlen, seed, top_k, top_p):
    """The same sampling without a KV cache: every step re-reads the whole prefix."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.full((nsamples, 1), start_id)
    with torch.no_grad():
        for _ in range(seqlen - 1):
            logits = model(input_ids=tokens, use_cache=False).logits[:, -1, :]
            tokens = torch.cat([tokens, sample_next(logits, generator, 1.0, top_k, top_p)[:, None]], dim=1)
    return tokens


def test_kv_cache_sampling_matches_recomputing_the_prefix(model):
    cached = sample_sequences(model, 5, nsamples=3, seqlen=12, seed=1, batch_size=3)
    assert torch.equal(cached, _naive_sample(model, 5, 3, 12, seed=1, top_k=50, top_p=0.95))


def test_generated_shape_start_token_seeds_and_progress(model, tokenizer, tmp_path):
    progress = []
    samples = generate_calibration(model, tokenizer, nsamples=3, seqlen=12, seed=0, batch_size=2,
                                   cache_dir=tmp_path / "a", on_progress=lambda done, total: progress.append((done, total)))
    assert samples.shape == (3, 12) and samples.dtype == torch.long
    assert (samples[:, 0] == start_token_id(tokenizer, model.config)).all()
    assert samples.max() < len(tokenizer) and samples.min() >= 0
    assert len({tuple(row) for row in samples.tolist()}) == 3  # every sample differs
    assert progress[-1] == (3 * 11, 3 * 11) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    again = generate_calibration(model, tokenizer, nsamples=3, seqlen=12, seed=0, batch_size=2, cache_dir=tmp_path / "b")
    assert torch.equal(samples, again)
    other = generate_calibration(model, tokenizer, nsamples=3, seqlen=12, seed=1, batch_size=2, cache_dir=tmp_path / "b")
    assert not torch.equal(samples, other)


def test_cache_hit_skips_the_model_and_a_weight_change_misses(model, tokenizer, tmp_path):
    first = generate_calibration(model, tokenizer, nsamples=2, seqlen=10, seed=0, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    counter = _ForwardCounter(model)
    assert torch.equal(generate_calibration(model, tokenizer, nsamples=2, seqlen=10, seed=0, cache_dir=tmp_path), first)
    assert counter.calls == 0
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] += 0.5  # one element, off the strided sample
    generate_calibration(model, tokenizer, nsamples=2, seqlen=10, seed=0, cache_dir=tmp_path)
    assert counter.calls > 0 and len(list(tmp_path.glob("*.pt"))) == 2


def test_unreadable_cache_entry_is_regenerated(model, tokenizer, tmp_path, caplog):
    first = generate_calibration(model, tokenizer, nsamples=2, seqlen=10, seed=0, cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.pt")
    entry.write_bytes(b"not a torch file")
    with caplog.at_level("WARNING"):
        again = generate_calibration(model, tokenizer, nsamples=2, seqlen=10, seed=0, cache_dir=tmp_path)
    assert torch.equal(first, again) and "unreadable calibration cache" in caplog.text
    assert torch.load(entry, weights_only=True)["input_ids"].shape == (2, 10)


def test_load_calibration_self_uses_the_quantkit_cache_variable(model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    windows = load_calibration(CalibConfig(source="self", nsamples=3, seqlen=9, seed=2), tokenizer, model)
    assert windows.shape == (3, 9)
    assert len(list((tmp_path / "calib").glob("*.pt"))) == 1


def test_seqlen_beyond_the_model_positions_is_refused(model, tokenizer, tmp_path):
    with pytest.raises(QuantkitError, match="longer than the model's 128 positions"):
        generate_calibration(model, tokenizer, nsamples=1, seqlen=129, cache_dir=tmp_path)


def test_sample_next_respects_top_k_and_top_p():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).repeat(2000, 1)
    assert (sample_next(logits, generator, 1.0, 1, 1.0) == 1).all()  # top-k 1 is greedy
    assert (sample_next(logits, generator, 1.0, 0, 1e-6) == 1).all()  # a tiny top-p keeps the best
    drawn = sample_next(logits, generator, 1.0, 2, 1.0)
    assert set(drawn.tolist()) == {1, 2}
    # p(1) = 0.64, p(2) = 0.23, p(3) = 0.09 of the full softmax: top-p 0.8 keeps tokens 1 and 2 only
    assert set(sample_next(logits, generator, 1.0, 0, 0.8).tolist()) == {1, 2}
    share_of_best = (drawn == 1).float().mean().item()
    assert abs(share_of_best - 1 / (1 + torch.e**-1)) < 0.05  # renormalized within the top 2


def test_start_token_choice(tokenizer):
    from tokenizers import processors

    # no BOS added, no chat template: the tokenizer's BOS (<s>, id 0 here)
    assert start_token_id(tokenizer) == tokenizer.bos_token_id
    chat = tiny_tokenizer()
    chat.chat_template = "{% for m in messages %}</s>{{ m['content'] }}{% endfor %}"
    assert start_token_id(chat) == chat.eos_token_id  # the template's first token
    adds_bos = tiny_tokenizer()
    adds_bos.chat_template = chat.chat_template
    adds_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", adds_bos.bos_token_id)]
    )
    assert start_token_id(adds_bos) == adds_bos.bos_token_id  # BOS wins when the model expects it


def test_fingerprint_tracks_values_not_object_identity(model, tokenizer):
    from transformers import LlamaForCausalLM

    clone = LlamaForCausalLM(model.config).eval()
    clone.load_state_dict(model.state_dict())
    assert self_generated.weights_fingerprint(clone) == self_generated.weights_fingerprint(model)
    with torch.no_grad():
        clone.lm_head.weight.mul_(1.001)
    assert self_generated.weights_fingerprint(clone) != self_generated.weights_fingerprint(model)
