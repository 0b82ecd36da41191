"""Warm-up before /health says ready: the engine runs its prefill and decode shapes, the worker does so before
the first request, and /health answers 503 "warming_up" until then."""

from __future__ import annotations

import importlib.util
import threading

import pytest

from quantkit.runtime.warmup import prefill_lengths


def test_prefill_lengths_cover_the_chunk():
    assert prefill_lengths(256, 4096) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert prefill_lengths(2048, 100) == (1, 2, 4, 8, 16, 32, 64, 99)
    assert prefill_lengths(1, 64) == (1,)


def test_engine_warm_up_runs_every_shape_and_leaves_it_serving(tiny_family):
    from quantkit.runtime.loader import load_engine
    from quantkit.runtime.types import SamplingParams
    from tests.runtime.test_engine import run_schedule

    folder, _ = tiny_family("llama")
    cold = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=64, prefill_chunk=16)
    warm = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=64, prefill_chunk=16)
    report = warm.warm_up()
    assert report.prefill_lengths == (1, 2, 4, 8, 16) and report.decode_buckets == (1, 2, 4)
    assert report.seconds > 0 and "warm-up" in report.describe()
    assert report.grammar == (importlib.util.find_spec("llguidance") is not None)
    assert not warm.has_work() and warm.stats.prefill_tokens == 0  # the engine's own books are untouched
    schedule = [(0, [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)),
                (1, list(range(1, 40)), SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True))]
    assert run_schedule(warm, schedule) == run_schedule(cold, schedule)  # stale warm-up keys are never read


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
