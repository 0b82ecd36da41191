"""Sampling filters, seeded determinism and stop-string search."""

from __future__ import annotations

import torch

from quantkit.runtime import sampling
from quantkit.runtime.types import SamplingParams


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    kept = sampling.top_k_mask(logits, 2)
    assert torch.isfinite(kept).tolist() == [False, True, False, True, False]
    assert torch.equal(sampling.top_k_mask(logits, 0), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(sampling.top_p_mask(logits, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(sampling.top_p_mask(logits, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(sampling.top_p_mask(logits, 0.81)).tolist() == [True, True, True, False]
    assert torch.isfinite(sampling.top_p_mask(logits, 0.1)).tolist() == [True, False, False, False]


def test_repetition_penalty_follows_ctrl():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = sampling.apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    assert logits.tolist() == [2.0, -2.0, 1.0]  # not in place


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    seen = torch.tensor([[3, 7, 7, 20]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    assert torch.allclose(sampling.apply_repetition_penalty(logits[0], seen[0], 1.3), expected[0])


def test_seeded_sampling_is_deterministic_and_seed_dependent():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=5)

    def draw(seed):
        gen = sampling.make_generator(seed, torch.device("cpu"))
        return [sampling.sample_row(logits, params, torch.empty(0, dtype=torch.long), gen) for _ in range(20)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_sampling_respects_the_filters():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0])
    gen = sampling.make_generator(0, torch.device("cpu"))
    params = SamplingParams(temperature=2.0, top_k=2)
    draws = {sampling.sample_row(logits, params, torch.empty(0, dtype=torch.long), gen) for _ in range(200)}
    assert draws == {0, 1}


def test_batch_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    params = [SamplingParams(), SamplingParams(repetition_penalty=10.0)]
    seen = [torch.empty(0, dtype=torch.long), torch.tensor([0])]
    assert sampling.sample_batch(logits, params, seen, [None, None]) == [1, 2]  # 3.0 / 10 falls below 1.0


def test_find_stop():
    assert sampling.find_stop("hello world", ("wor", "lo")) == 3
    assert sampling.find_stop("hello world", ("xyz",)) == -1
    assert sampling.find_stop("abab", ("ab",), start=1) == 2
