"""The continuous-batching engine on the CPU reference path (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantkitError
from quantkit.runtime.loader import load_engine
from quantkit.runtime.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams


def run_schedule(engine, schedule):
    """Add each (step, prompt, params) at its step and step until idle; per request: (tokens, text, finish)."""
    ids, tokens, texts, finish, step = {}, {}, {}, {}, 0
    pending = list(schedule)
    while pending or engine.has_work():
        for entry in [e for e in pending if e[0] <= step]:
            ids[engine.add_request(entry[1], entry[2])] = len(ids)
            pending.remove(entry)
        for ev in engine.step():
            i = ids[ev.request_id]
            assert i not in finish, "an event after the request finished"
            if ev.token_id is not None:
                tokens.setdefault(i, []).append(ev.token_id)
            texts[i] = texts.get(i, "") + ev.text
            if ev.finished:
                finish[i] = ev.finish_reason
        step += 1
        assert step < 500
    return [(tokens.get(i, []), texts.get(i, ""), finish[i]) for i in range(len(ids))]


@pytest.fixture(scope="module")
def llama(tiny_family):
    folder, hf = tiny_family("llama")
    return folder, hf


def test_greedy_equals_transformers_generate(llama):
    folder, hf = llama
    engine = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=64)
    prompt = [5, 17, 99, 3, 42, 8]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    (tokens, _, reason), = run_schedule(engine, [(0, prompt, params)])
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(prompt):].tolist()
    assert tokens == expected and reason == FINISH_LENGTH


def test_quantized_greedy_equals_transformers_generate(tiny_quantized):
    import quantkit

    folder = tiny_quantized("rtn")
    hf, _ = quantkit.load_quantized(folder, device="cpu", dtype=torch.float32)
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=32)
    prompt = [7, 1, 200, 33]
    (tokens, _, _), = run_schedule(engine, [(0, prompt, SamplingParams(max_tokens=10, ignore_eos=True))])
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(prompt):].tolist()
    assert tokens == expected


def test_requests_joining_midway_get_the_tokens_they_get_alone(llama):
    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=3, max_seq_len=64)
    greedy = SamplingParams(max_tokens=9, ignore_eos=True)
    sampled = SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    requests = [([4, 9, 2], greedy), ([11, 12, 13, 14, 15, 16], sampled), ([30, 1], greedy), ([8] * 5, greedy)]
    alone = [run_schedule(engine, [(0, p, s)])[0] for p, s in requests]
    # joining at steps 0, 2, 3 and 5: the fourth waits for a free slot (max_batch 3)
    together = run_schedule(engine, [(step, p, s) for step, (p, s) in zip([0, 2, 3, 5], requests)])
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert all(len(t[0]) == s.max_tokens for t, (_, s) in zip(together, requests))


def test_eos_stop_ids_and_stop_strings(llama):
    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=64)
    prompt = [5, 17, 99]
    (free_tokens, free_text, _), = run_schedule(engine, [(0, prompt, SamplingParams(max_tokens=12, ignore_eos=True))])
    # a stop token id ends the request at that token, which adds no text
    stop_at = free_tokens[3]
    (tokens, _, reason), = run_schedule(engine, [(0, prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))])
    assert reason == FINISH_STOP and tokens == free_tokens[: free_tokens.index(stop_at) + 1]
    # a stop string spanning a token boundary: the text ends right before it
    assert len(free_text) > 6
    stop = free_text[4:7]
    (_, text, reason), = run_schedule(engine, [(0, prompt, SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True))])
    assert reason == FINISH_STOP and text == free_text[: free_text.index(stop)]
    # the engine's eos (the generation config's) stops unless ignore_eos
    engine.eos_token_ids = frozenset({free_tokens[1]})
    (tokens, _, reason), = run_schedule(engine, [(0, prompt, SamplingParams(max_tokens=12))])
    assert reason == FINISH_STOP and tokens == free_tokens[: free_tokens.index(free_tokens[1]) + 1]


def test_max_tokens_is_cut_to_the_slot(llama):
    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=10)
    (tokens, _, reason), = run_schedule(engine, [(0, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))])
    assert len(tokens) == 4 and reason == FINISH_LENGTH


def test_abort_frees_the_slot_and_finishes_once(llama):
    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=64)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    first = engine.add_request([1, 2, 3], params)
    queued = engine.add_request([4, 5], params)
    engine.step()
    engine.step()
    engine.abort(first)
    engine.abort(queued)
    engine.abort(12345)  # unknown ids are ignored
    events = engine.step()
    finals = [e for e in events if e.finished]
    assert sorted(e.request_id for e in finals) == [first, queued]
    assert all(e.finish_reason == FINISH_ABORT for e in finals)
    assert not engine.has_work()
    # the slot is free again: a new request runs to its end
    (tokens, _, reason), = run_schedule(engine, [(0, [9, 9], SamplingParams(max_tokens=3, ignore_eos=True))])
    assert len(tokens) == 3 and reason == FINISH_LENGTH


def test_bad_requests_raise(llama):
    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=8)
    with pytest.raises(QuantkitError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(QuantkitError, match="shorten"):
        engine.add_request(list(range(8)), SamplingParams())
    with pytest.raises(QuantkitError, match="vocabulary"):
        engine.add_request([1, 10**6], SamplingParams())
    with pytest.raises(QuantkitError, match="SamplingParams"):
        engine.add_request([1], {"max_tokens": 3})
    with pytest.raises(QuantkitError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_greedy_decoding_is_pipelined_one_step_behind(llama):
    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=64)
    chained = []
    chain = engine._runner.chain
    engine._runner.chain = lambda launched: chained.append(launched) or chain(launched)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    (tokens, _, reason), = run_schedule(engine, [(0, [5, 17, 99], params)])
    assert len(tokens) == 10 and reason == FINISH_LENGTH
    # prefill gives token 1, the step for token 2 is launched from the host, those for tokens 3..10 chain on the
    # device, and none is launched past max_tokens: 9 steps for 9 tokens
    assert len(chained) == 8
    assert engine.stats.decode_steps == engine.stats.decode_tokens == 9 and not engine.has_work()
    # a sampled row is read at once: nothing chains
    chained.clear()
    sampled = SamplingParams(max_tokens=6, temperature=0.7, seed=1, ignore_eos=True)
    (tokens, _, _), = run_schedule(engine, [(0, [5, 17, 99], sampled)])
    assert len(tokens) == 6 and not chained


def test_a_stop_inside_the_pipeline_wastes_one_step_and_frees_the_slot_cleanly(llama):
    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=64)
    first, second = [5, 17, 99], [7, 7, 3, 40]
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    (free_tokens, _, _), = run_schedule(engine, [(0, first, free)])
    (second_alone, _, _), = run_schedule(engine, [(0, second, free)])
    # the first request stops on its 5th token while the step for its 6th is already in flight; the second
    # waits for the slot, gets it after that wasted step wrote into it, and must decode as it does alone
    stop_at = free_tokens[4]
    assert stop_at not in free_tokens[:4]
    stopping = SamplingParams(max_tokens=12, stop_token_ids=(stop_at,))
    before = engine.stats.decode_steps, engine.stats.decode_tokens
    (tokens, _, reason), (tokens2, _, _) = run_schedule(engine, [(0, first, stopping), (0, second, free)])
    assert reason == FINISH_STOP and tokens == free_tokens[:5]
    assert tokens2 == second_alone
    steps, emitted = engine.stats.decode_steps - before[0], engine.stats.decode_tokens - before[1]
    assert (steps, emitted) == (4 + 1 + 11, 4 + 11)  # the wasted step ran, its token was not emitted


def test_greedy_agreement_of_the_decode_with_the_prefill_path(llama):
    from quantkit.tools.bench import greedy_agreement

    folder, _ = llama
    engine = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=64)
    report = greedy_agreement(engine, n_prompt=6, n_new=8)
    assert report["tokens"] == 8 and report["first_mismatch"] is None and report["min_top2_gap"] >= 0
