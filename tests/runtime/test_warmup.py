"""Warm-up before /health says ready: the engine runs its prefill and decode shapes, the worker does so before
the first request, and /health answers 503 "warming_up" until then."""

from __future__ import annotations

import importlib.util
import threading

import pytest

from quantkit.runtime.warmup import WarmRequest, prefill_lengths, request_scenarios


def test_prefill_lengths_cover_the_chunk():
    assert prefill_lengths(256, 4096) == (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256)
    assert prefill_lengths(2048, 100) == (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 98, 99)
    assert prefill_lengths(1, 64) == (1,)
    assert prefill_lengths(256, 4096, off_16=False) == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the CPU's
    lengths = prefill_lengths(2048, 4096)  # every power-of-two bucket at its top, on and off a multiple of 16
    assert {n % 16 == 0 for n in lengths if n > 16} == {True, False} and lengths[-1] == 2048


def test_engine_warm_up_runs_every_shape_and_leaves_it_serving(tiny_family):
    from quantkit.runtime.loader import load_engine
    from quantkit.runtime.types import SamplingParams
    from tests.runtime.test_engine import run_schedule

    folder, _ = tiny_family("llama")
    cold = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=64, prefill_chunk=16)
    warm = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=64, prefill_chunk=16)
    report = warm.warm_up()
    assert report.prefill_lengths == (1, 2, 4, 8, 16) and report.decode_buckets == (1, 2, 4)  # nothing compiles
    assert report.seconds > 0 and "warm-up" in report.describe()
    assert report.grammar == (importlib.util.find_spec("llguidance") is not None)
    assert not warm.has_work() and warm.stats.prefill_tokens == 0  # the engine's own books are untouched
    schedule = [(0, [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)),
                (1, list(range(1, 40)), SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True))]
    assert run_schedule(warm, schedule) == run_schedule(cold, schedule)  # stale warm-up keys are never read


def test_request_scenarios_cover_several_prompts_a_split_chunk_and_a_long_prompt_among_decoders():
    two, three, four, burst, every, long = request_scenarios(32, 4096, 2048)
    assert [len(w) for w in (two, three, four)] == [2, 3, 4]  # the output head's GEMV rows, 2-4
    assert [r.prompt_tokens for r in burst] == [5, 37, 128, 1, 64, 17, 200, 96]
    assert {r.sampled for r in burst} == {True, False}
    assert len(every) == 32 and sum(r.prompt_tokens for r in every) > 2048  # chunks split prompts
    assert long[1] == WarmRequest(2048 + 37, 2, steps_before=2) and long[1].prompt_tokens % 16
    small = request_scenarios(2, 12, 16)  # everything clipped to what a slot holds
    assert all(1 <= r.prompt_tokens <= 8 for wave in small for r in wave) and [len(w) for w in small] == [2, 2, 2, 2]
    assert request_scenarios(1, 64, 16)[-1] == [WarmRequest(60, 2)]  # one slot: no wave that needs two
    assert request_scenarios(4, 4, 16) == []


def test_warm_up_requests_run_through_the_scheduler_and_leave_no_trace(tiny_family):
    from quantkit.runtime.loader import load_engine
    from quantkit.runtime.types import SamplingParams
    from tests.runtime.test_engine import run_schedule

    folder, _ = tiny_family("llama")
    cold = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=64, prefill_chunk=16)
    warm = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=64, prefill_chunk=16)
    seen = []
    step = warm.step
    warm.step = lambda: seen.append((len(warm._prefilling), len(warm._running))) or step()
    report = warm.warm_up(requests=True)
    del warm.step
    assert report.requests == 2 + 3 + 4 + 4 + 4 + 2 and "19 requests through the scheduler" in report.describe()
    assert any(p >= 2 for p, _ in seen)  # several prompts in one prefill
    assert any(p >= 1 and r >= 1 for p, r in seen)  # a prompt prefilled beside decoding rows
    assert not warm.has_work() and warm.stats.prefill_tokens == 0 and warm.stats.decode_tokens == 0
    assert sorted(warm._free_slots) == [0, 1, 2, 3]
    schedule = [(0, [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)),
                (1, list(range(1, 40)), SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True))]
    assert run_schedule(warm, schedule) == run_schedule(cold, schedule)
    assert cold.warm_up().requests == 0  # the CPU's reference backend compiles nothing: no requests by default


def test_a_failing_warm_up_step_leaves_no_request_in_the_engine(tiny_family):
    from quantkit.runtime.loader import load_engine

    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=64, prefill_chunk=16)
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:  # inside the first wave, with requests prefilled and decoding
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_step
    with pytest.raises(RuntimeError, match="device lost"):
        engine.warm_up(requests=True)
    del engine.step
    assert not engine._queue and not engine._running and not engine._prefilling
    assert sorted(engine._free_slots) == [0, 1, 2, 3] and engine.stats.prefill_tokens == 0


def test_health_is_503_until_warm(tokenizer):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from tests.runtime.test_server import FakeEngine, running_server, wait_until

    release = threading.Event()

    class SlowToWarm(FakeEngine):
        warmed = False

        def warm_up(self):
            self._touch()  # on the engine's own thread
            release.wait(20)
            self.warmed = True

    engine = SlowToWarm(tokenizer)
    with running_server(engine) as (url, app):
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "warming_up"
        result = {}
        caller = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": [4], "max_tokens": 3}, timeout=30)))
        caller.start()  # a request sent while warming up waits, then is served
        release.set()
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, what="ready")
        caller.join(20)
        assert engine.warmed and result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["text"] == FakeEngine.expected([4], 3)


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import tiny_tokenizer

    return tiny_tokenizer()
