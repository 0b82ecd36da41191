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
