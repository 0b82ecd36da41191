"""Warm-up before /health says ready: the engine runs its prefill and decode shapes, the worker does so before
the first request, and /health answers 503 "warming_up" until then."""

from __future__ import annotations

import importlib.util
import threading

import pytest

from quantkit.runtime.warmup import WarmRequest, prefill_lengths, request_scenarios


def test_prefill_lengths_cover_the_chunk():
    assert prefill_lengths(256, 4096) == (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 23, 24, 31, 32, 47, 48, 63, 64,
                                          95, 96, 127, 128, 191, 192, 255, 256)
    assert prefill_lengths(2048, 100) == (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 23, 24, 31, 32, 47, 48, 63, 64,
                                          98, 99)
    assert prefill_lengths(1, 64) == (1,)
    assert prefill_lengths(256, 4096, off_16=False) == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the CPU's
    lengths = prefill_lengths(2048, 4096)  # every power-of-two bucket at its top, on and off a multiple of 16
    assert {n % 16 == 0 for n in lengths if n > 16} == {True, False} and lengths[-1] == 2048


def _w4a16_specialization(m: int, plan) -> tuple:
    """What Triton compiles a W4A16 launch for at ``m`` rows: the bucket's kernel and config, its constexprs
    that depend on ``m``, and the integer arguments derived from ``m`` as Triton specializes them (== 1,
    % 16) -- the arithmetic of ``kernels/w4a16_gluon.launch``."""
    choice = plan.choice(m)
    key = (choice.kernel, choice.config, m == 1, m % 16 == 0)
    if choice.kernel != "gluon":
        return key
    block_m = choice.config.block_m(m)
    if choice.config.DIRECT:
        return key + (block_m,)
    tiles_m = -(-m // block_m)
    return key + (block_m, choice.config.STREAM_K and tiles_m == 1, tiles_m == 1, tiles_m % 16 == 0)


@pytest.mark.parametrize("n,k", [(576, 1536), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (2048, 1024), (4096, 2048)])
def test_prefill_lengths_meet_every_w4a16_specialization_of_a_chunk(n, k):
    """Every kernel variant that some prefill of 1..2048 rows launches on Hopper is compiled by the warm-up's
    lengths (in the H100 cold-start run, 5-7 prompts of 128 tokens at once met a tile count of 10-14 at
    bucket 1024, which 1023 and 1024 rows, both 16 tiles, never had)."""
    from quantkit.kernels.w4a16_select import LayerFacts, plan_w4a16

    plan = plan_w4a16(LayerFacts(n, k, 4, 128, False, False), "sm90")
    needed = {_w4a16_specialization(m, plan) for m in range(1, 2049)}
    warmed = {_w4a16_specialization(m, plan) for m in prefill_lengths(2048, 4096)}
    assert needed - warmed == set()


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
    from quantkit.runtime.server_warmup import warmup_requests
    from tests.runtime.test_server import FakeEngine, running_server, wait_until

    release = threading.Event()

    class SlowToWarm(FakeEngine):
        warmed = False

        def warm_up(self):
            self._touch()  # on the engine's own thread
            release.wait(20)
            self.warmed = True

    engine = SlowToWarm(tokenizer)
    with running_server(engine, wait_warm=False) as (url, app):
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
        # before ready, the app answered its own requests through the HTTP stack (server_warmup): the engine saw
        # them, the metrics did not (the client's request is the one completion counted)
        assert len(engine.prompts) == 1 + len(warmup_requests("m", chat=False))  # no chat template here
        metrics = httpx.get(f"{url}/metrics").text
        assert 'quantkit_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics
        assert "/v1/chat/completions" not in metrics


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import tiny_tokenizer

    return tiny_tokenizer()


def test_a_failing_http_warm_up_still_turns_health_ready(tokenizer, monkeypatch, caplog):
    """The HTTP warm-up is best effort: if it raises, the server logs it and /health still says ok."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from quantkit.runtime import server
    from tests.runtime.test_server import FakeEngine, running_server

    async def broken(app, requests, timeout_s=60.0):
        raise RuntimeError("warm-up exploded")

    monkeypatch.setattr(server, "warm_http", broken)
    with running_server(FakeEngine(tokenizer)) as (url, _):
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        response = httpx.post(f"{url}/v1/completions", json={"prompt": [4], "max_tokens": 3})
        assert response.json()["choices"][0]["text"] == FakeEngine.expected([4], 3)
    assert "HTTP warm-up failed" in caplog.text
