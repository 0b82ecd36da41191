import math

import pytest
import torch

from quantkit.eval.kld import summarize_kld, token_kld


def test_identical_logits_have_zero_kl_and_no_changed_top1():
    logits = torch.randn(7, 11)
    kl, changed = token_kld(logits, logits.clone())
    assert torch.allclose(kl, torch.zeros(7), atol=1e-6)
    assert not changed.any()


def test_kl_matches_closed_form_for_two_tokens():
    # p = (0.5, 0.5), q = softmax(log 0.9, log 0.1): KL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)
    base = torch.zeros(1, 2)
    quant = torch.tensor([[math.log(0.9), math.log(0.1)]])
    kl, _ = token_kld(base, quant)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl.item() == pytest.approx(expected, rel=1e-5)


def test_top1_change_and_summary():
    base = torch.tensor([[3.0, 0.0], [0.0, 3.0], [3.0, 0.0], [3.0, 0.0]])
    quant = torch.tensor([[0.0, 3.0], [0.0, 3.0], [3.0, 0.0], [3.0, 0.0]])
    kl, changed = token_kld(base, quant)
    stats = summarize_kld(kl, changed)
    assert stats.top1_changed == pytest.approx(0.25)
    assert stats.n_tokens == 4
    assert stats.mean_kld == pytest.approx(kl.mean().item())
    assert stats.p99_kld <= kl.max().item() + 1e-6 and stats.p99_kld > stats.mean_kld


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        token_kld(torch.zeros(2, 3), torch.zeros(2, 4))


# -- model-level driver on a tiny random Llama ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir):
    """The tiny model and a copy with noise on one weight (a stand-in for a quantized model)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    noisy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        weight = noisy.model.layers[0].mlp.down_proj.weight
        weight.add_(0.5 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
        head = noisy.lm_head.weight
        head.add_(5 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(1)))
    return base, noisy


def _windows():
    from quantkit.eval.kld import kld_windows

    tokens = torch.randint(0, 200, (300,), generator=torch.Generator().manual_seed(1))
    return kld_windows(tokens, seqlen=40, max_windows=3)


def test_kld_windows_cut_text_and_prepend_bos():
    from quantkit.config import QuantkitError
    from quantkit.eval.kld import kld_windows

    tokens = torch.arange(100)
    plain = kld_windows(tokens, seqlen=30, max_windows=None)
    assert plain.shape == (3, 30) and torch.equal(plain[1], torch.arange(30, 60))
    with_bos = kld_windows(tokens, seqlen=30, max_windows=2, bos_token_id=7)
    assert with_bos.shape == (2, 30) and (with_bos[:, 0] == 7).all() and torch.equal(with_bos[1, 1:], torch.arange(29, 58))
    with pytest.raises(QuantkitError, match="fewer than one window"):
        kld_windows(tokens[:10], seqlen=30, max_windows=None)


def test_model_against_itself_is_zero(tiny_pair):
    from quantkit.eval.kld import LiveReference, model_kld

    base, _ = tiny_pair
    windows = _windows()
    result = model_kld(LiveReference(base, windows), base, windows)
    assert result.stats.mean_kld == 0.0 and result.stats.top1_changed == 0.0
    assert result.stats.n_tokens == 3 * 40 and result.n_windows == 3


def test_chunked_driver_matches_full_logits(tiny_pair, monkeypatch):
    from quantkit.eval import kld, perplexity

    base, noisy = tiny_pair
    windows = _windows()
    # Chunks of 16 positions: the driver stitches 3 chunks per window of 40.
    monkeypatch.setattr(perplexity, "LOGIT_CHUNK_ELEMENTS", 16 * base.config.vocab_size)
    result = kld.model_kld(kld.LiveReference(base, windows), noisy, windows)
    with torch.no_grad():
        full_kl, full_changed = kld.token_kld(base(windows).logits.flatten(0, 1), noisy(windows).logits.flatten(0, 1))
    expected = kld.summarize_kld(full_kl, full_changed)
    assert result.stats.mean_kld > 1e-3
    assert result.stats.mean_kld == pytest.approx(expected.mean_kld, rel=1e-4)
    assert result.stats.p99_kld == pytest.approx(expected.p99_kld, rel=1e-4)
    assert result.stats.top1_changed == pytest.approx(expected.top1_changed)


def test_stored_reference_gives_the_live_result(tiny_pair, tmp_path):
    from quantkit.eval.kld import LiveReference, StoredReference, model_kld, store_reference

    base, noisy = tiny_pair
    windows = _windows()
    stored = store_reference(base, windows, tmp_path / "ref.safetensors")
    assert not list(tmp_path.glob("*.partial"))
    live = model_kld(LiveReference(base, windows), noisy, windows).stats.mean_kld
    cached = model_kld(StoredReference(tmp_path / "ref.safetensors", windows), noisy, windows).stats.mean_kld
    assert cached == pytest.approx(live, rel=1e-2, abs=1e-6)
    assert model_kld(stored, base, windows).stats.mean_kld < 1e-5  # float16 storage: near zero
    with pytest.raises(ValueError, match="other windows"):
        StoredReference(tmp_path / "ref.safetensors", windows[:2])
