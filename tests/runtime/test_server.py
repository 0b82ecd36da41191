"""The OpenAI-compatible server, driven by a real HTTP client (httpx) over loopback.

uvicorn runs in a background thread on a free 127.0.0.1 port; the engine behind it is a deterministic
fake implementing ``types.Engine`` (its tokens are a function of the prompt, so a mixed-up answer is
caught), which also asserts that one thread makes every engine call. Every test is bounded in requests
and seconds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager

import pytest

from quantkit.config import QuantkitError
from quantkit.runtime.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams, TokenEvent

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


class FakeEngine:
    """A deterministic continuous-batching engine: request ``r`` with prompt ``P`` generates token
    ``k`` = ``fake_token(P, k)`` with text ``" t<id>"``; stop strings end it ("stop"), max_tokens or a
    full slot too ("length"). ``gate`` cleared blocks ``step`` (to fill the queue)."""

    def __init__(self, tokenizer, *, max_batch=4, max_seq_len=64, step_delay=0.0, name="fake-model"):
        self._tokenizer, self._max_batch, self._max_seq_len, self._name = tokenizer, max_batch, max_seq_len, name
        self.step_delay = step_delay
        self.gate = threading.Event()
        self.gate.set()
        self.waiting: deque[int] = deque()
        self.running: dict[int, dict] = {}
        self.params: dict[int, SamplingParams] = {}
        self.prompts: dict[int, list[int]] = {}
        self.aborted: set[int] = set()
        self._abort_events: list[int] = []
        self.threads: set[int] = set()
        self.poison: int | None = None  # a prompt holding this id makes step raise; poison + 1 first: add_request
        self._next_id = 0

    max_seq_len = property(lambda self: self._max_seq_len)
    max_batch = property(lambda self: self._max_batch)
    tokenizer = property(lambda self: self._tokenizer)
    model_name = property(lambda self: self._name)

    @staticmethod
    def fake_token(prompt_ids: list[int], k: int) -> int:
        return (sum(prompt_ids) * 31 + 7 * k) % 1000

    @classmethod
    def expected(cls, prompt_ids: list[int], max_tokens: int) -> str:
        return "".join(f" t{cls.fake_token(prompt_ids, k)}" for k in range(max_tokens))

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())
        assert len(self.threads) == 1, "the engine was called from more than one thread"

    def add_request(self, prompt_ids, params):
        self._touch()
        if not prompt_ids or len(prompt_ids) + 1 > self._max_seq_len:
            raise QuantkitError("prompt does not fit")
        if self.poison is not None and prompt_ids[0] == self.poison + 1:
            raise RuntimeError("add_request exploded")
        rid, self._next_id = self._next_id, self._next_id + 1
        self.params[rid], self.prompts[rid] = params, list(prompt_ids)
        self.waiting.append(rid)
        return rid

    def abort(self, request_id):
        self._touch()
        if request_id in self.waiting or request_id in self.running:
            self.aborted.add(request_id)
            self._abort_events.append(request_id)
            self.running.pop(request_id, None)
            if request_id in self.waiting:
                self.waiting.remove(request_id)

    def has_work(self):
        self._touch()
        return bool(self.waiting or self.running or self._abort_events)

    def step(self):
        self._touch()
        self.gate.wait(30)
        time.sleep(self.step_delay)
        events = [TokenEvent(rid, None, "", True, FINISH_ABORT) for rid in self._abort_events]
        self._abort_events.clear()
        while self.waiting and len(self.running) < self._max_batch:
            rid = self.waiting.popleft()
            self.running[rid] = {"k": 0, "text": ""}
        if self.poison is not None and any(self.poison in self.prompts[rid] for rid in self.running):
            raise RuntimeError("step exploded")
        for rid, state in list(self.running.items()):
            events.append(self._advance(rid, state))
        return events

    def _advance(self, rid: int, state: dict) -> TokenEvent:
        prompt, params = self.prompts[rid], self.params[rid]
        token = self.fake_token(prompt, state["k"])
        state["k"] += 1
        text, finish = f" t{token}", None
        state["text"] += text
        for stop in params.stop:
            if stop in state["text"]:
                cut = state["text"].index(stop)
                text = text[: max(0, len(text) - (len(state["text"]) - cut))]
                finish = FINISH_STOP
        if finish is None and (state["k"] >= params.max_tokens or len(prompt) + state["k"] >= self._max_seq_len):
            finish = FINISH_LENGTH
        if finish:
            del self.running[rid]
        return TokenEvent(rid, token, text, finish is not None, finish, len(prompt), state["k"])


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@contextmanager
def running_server(engine, wait_warm=True, **config):
    """uvicorn serving ``engine`` on a free loopback port in a background thread, once it has warmed up (unless
    ``wait_warm`` is False): yields (url, app)."""
    from quantkit.runtime.server import ServerConfig, uvicorn_server

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn_server(engine, ServerConfig(port=port, log_level="warning", shutdown_timeout=2, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    # as an orchestrator waits for /health: until then the app's own warm-up requests hold places (a server of
    # one place would answer a request sent now with 503)
    while wait_warm and not server.config.app.state.service.http_warm:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not finish its warm-up"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server.config.app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def sse_events(lines) -> list:
    """The data payloads of a server-sent event stream (JSON decoded; the final "[DONE]" kept as is)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def assert_error(response, status, *, param=None, code=None, contains=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if contains is not None:
        assert contains in error["message"], error
    return error


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = FakeEngine(tokenizer, max_batch=4, max_seq_len=64)
    with running_server(engine, max_queue=8, max_tokens=32) as (url, app):
        with httpx.Client(base_url=url, timeout=20) as client:
            yield client, engine, app


# -- answers --------------------------------------------------------------------------------------


def test_completion_text_usage_and_sampling_params(served, tokenizer):
    client, engine, _ = served
    body = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0.7,
            "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "seed": 3, "stop": ["zzz"], "user": "ignored"}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    prompt_ids = tokenizer("the quick brown fox")["input_ids"]
    assert data["object"] == "text_completion" and data["model"] == "fake-model" and data["id"].startswith("cmpl-")
    assert data["choices"][0]["text"] == FakeEngine.expected(prompt_ids, 5)
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5}
    rid = max(engine.params)
    assert engine.prompts[rid] == prompt_ids
    assert engine.params[rid] == SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=5,
                                                repetition_penalty=1.1, seed=3, stop=("zzz",))


