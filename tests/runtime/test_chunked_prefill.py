"""Chunked prefill on the CPU reference path (tiny random models): a prompt prefilled in chunks gives the
logits and tokens of a whole-prompt prefill (sliding windows included), and while a long prompt is
prefilled, 8 decoding streams keep getting one token every engine step, with at most ``prefill_chunk``
prompt tokens computed between two of their tokens (an injected cost, not wall time)."""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime.loader import load_engine
from quantkit.runtime.types import SamplingParams
from tests.runtime.test_engine import run_schedule


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_chunked_prefill_equals_whole_prompt(tiny_family, family):
    folder, _ = tiny_family(family)
    engine = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=128)
    model, cache = engine.model, engine.cache
    prompt = [(7 * i + 3) % 250 + 1 for i in range(45)]
    whole = model.prefill([prompt], [0], cache)
    pieces = [prompt[a : a + 11] for a in range(0, 45, 11)]  # 11, 11, 11, 11, 1 tokens
    for a, piece in zip(range(0, 45, 11), pieces):
        last = model.prefill([piece], [1], cache, [a])
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.k[1][1, :45], cache.k[1][0, :45])  # the same keys in both slots
    # two chunks of different requests packed in one call, one of them starting mid-prompt
    both = model.prefill([prompt[40:], prompt[:9]], [1, 0], cache, [40, 0])
    torch.testing.assert_close(both[0], whole[0], rtol=1e-4, atol=1e-4)
    # end to end: the same greedy tokens with chunks of 7 as with the whole prompt at once
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    chunked = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=128, prefill_chunk=7)
    schedule = [(0, prompt, params), (1, prompt[:20], params)]
    assert run_schedule(chunked, schedule) == run_schedule(engine, schedule)


def test_long_prompt_does_not_stall_running_streams(tiny_family):
    folder, _ = tiny_family("llama")
    chunk = 16
    engine = load_engine(str(folder), device="cpu", max_batch=9, max_seq_len=256, prefill_chunk=chunk)
    streams = [engine.add_request([i + 1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(8)]
    got = {rid: [] for rid in streams}
    for _ in range(4):  # all 8 decoding (greedy steps are pipelined: a step's tokens are read by the next)
        for ev in engine.step():
            got[ev.request_id].append(ev.token_id)
    assert all(len(tokens) >= 2 for tokens in got.values())
    long_id = engine.add_request([(5 * i) % 250 + 1 for i in range(200)], SamplingParams(max_tokens=2))
    # per stream: prompt tokens prefilled since its last token (the injected cost of a gap), worst seen
    since = dict.fromkeys(streams, 0)
    worst, steps, first_token_step = 0, 0, None
    while first_token_step is None:
        before = engine.stats.prefill_tokens
        events = engine.step()
        steps += 1
        prefilled = engine.stats.prefill_tokens - before
        assert prefilled <= chunk
        seen = {ev.request_id for ev in events if ev.token_id is not None}
        for rid in streams:
            since[rid] += prefilled
            assert rid in seen, f"stream {rid} got no token at step {steps}"  # a gap of one step, never more
            worst = max(worst, since[rid])
            since[rid] = 0
        if long_id in seen:
            first_token_step = steps
        assert steps < 50
    assert first_token_step == -(-200 // chunk)  # 13 steps of 16 tokens
    assert worst == chunk
