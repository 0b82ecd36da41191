"""An OpenAI-compatible HTTP server over a continuous-batching :class:`~quantkit.runtime.types.Engine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with ``"stream": true``
as server-sent events in OpenAI's chunk format, closed by ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus, :mod:`quantkit.runtime.metrics`). FastAPI and uvicorn are
an optional extra (``pip install quantkit[serve]``), imported only when a server is built.

The engine runs on one worker thread (:mod:`quantkit.runtime.async_engine`); every request handler
awaits its own queue of events. Limits, each answered with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``: a body over ``max_body_bytes`` (413), malformed
JSON or a field of the wrong type or range (400), a body not declared JSON (415), an unimplemented or
unknown field (400 naming it), a prompt, or prompt + an explicit ``max_tokens``, longer than the engine's
sequence (400, ``context_length_exceeded``), ``max_tokens`` above ``max_tokens`` (400), an unknown model
name (404), every place taken (503, ``queue_full``, ``Retry-After``), an engine failure (500, only for the
requests it hit). A client that disconnects, streaming or not, has its request aborted in the engine.
Both endpoints take ``response_format`` (JSON, by constrained decoding); chat requests also ``tools``
(templates whose tool-call syntax :mod:`quantkit.runtime.tool_syntax` knows: Hermes, Llama 3.1-3.3 JSON,
Mistral). Shutdown: :mod:`.server_shutdown`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from quantkit.config import QuantkitError
from quantkit.runtime.async_engine import AsyncEngine, QueueFull, RequestFailed, RequestHandle
from quantkit.runtime.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    parse_request,
)
from quantkit.runtime.server_warmup import WARMUP_SCOPE_KEY, warm_http, warmup_requests
from quantkit.runtime.tool_stream import merge_deltas
from quantkit.runtime.types import Engine, SamplingParams

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"  # the Retry-After header of a 503 (seconds)
SHUTDOWN_CODE = "server_shutdown"  # the error code of a request cut by a shutdown


@dataclass(frozen=True)
class ServerConfig:
    """Where the server listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64  # requests waiting for a slot beyond the engine's max_batch running ones
    max_tokens: int = 1024  # the most tokens one request may ask for
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None  # default: the engine's model_name
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on SIGINT/SIGTERM
    log_level: str = "info"

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            problems.append(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_tokens < 1:
            problems.append(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.max_body_bytes < 1024:
            problems.append(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            problems.append(f"--shutdown-grace must be >= 0, got {self.shutdown_timeout}")
        if problems:
            raise QuantkitError("; ".join(problems))


class _ClientGone(Exception):
    pass


def text_prompt(prompt: str | list[int]):
    """A prompt builder (runs on the engine thread) for a completion prompt: text or token ids."""

    def build(tokenizer) -> list[int]:
        if isinstance(prompt, str):
            return list(tokenizer(prompt)["input_ids"])
        vocab = len(tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestFailed(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", client_error=True,
                                param="prompt", code="invalid_value")
        return list(prompt)

    return build


def chat_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None):
    """A prompt builder for a conversation (and the tools offered), rendered by the tokenizer's chat template."""

    def build(tokenizer) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestFailed("this model's tokenizer has no chat template; use /v1/completions with a prompt",
                                client_error=True, param="messages", code="no_chat_template")
        from jinja2 import TemplateError

        try:
            extra = {"tools": tools} if tools else {}
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except TemplateError as exc:  # templates raise on what they refuse, e.g. roles that do not alternate
            raise RequestFailed(f"the chat template refused these messages: {exc}", client_error=True,
                                param="messages", code="invalid_value") from exc
        # The template already wrote the special tokens (BOS, role markers) it wants.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return build


def _failure_error(exc: RequestFailed) -> APIError:
    if exc.client_error:
        return APIError(400, exc.message, param=exc.param, code=exc.code or "invalid_value")
    if exc.code == SHUTDOWN_CODE:
        return APIError(503, exc.message, type="server_error", code=SHUTDOWN_CODE,
                        headers={"Retry-After": RETRY_AFTER_S})
    return APIError(500, exc.message, type="server_error", code=exc.code or "engine_error")


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _check_content_type(request) -> None:
    """A body must be declared JSON (415 otherwise: ``text/plain``, a form, nothing)."""
    declared = request.headers.get("content-type", "")
    media = declared.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the request body must be JSON with Content-Type: application/json, got "
                       f"{declared or 'no Content-Type'}", param="Content-Type", code="unsupported_media_type")


async def _read_json(request, limit: int) -> Any:
    """The request's JSON body, read up to ``limit`` bytes (413 beyond; 415 if not declared JSON, 400 if it
    is not JSON)."""
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    _check_content_type(request)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    if not chunks or not b"".join(chunks).strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")

    def refuse_constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(b"".join(chunks), parse_constant=refuse_constant)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc


async def _wait_disconnect(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request, coro):
    """Await ``coro``; if the client disconnects first, cancel it and raise :class:`_ClientGone`."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise _ClientGone()


async def _collect(handle: RequestHandle, timer) -> tuple[str, str | None, int]:
    """Text, finish reason and generated-token count of a whole (non-streamed) request."""
    parts, finish_reason, counted, generated = [], None, 0, 0
    async for event in handle.events():
        timer.on_event(event)
        parts.append(event.text)
        counted += event.token_id is not None
        if event.finished:
            finish_reason, generated = event.finish_reason, event.generated_tokens or counted
    return "".join(parts), finish_reason, generated


class _Service:
    """The request handlers, bound to one engine worker."""

    def __init__(self, worker: AsyncEngine, config: ServerConfig, model_name: str, created: int, metrics) -> None:
        self.worker, self.config, self.model_name, self.metrics = worker, config, model_name, metrics
        self.created = created  # when the model was loaded (unix seconds), as /v1/models reports it
        self.draining = False  # a shutdown began: /health says so, new requests get 503
        self.http_warm = False  # the app answered its own warm-up requests (:mod:`.server_warmup`)

    async def health(self, request):
        from fastapi.responses import JSONResponse

        engine = self.worker.engine
        ready = self.worker.ready and self.http_warm
        ok = ready and not self.draining
        status = ("draining" if self.draining else "unavailable" if not self.worker.alive
                  else "ok" if ready else "warming_up")
        body = {"status": status, "model": self.model_name,
                "in_flight": self.worker.in_flight, "capacity": self.worker.capacity,
                "max_batch": engine.max_batch, "max_seq_len": engine.max_seq_len}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self, request):
        from fastapi.responses import Response

        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def models(self, request):
        from fastapi.responses import JSONResponse

        model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "quantkit",
                 "max_model_len": self.worker.engine.max_seq_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request):
        body = parse_request(CompletionRequest, await _read_json(request, self.config.max_body_bytes))
        self._check_model(body.model)
        params = body.params(self.config.max_tokens)
        fmt = ResponseFormat.new(chat=False, model=self.model_name)
        return await self._generate(request, text_prompt(body.single_prompt()), "prompt", params, fmt,
                                    bool(body.stream), body.include_usage, body.max_tokens_given)

    async def chat_completions(self, request):
        body = parse_request(ChatCompletionRequest, await _read_json(request, self.config.max_body_bytes))
        self._check_model(body.model)
        tokenizer = self.worker.engine.tokenizer
        special = getattr(tokenizer, "get_added_vocab", dict)() if body.tools else None
        plan = body.tool_plan(getattr(tokenizer, "chat_template", None), special)
        grammar = body.response_grammar()
        if plan is not None and plan.grammar_lark is not None:
            from quantkit.runtime.constrained import lark_grammar

            grammar = lark_grammar(plan.grammar_lark)
        params = body.params(self.config.max_tokens, grammar,
                             skip_special_tokens=not (plan is not None and plan.keep_special_tokens))
        fmt = ResponseFormat.new(chat=True, model=self.model_name, tool_syntax=plan.syntax if plan else None,
                                 max_calls=1 if body.parallel_tool_calls is False else None)
        build = chat_prompt(body.template_messages(), plan.tools if plan is not None else None)
        return await self._generate(request, build, "messages", params, fmt, bool(body.stream), body.include_usage,
                                    body.max_tokens_given)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves {self.model_name!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    async def _generate(self, request, build, prompt_param: str, params: SamplingParams, fmt: ResponseFormat,
                        stream: bool, include_usage: bool, max_tokens_given: bool = False):
        from fastapi.responses import JSONResponse, Response, StreamingResponse
        from starlette.background import BackgroundTask

        if self.draining:
            raise APIError(503, "the server is shutting down; send this request elsewhere", type="server_error",
                           code=SHUTDOWN_CODE, headers={"Retry-After": RETRY_AFTER_S})
        try:
            handle = self.worker.submit(build, params, prompt_param=prompt_param, max_tokens_given=max_tokens_given)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy ({exc}); retry later", type="server_error",
                           code="queue_full", headers={"Retry-After": RETRY_AFTER_S}) from exc
        except RequestFailed as exc:
            raise APIError(503, exc.message, type="server_error", code="engine_unavailable",
                           headers={"Retry-After": RETRY_AFTER_S}) from exc
        streaming, timer = False, self.metrics.timer(record=not request.scope.get(WARMUP_SCOPE_KEY))
        try:
            prompt_tokens = await _unless_disconnected(request, handle.accepted())
            if stream:
                streaming = True  # from here the event stream owns the request
                # The background task runs once the response ends, also when the client went away, and aborts an
                # unfinished request at once. The stream's own `finally` is not enough on its own: if the
                # disconnect cancels the response while the generator is suspended at a yield (not awaiting an
                # event), that `finally` runs only when the generator is collected. A CI run saw a disconnected
                # stream's request run to its end without an abort; this is the likely way.
                return StreamingResponse(self._stream(handle, fmt, prompt_tokens, include_usage, timer),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                         background=BackgroundTask(self._abort_unfinished, handle))
            text, finish_reason, generated = await _unless_disconnected(request, _collect(handle, timer))
            return JSONResponse(fmt.full(text, finish_reason, prompt_tokens, generated))
        except RequestFailed as exc:
            raise _failure_error(exc) from exc
        except _ClientGone:
            log.info("client went away; request aborted")
            return Response(status_code=499)
        finally:
            if not streaming and not handle.finished:
                self.worker.abort(handle)

    def _abort_unfinished(self, handle: RequestHandle) -> None:
        """After a streamed response: abort its request if the engine has not finished it (idempotent)."""
        if not handle.finished:
            log.debug("streamed response over before its request; aborting it")
            self.worker.abort(handle)

    async def _stream(self, handle: RequestHandle, fmt: ResponseFormat, prompt_tokens: int, include_usage: bool,
                      timer):
        """Server-sent events: a role chunk (chat), one chunk per text delta (with tools: per content or
        tool-call delta, :mod:`.tool_stream`), the finish chunk, [DONE]."""
        try:
            if fmt.chat:
                yield _sse(fmt.chunk(None, role=True))
            counted, generated = 0, 0
            tools = fmt.tool_stream() if fmt.tools else None  # tool calls are parsed as the text arrives
            async for event in handle.events():
                timer.on_event(event)
                counted += event.token_id is not None
                if event.text and tools is not None:
                    for delta in merge_deltas(tools.feed(event.text)):
                        yield _sse(fmt.delta_chunk(delta))
                elif event.text:
                    yield _sse(fmt.chunk(event.text))
                if event.finished:
                    generated = event.generated_tokens or counted
                    finish_reason = event.finish_reason
                    if tools is not None:
                        end = tools.finish(finish_reason)
                        if not end.consistent:
                            log.debug("streamed tool calls differ from the final parse (malformed call)")
                        for delta in merge_deltas(end.deltas):
                            yield _sse(fmt.delta_chunk(delta))
                        finish_reason = end.finish_reason
                    yield _sse(fmt.chunk(None, finish_reason))
            if include_usage:
                yield _sse(fmt.usage_chunk(prompt_tokens, generated))
        except RequestFailed as exc:
            yield _sse(_failure_error(exc).body())
        finally:
            if not handle.finished:  # the client disconnected (the response was cancelled) or the loop stops
                log.info("stream ended early; request aborted")
                self.worker.abort(handle)
        yield "data: [DONE]\n\n"


def _install_error_handlers(app) -> None:
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request, exc: HTTPException):
        error = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def unexpected(request, exc: Exception):
        log.exception("unexpected error while serving %s", request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
        return JSONResponse(error.body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def create_app(engine: Engine, config: ServerConfig = ServerConfig(), started_at: float | None = None):
    """The FastAPI application serving ``engine``; its worker thread starts (and warms the engine up) and
    stops with the app. ``started_at`` (``time.time()`` before the model was loaded) dates the start-up
    time logged once the engine is warm."""
    from fastapi import FastAPI

    worker = AsyncEngine(engine, max_queue=config.max_queue)
    # the engine records when its model was loaded; an engine that does not: when the app was built
    created = int(getattr(engine, "loaded_at", None) or time.time())
    from quantkit.runtime.metrics import CountRequests, ServerMetrics

    metrics = ServerMetrics(worker)
    service = _Service(worker, config, config.served_model_name or engine.model_name, created, metrics)

    async def announce_ready():
        await asyncio.to_thread(worker.wait_ready)
        if worker.alive:  # the first requests through the HTTP stack, before /health says ok
            try:
                chat = bool(getattr(engine.tokenizer, "chat_template", None))
                requests = warmup_requests(service.model_name, chat)
                seconds, problems = await warm_http(app, requests)
                for problem in problems:
                    log.warning("HTTP warm-up request failed (serving anyway): %s", problem)
                log.info("HTTP warm-up: %d requests in %.2f s", len(requests), seconds)
            except Exception:  # noqa: BLE001 - a warm-up that breaks must not keep /health at 503
                log.exception("HTTP warm-up failed; serving without it")
        service.http_warm = True
        since = started_at or created
        log.info("ready: start-up took %.1f s (%s)", time.time() - since,
                    "model load and warm-up" if started_at else "warm-up")

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        ready_task = asyncio.ensure_future(announce_ready())
        try:
            yield
        finally:
            ready_task.cancel()
            worker.stop()

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.service = worker, service
    _install_error_handlers(app)

    # Plain Starlette routes: each handler takes the request and parses its body itself, so every
    # problem (413, bad JSON, a wrong field) gets OpenAI's error body rather than FastAPI's 422.
    app.add_route("/health", service.health, methods=["GET"])
    app.add_route("/v1/models", service.models, methods=["GET"])
    app.add_route("/metrics", service.prometheus, methods=["GET"])
    app.add_middleware(CountRequests, metrics=metrics)
    app.add_route("/v1/completions", service.completions, methods=["POST"])
    app.add_route("/v1/chat/completions", service.chat_completions, methods=["POST"])
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_server(engine: Engine, config: ServerConfig, started_at: float | None = None):
    """A uvicorn server for ``engine``: ``.run()`` serves until SIGINT/SIGTERM, then shuts down gracefully
    (:func:`quantkit.runtime.server_shutdown.graceful_server`)."""
    try:
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise QuantkitError("serving needs FastAPI and uvicorn: pip install 'quantkit[serve]'") from exc
    from quantkit.runtime.server_shutdown import graceful_server

    if not is_loopback(config.host):
        log.warning("listening on %s: reachable from other machines, and there is no authentication", config.host)
    app = create_app(engine, config, started_at)
    return graceful_server(app, config, app.state.service)


def serve(engine: Engine, config: ServerConfig = ServerConfig(), sock: socket.socket | None = None,
          started_at: float | None = None) -> int:
    """Serve ``engine`` until SIGINT/SIGTERM; the exit status the process should end with (see
    :func:`quantkit.runtime.server_shutdown.exit_status`)."""
    from quantkit.runtime.server_shutdown import exit_status, signals_absorbed

    server = uvicorn_server(engine, config, started_at)
    with signals_absorbed():
        server.run(sockets=[sock] if sock is not None else None)
    log.info("server stopped")
    return exit_status(server.first_signal)