def test_completion_defaults_token_prompt_and_stop(served):
    client, engine, _ = served
    data = client.post("/v1/completions", json={"prompt": [5, 6, 9]}).json()
    assert data["choices"][0]["text"] == FakeEngine.expected([5, 6, 9], 16)  # OpenAI's default max_tokens
    assert engine.params[max(engine.params)] == SamplingParams(max_tokens=16, temperature=1.0)
    stop = FakeEngine.expected([5, 6, 9], 3)[-4:]  # the third token's text ends the answer before it
    data = client.post("/v1/completions", json={"prompt": [[5, 6, 9]], "stop": stop, "max_tokens": 10}).json()
    assert data["choices"][0]["text"] == FakeEngine.expected([5, 6, 9], 3)[:-4]
    assert data["choices"][0]["finish_reason"] == "stop"


def test_chat_uses_the_tokenizer_template(served, tokenizer):
    client, engine, _ = served
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "the lazy dog"}]}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4,
                                                         "temperature": 0})
    assert response.status_code == 200, response.text
    data = response.json()
    text = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "the lazy dog"}],
                                         add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert engine.prompts[max(engine.prompts)] == prompt_ids
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["choices"][0]["message"] == {"role": "assistant", "content": FakeEngine.expected(prompt_ids, 4)}
    assert data["usage"]["prompt_tokens"] == len(prompt_ids) and data["usage"]["completion_tokens"] == 4
    # Left out, max_tokens is the server's limit (32), cut by the engine to what the slot holds.
    client.post("/v1/chat/completions", json={"messages": messages})
    assert engine.params[max(engine.params)].max_tokens == 32


def test_streaming_completion_matches_the_whole_answer(served):
    client, _, _ = served
    body = {"prompt": [11, 12], "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == FakeEngine.expected([11, 12], 6)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_streaming_chat_deltas(served):
    client, _, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0] for e in events[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert len([d for d in deltas if d["delta"].get("content")]) == 3
    assert deltas[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_models_and_health(served):
    client, _, _ = served
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["max_model_len"] == 64
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["capacity"] == 4 + 8


# -- bad requests ---------------------------------------------------------------------------------


def test_malformed_bodies_answer_400(served):
    client, _, _ = served
    headers = {"content-type": "application/json"}
    assert_error(client.post("/v1/completions", content=b'{"prompt": "x",', headers=headers), 400, code="invalid_json")
    assert_error(client.post("/v1/completions", content=b"", headers=headers), 400, code="invalid_json")
    assert_error(client.post("/v1/completions", content=b"\xff\xfe", headers=headers), 400, code="invalid_json")
    assert_error(client.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}', headers=headers),
                 400, code="invalid_json")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, contains="JSON object")
    assert_error(client.post("/v1/chat/completions", json={"model": "fake-model"}), 400, param="messages")
    assert_error(client.post("/v1/completions", content=b"x" * (1 << 21), headers=headers), 413)
    assert_error(client.get("/v1/nothing"), 404)
    assert client.get("/health").status_code == 200  # still up


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "max_tokens": 33}, "max_tokens"),
])
def test_wrong_fields_answer_400_naming_the_field(served, body, param):
    client, _, _ = served
    assert_error(client.post("/v1/completions", json=body), 400, param=param)


def test_chat_message_types_are_checked(served):
    client, _, _ = served
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}),
                 400, param="messages.0.role")
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, param="messages")
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": image}]}),
                 400, param="messages.0.content")


def test_over_long_prompt_answers_400(served):
    client, engine, _ = served
    error = assert_error(client.post("/v1/completions", json={"prompt": list(range(1, 65))}), 400,
                         param="prompt", code="context_length_exceeded")
    assert "64 tokens" in error["message"] and "at most 63" in error["message"]
    long_chat = {"messages": [{"role": "user", "content": "the quick brown fox " * 40}]}
    assert_error(client.post("/v1/chat/completions", json=long_chat), 400, param="messages",
                 code="context_length_exceeded")
    assert client.post("/v1/completions", json={"prompt": list(range(1, 64)), "max_tokens": 1}).status_code == 200


def test_unknown_model_answers_404(served):
    client, _, _ = served
    assert_error(client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"}), 404,
                 param="model", code="model_not_found", contains="fake-model")
    assert client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"}).status_code == 200


def test_no_chat_template_answers_400(tokenizer):
    from tests.conftest import tiny_tokenizer

    with running_server(FakeEngine(tiny_tokenizer())) as (url, _):
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert_error(response, 400, param="messages", code="no_chat_template")


def test_serve_command_checks_options_before_loading(tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    runner = CliRunner()
    assert "--max-queue" in runner.invoke(app, ["serve", "--help"]).output
    for args, message in ((["--port", "70000"], "--port"), (["--max-queue", "-1"], "--max-queue"),
                          (["--max-tokens", "0"], "--max-tokens"), (["--log-level", "loud"], "--log-level")):
        result = runner.invoke(app, ["serve", str(tmp_path / "no-such-model"), *args])
        assert isinstance(result.exception, QuantkitError) and message in str(result.exception), result.output
