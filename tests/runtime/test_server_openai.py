"""The server as the official ``openai`` client meets it (loopback, the fake engine of test_server.py): every
field the server does not implement, and every unknown one, is a 400 naming it with a non-null code; the
smaller points of issue 40 (messages without content, non-JSON bodies, Retry-After, /v1/models created)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from tests.runtime.test_server import FakeEngine, assert_error, running_server, tokenizer, wait_until  # noqa: E402, F401

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tokenizer):  # noqa: F811  (the imported fixture)
    engine = FakeEngine(tokenizer, max_batch=4, max_seq_len=64)
    before = time.time()
    with running_server(engine, max_queue=8, max_tokens=32) as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
        yield client, url, engine, before


def refused(call, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param, error
    assert error["code"] and error["type"] == "invalid_request_error" and param in error["message"], error
    return error


@pytest.mark.parametrize(("field", "value"), [
    ("n", 2), ("logprobs", True), ("top_logprobs", 2), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
    ("logit_bias", {"5": 10}), ("parallel_tool_calls", False), ("tool_choice", "required"),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]), ("store", True),
    ("reasoning_effort", "high"), ("prediction", {"type": "content", "content": "x"}),
])
def test_chat_fields_not_implemented_answer_400(served, field, value):
    client = served[0]
    refused(lambda: client.chat.completions.create(model="fake-model", messages=USER, max_tokens=2,
                                                   **{field: value}), field)


@pytest.mark.parametrize(("field", "value"), [("echo", True), ("best_of", 2), ("suffix", "end"), ("logprobs", 2),
                                              ("n", 3)])
def test_completion_fields_not_implemented_answer_400(served, field, value):
    client = served[0]
    refused(lambda: client.completions.create(model="fake-model", prompt="x", max_tokens=2, **{field: value}), field)


def test_unknown_fields_answer_400(served):
    client = served[0]
    error = refused(lambda: client.chat.completions.create(model="fake-model", messages=USER,
                                                           extra_body={"foo": 1}), "foo")
    assert error["code"] == "unknown_parameter"
    refused(lambda: client.completions.create(model="fake-model", prompt="x", extra_body={"guided_json": {}}),
            "guided_json")


def test_neutral_values_and_user_are_accepted(served):
    client = served[0]
    answer = client.chat.completions.create(model="fake-model", messages=USER, max_tokens=2, n=1, logprobs=False,
                                            presence_penalty=0, frequency_penalty=0.0, user="u1", store=False)
    assert answer.choices[0].finish_reason == "length"


def test_messages_need_content_unless_assistant_tool_calls(served):
    client, url, engine, _ = served
    refused(lambda: client.chat.completions.create(model="fake-model", messages=[{"role": "user"}]),
            "messages.0.content")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert client.chat.completions.create(model="fake-model", messages=ok, max_tokens=1).choices
    refused(lambda: client.chat.completions.create(model="fake-model", messages=[{"role": "assistant"}]),
            "messages.0.content")


def test_codes_are_never_null_and_non_json_is_415(served):
    _, url, _, _ = served
    for response in (httpx.post(f"{url}/v1/completions", json=[1]),
                     httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stop": list("abcde")}),
                     httpx.get(f"{url}/v1/nothing")):
        assert response.json()["error"]["code"], response.text
    assert_error(httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x"}',
                            headers={"content-type": "text/plain"}), 415, code="unsupported_media_type")
    assert_error(httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x"}'), 415)
    charset = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                         headers={"content-type": "application/json; charset=utf-8"})
    assert charset.status_code == 200, charset.text


def test_models_created_is_the_load_time(served):
    client, _, _, before = served
    (model,) = client.models.list().data
    assert before - 5 <= model.created <= time.time()


def test_503_carries_retry_after(tokenizer):  # noqa: F811
    engine = FakeEngine(tokenizer, max_batch=1)
    with running_server(engine, max_queue=0) as (url, app):
        engine.gate.clear()
        thread = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions",
                                                            json={"prompt": [3], "max_tokens": 1}, timeout=30))
        thread.start()
        try:
            wait_until(lambda: app.state.worker.in_flight == 1, what="one request in flight")
            response = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
            assert_error(response, 503, code="queue_full")
            assert int(response.headers["retry-after"]) >= 1
        finally:
            engine.gate.set()
            thread.join(30)


def test_prompt_plus_max_tokens_beyond_the_context(served):
    client, url, engine, _ = served  # max_seq_len 64
    error = refused(lambda: client.completions.create(model="fake-model", prompt=list(range(1, 61)), max_tokens=10),
                    "max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert "64" in error["message"] and "70" in error["message"] and "60 in the prompt" in error["message"]
    assert "at most 4" in error["message"]
    fits = client.completions.create(model="fake-model", prompt=list(range(1, 61)), max_tokens=4)
    assert fits.usage.completion_tokens == 4 and fits.choices[0].finish_reason == "length"
    # Left out, max_tokens is clipped to what fits (chat: the server's limit of 32, cut to 64 - prompt).
    long_chat = [{"role": "user", "content": "a b c d e f g h i j k l m n o p q r s t"}]
    answer = client.chat.completions.create(model="fake-model", messages=long_chat)
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 64
    assert answer.choices[0].finish_reason == "length"
    refused(lambda: client.chat.completions.create(model="fake-model", messages=long_chat, max_tokens=32),
            "max_tokens")


def test_metrics_parse_as_prometheus_text(tokenizer):  # noqa: F811
    from prometheus_client.parser import text_string_to_metric_families

    engine = FakeEngine(tokenizer, max_batch=4, max_seq_len=64, step_delay=0.002)
    with running_server(engine, max_tokens=32) as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
        client.completions.create(model="fake-model", prompt=[5, 6], max_tokens=5)
        list(client.chat.completions.create(model="fake-model", messages=USER, max_tokens=4, stream=True))
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="fake-model", prompt="x", extra_body={"foo": 1})
        response = httpx.get(f"{url}/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("quantkit_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert samples[("quantkit_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 1
    assert samples[("quantkit_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
    assert samples[("quantkit_generation_tokens_total", ())] == 5 + 4
    assert samples[("quantkit_prompt_tokens_total", ())] > 2
    assert families["quantkit_time_to_first_token_seconds"].type == "histogram"
    assert samples[("quantkit_time_to_first_token_seconds_count", ())] == 2
    assert samples[("quantkit_inter_token_latency_seconds_count", ())] == (5 - 1) + (4 - 1)
    assert samples[("quantkit_request_latency_seconds_count", ())] == 2
    for gauge in ("quantkit_requests_running", "quantkit_requests_waiting", "quantkit_requests_in_flight",
                  "quantkit_kv_cache_usage_ratio"):
        assert samples[(gauge, ())] == 0, gauge
    assert samples[("quantkit_kv_cache_slots", ())] == 4


def test_metrics_of_the_real_engine_show_kv_use(tiny_family):
    """While requests run on the real engine the queue depth and KV-cache use are non-zero.

    The engine's worker is held after a step that left requests in the cache, and /metrics is read then: polling
    while the requests ran raced them (a fast machine finished all three between two reads)."""
    from prometheus_client.parser import text_string_to_metric_families

    from quantkit.runtime.loader import load_engine

    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=64)
    with running_server(engine, max_tokens=60) as (url, app):
        step, holding, release = engine.step, threading.Event(), threading.Event()

        def held_step():
            events = step()
            if engine.num_running and not release.is_set():
                holding.set()
                release.wait(30)
            return events

        engine.step = held_step  # the worker looks the method up on the engine at each step
        statuses = []

        def call(i):
            body = {"prompt": [i + 1] * 8, "max_tokens": 20, "ignore_eos": True}
            statuses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            assert holding.wait(30), "no engine step left a request running"
            text = httpx.get(f"{url}/metrics", timeout=10).text
        finally:
            release.set()
            for t in threads:
                t.join(30)
    seen = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert seen["quantkit_kv_cache_usage_ratio"] > 0
    assert seen["quantkit_requests_running"] > 0
    assert statuses == [200, 200, 200]


def test_every_503_carries_retry_after(tokenizer, monkeypatch):  # noqa: F811
    """Besides a full queue (above): a request arriving while the server drains, and one the engine worker
    cannot take, are 503s with Retry-After too; /health says draining."""
    from quantkit.runtime.async_engine import RequestFailed

    with running_server(FakeEngine(tokenizer)) as (url, app):
        service, worker = app.state.service, app.state.worker
        service.draining = True
        try:
            response = httpx.post(f"{url}/v1/completions", json={"prompt": [3], "max_tokens": 1}, timeout=10)
            assert_error(response, 503, code="server_shutdown")
            assert int(response.headers["retry-after"]) >= 1
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "draining"
        finally:
            service.draining = False

        def dead(*args, **kwargs):
            raise RequestFailed("the engine worker is not running", client_error=False)

        monkeypatch.setattr(worker, "submit", dead)
        response = httpx.post(f"{url}/v1/completions", json={"prompt": [3], "max_tokens": 1}, timeout=10)
        assert_error(response, 503, code="engine_unavailable")
        assert int(response.headers["retry-after"]) >= 1
