"""The OpenAI-compatible server, driven by a real HTTP client (httpx) over loopback.

uvicorn runs in a background thread on a free 127.0.0.1 port; the engine behind it is a deterministic
fake implementing ``types.Engine`` (its tokens are a function of the prompt, so a mixed-up answer is
caught), which also asserts that one thread makes every engine call. Every test is bounded in requests
and seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import pytest

from quantkit.config import QuantkitError
from quantkit.runtime.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams, TokenEvent

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parents[2]
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
def running_server(engine, **config):
    """uvicorn serving ``engine`` on a free loopback port in a background thread: yields (url, app)."""
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


# -- load, failures, disconnects, shutdown --------------------------------------------------------


def test_full_queue_answers_503_and_recovers(tokenizer):
    engine = FakeEngine(tokenizer, max_batch=1)
    with running_server(engine, max_queue=1) as (url, app):
        worker = app.state.worker
        engine.gate.clear()  # steps block: nothing finishes
        results = {}

        def call(i):
            results[i] = httpx.post(f"{url}/v1/completions", json={"prompt": [3, i], "max_tokens": 2}, timeout=30)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: worker.in_flight == 2, what="two requests in flight")
        assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10), 503, code="queue_full")
        assert httpx.get(f"{url}/health").json()["in_flight"] == 2
        engine.gate.set()
        for t in threads:
            t.join(20)
        assert [results[i].status_code for i in range(2)] == [200, 200]
        assert results[1].json()["choices"][0]["text"] == FakeEngine.expected([3, 1], 2)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [3], "max_tokens": 1}).status_code == 200
        wait_until(lambda: worker.in_flight == 0, what="the places to be freed")


def test_client_disconnect_mid_stream_frees_its_slot(tokenizer):
    engine = FakeEngine(tokenizer, max_batch=2, max_seq_len=512, step_delay=0.02)
    with running_server(engine, max_queue=0, max_tokens=400) as (url, app):
        with httpx.Client(base_url=url, timeout=20) as client:
            body = {"prompt": [4, 4], "max_tokens": 400, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                first = [next(lines) for _ in range(4)]  # two events, each followed by a blank line
                assert first[0].startswith("data: ") and first[2].startswith("data: ")
                rid = max(engine.prompts)
                assert rid in engine.running
            # Leaving the block closed the connection mid-stream: the request must be aborted in the engine.
            wait_until(lambda: rid in engine.aborted and not engine.running and app.state.worker.in_flight == 0,
                       what="the abandoned stream's slot to be freed")
            assert engine.threads and len(engine.threads) == 1
            # Both slots serve again (max_queue=0: a leaked place would answer 503).
            bodies = [{"prompt": [5, i], "max_tokens": 3} for i in range(2)]
            assert all(client.post("/v1/completions", json=b).status_code == 200 for b in bodies)


def test_client_disconnect_without_streaming_aborts(tokenizer):
    engine = FakeEngine(tokenizer, max_batch=1, max_seq_len=512, step_delay=0.02)
    with running_server(engine, max_queue=0, max_tokens=400) as (url, app):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": [6], "max_tokens": 400}, timeout=0.5)
        rid = max(engine.prompts)
        wait_until(lambda: rid in engine.aborted and app.state.worker.in_flight == 0, what="the abort")
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [6], "max_tokens": 2}).status_code == 200


def test_engine_failures_fail_only_their_requests(tokenizer, caplog):
    engine = FakeEngine(tokenizer, max_batch=4)
    engine.poison = 200
    with running_server(engine) as (url, app), httpx.Client(base_url=url, timeout=20) as client:
        with caplog.at_level(logging.ERROR, logger="quantkit.runtime.async_engine"):
            assert_error(client.post("/v1/completions", json={"prompt": [201, 3]}), 500, code="engine_error")
            assert_error(client.post("/v1/completions", json={"prompt": [3, 200], "max_tokens": 2}), 500)
            with client.stream("POST", "/v1/completions", json={"prompt": [200], "stream": True}) as response:
                assert response.status_code == 200  # accepted; the failure comes as an error event
                events = sse_events(response.iter_lines())
            assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        assert "step exploded" in caplog.text and "add_request exploded" in caplog.text
        ok = client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == FakeEngine.expected([3, 4], 2)
        assert client.get("/health").json() | {"in_flight": 0} == client.get("/health").json()
        assert app.state.worker.alive


async def _load(url: str, n_requests: int, concurrency: int, tokenizer) -> list[tuple[str, str]]:
    """``n_requests`` mixed requests (completion / chat, whole / streamed), ``concurrency`` at a time:
    (got, expected) text per request."""
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)

    async def one(client, i):
        prompt = [10 + i % 50, i]
        if i % 4 >= 2:  # chat: the expected prompt is the rendered template
            text = f"request {i}"
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=False)
            prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
        else:
            path, body = "/v1/completions", {"prompt": prompt}
        body |= {"max_tokens": 3 + i % 5, "stream": i % 2 == 1}
        async with limit:
            if body["stream"]:
                async with client.stream("POST", path, json=body) as response:
                    assert response.status_code == 200
                    events = sse_events([line async for line in response.aiter_lines()])
                assert events[-1] == "[DONE]"
                got = "".join((c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "")
                              for c in events[:-1] if c["choices"])
            else:
                response = await client.post(path, json=body)
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                got = choice["text"] if "text" in choice else choice["message"]["content"]
        return got, FakeEngine.expected(prompt, body["max_tokens"])

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n_requests)))


def test_bounded_concurrent_load_every_request_answered(tokenizer):
    engine = FakeEngine(tokenizer, max_batch=8, max_seq_len=128, step_delay=0.002)
    with running_server(engine, max_queue=16) as (url, app):
        started = time.perf_counter()
        answers = asyncio.run(asyncio.wait_for(_load(url, 64, 16, tokenizer), timeout=120))
        seconds = time.perf_counter() - started
        assert len(answers) == 64 and all(got == expected for got, expected in answers)
        assert app.state.worker.in_flight == 0 and not engine.running and not engine.waiting
    logging.getLogger(__name__).info("load: 64 requests, 16 at a time, %.2f s", seconds)
    print(f"\nload test: 64 requests, 16 concurrent, {seconds:.2f} s wall")


SERVE_SCRIPT = """
import socket, sys
sys.path.insert(0, {repo!r})
from tests.runtime.test_server import FakeEngine
from quantkit.runtime.server import ServerConfig, serve

