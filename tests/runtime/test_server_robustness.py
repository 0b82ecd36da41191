"""The server under load and under failure, over loopback with the fake engine of test_server.py: a full
queue (503), clients that disconnect (streaming or not), engine exceptions, a bounded concurrent load
(64 requests, 16 at a time), and graceful shutdown on SIGINT/SIGTERM of a server process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# The shared helpers live in test_server, which needs the serve extra: skip before importing them.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from tests.runtime.test_server import FakeEngine, assert_error, running_server, sse_events, wait_until

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import tiny_tokenizer
    from tests.runtime.test_server import CHAT_TEMPLATE

    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


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
        assert client.get("/health").json()["in_flight"] == 0
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
code = serve(engine, ServerConfig(port=sock.getsockname()[1], max_tokens=400, shutdown_timeout={grace},
                                  log_level="info"), sock=sock)
print("served out", flush=True)
sys.exit(code)
"""


def start_server_process(grace: float = 10):
    """A server process over the fake engine (20 ms a step); returns (process, url) once /health answers."""
    env = dict(os.environ, QUANTKIT_ROOT=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT.format(repo=str(REPO), grace=grace)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, timeout=30, what="the server process to start")
    return proc, url


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_gracefully(sig):
    proc, url = start_server_process()
    try:
        result = {}
        # An in-flight request (100 steps of 20 ms) that the shutdown must let finish.
        caller = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": [3], "max_tokens": 100}, timeout=30)))
        caller.start()
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json()["in_flight"] == 1, timeout=20,
                   what="the request to be in flight")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        caller.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), err
    assert "Traceback" not in err
    assert "served out" in out and "Shutting down" in err and "Application shutdown complete" in err
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["text"] == FakeEngine.expected([3], 100)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_past_the_grace_period_ends_streams_with_an_abort_event(sig):
    """Two streams of 400 steps (8 s) and a grace period of 1 s: each ends with the abort error event and
    [DONE]; a whole answer in flight is a 503; no traceback; the documented exit status."""
    proc, url = start_server_process(grace=1)
    streams, whole = {}, {}

    def stream(i):
        body = {"prompt": [3 + i], "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            streams[i] = sse_events(response.iter_lines())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=lambda: whole.update(r=httpx.post(
        f"{url}/v1/completions", json={"prompt": [9], "max_tokens": 400}, timeout=30))))
    try:
        for t in threads:
            t.start()
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json()["in_flight"] == 3, timeout=20,
                   what="three requests in flight")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), err
    assert "Traceback" not in err and "CancelledError" not in err, err
    for events in streams.values():
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "server_shutdown" and "aborted" in error["message"]
        assert len(events) - 2 < 400  # tokens (none if it waited for a slot: 2 slots, 3 requests), the abort
    assert len(streams) == 2 and max(len(e) for e in streams.values()) > 10
    assert_error(whole["r"], 503, code="server_shutdown")
    assert int(whole["r"].headers["retry-after"]) >= 1  # issue 40, item 7: every 503 says when to retry
