"""The HTTP path's warm-up: before ``/health`` says ok, the app answers a few requests of its own.

The engine's warm-up (:mod:`quantkit.runtime.warmup`) compiles the kernels and runs requests through the
scheduler, but not through the server: the first client request still paid for Starlette building its
middleware stack, modules imported on first use (anyio's streams, the tool-call parser), the first streamed
response and the first chat template. That is one-time host work, about 15 ms on the 2-core CPU (first
streamed completion's TTFT 18-22 ms against 4-5 ms after it) and 40 ms on the H200's host (the first request
after ready: TTFT 81 ms against 39 ms warm, a 1-stream cold/warm ratio of 2.1).

:func:`warm_http` sends the app, in process (an ASGI call, no socket), a streamed completion, a whole
(non-streamed) one and, where the tokenizer has a chat template, a streamed chat completion, each of two
tokens. Their scope carries
:data:`WARMUP_SCOPE_KEY`, which no client can set (clients set headers, not scope keys): the metrics leave
them out. A request that fails is logged and skipped; the server is ready either way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

log = logging.getLogger(__name__)

WARMUP_SCOPE_KEY = "quantkit.warmup"


def warmup_requests(model: str, chat: bool) -> list[tuple[str, dict]]:
    """(path, body) of each warm-up request: completions of a few token ids (any tokenizer takes them), and a
    chat completion where the tokenizer has a chat template (``chat``; without one the endpoint answers 400)."""
    common = {"model": model, "max_tokens": 2, "temperature": 0}
    requests = [
        ("/v1/completions", {**common, "prompt": [10, 11, 12], "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/completions", {**common, "prompt": [10, 11, 12]}),
    ]
    if chat:
        requests.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Hello"}],
                                                  "stream": True}))
    return requests


async def warm_http(app, requests: list[tuple[str, dict]], timeout_s: float = 60.0) -> tuple[float, list[str]]:
    """Send ``requests`` (:func:`warmup_requests`) through ``app``; (seconds taken, a note per request that did
    not answer 200)."""
    start, problems = time.perf_counter(), []
    for path, body in requests:
        try:
            status, text = await asyncio.wait_for(asgi_request(app, path, body), timeout_s)
        except asyncio.TimeoutError:
            problems.append(f"{path}: no answer in {timeout_s:.0f} s")
            continue
        if status != 200:
            problems.append(f"{path}: {status} {text[:200]}")
    return time.perf_counter() - start, problems


async def asgi_request(app, path: str, body: dict) -> tuple[int, str]:
    """POST ``body`` as JSON to ``app`` in process: (status, response text). The client stays connected until
    the response ends (``receive`` blocks until then, as a socket's would), so no disconnect aborts it."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())],
             WARMUP_SCOPE_KEY: True}
    ended = asyncio.Event()
    body_sent = False
    status, chunks = 0, []

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await ended.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                ended.set()

    try:
        await app(scope, receive, send)
    finally:
        ended.set()
    return status, b"".join(chunks).decode("utf-8", "replace")