class IdsOnlyTokenizer:  # the prompts here are token ids: no need to load transformers
    def __len__(self):
        return 1000

engine = FakeEngine(IdsOnlyTokenizer(), max_batch=2, max_seq_len=512, step_delay=0.02)
sock = socket.socket(); sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
serve(engine, ServerConfig(port=sock.getsockname()[1], max_tokens=400, shutdown_timeout=10, log_level="info"),
      sock=sock)
print("served out", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_gracefully(sig):
    env = dict(os.environ, QUANTKIT_ROOT=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT.format(repo=str(REPO))], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"

        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=30, what="the server process to start")
        result = {}
        # An in-flight request (40 steps of 20 ms) that the shutdown must let finish.
        caller = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": [3], "max_tokens": 40}, timeout=30)))
        caller.start()
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json()["in_flight"] == 1, timeout=20,
                   what="the request to be in flight")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        caller.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "served out" in out and "Shutting down" in err and "Application shutdown complete" in err
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["text"] == FakeEngine.expected([3], 40)


def test_serve_command_checks_options_before_loading(tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    runner = CliRunner()
    assert "--max-queue" in runner.invoke(app, ["serve", "--help"]).output
    for args, message in ((["--port", "70000"], "--port"), (["--max-queue", "-1"], "--max-queue"),
                          (["--max-tokens", "0"], "--max-tokens"), (["--log-level", "loud"], "--log-level")):
        result = runner.invoke(app, ["serve", str(tmp_path / "no-such-model"), *args])
        assert isinstance(result.exception, QuantkitError) and message in str(result.exception), result.output
