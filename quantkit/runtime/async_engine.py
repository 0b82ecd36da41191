"""Runs an :class:`~quantkit.runtime.types.Engine` (not thread-safe) for an asyncio server.

One worker thread owns the engine and is the only caller of its methods. The event loop hands it
commands (add, abort, stop) through a queue; the worker admits requests, steps the engine while it
has work, and posts each request's items back onto that request's own ``asyncio.Queue`` with
``call_soon_threadsafe``. Prompts are tokenized on the worker too: the engine decodes with the same
Hugging Face tokenizer, and a Rust tokenizer used from two threads at once can fail ("Already borrowed").

Admission is bounded: at most ``max_batch + max_queue`` requests are in flight (waiting or running);
one more raises :class:`QueueFull` at once (the server answers 503). A request stops counting when its
last event is delivered, so a client that went away frees its place once the engine confirms the abort.

Failures stay local: a prompt that cannot be built or does not fit fails only its request; an engine
exception in ``add_request`` fails only that request, one in ``step`` fails the requests that were in
the engine (they are aborted there) and the worker carries on with the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from quantkit.config import QuantkitError
from quantkit.runtime.types import Engine, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

PromptBuilder = Callable[[Any], list[int]]  # tokenizer -> prompt token ids; runs on the worker thread


class QueueFull(Exception):
    """Every place in the engine and its queue is taken."""


class RequestFailed(Exception):
    """A request that could not be served. ``client_error``: the request itself was at fault (4xx)."""

    def __init__(self, message: str, *, client_error: bool, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.client_error, self.param, self.code = message, client_error, param, code


@dataclass(frozen=True)
class Accepted:
    prompt_tokens: int


@dataclass(frozen=True)
class _Failed:
    error: RequestFailed


class RequestHandle:
    """One submitted request as the event loop sees it: awaits its acceptance, then its events."""

    def __init__(self, build_prompt: PromptBuilder, params: SamplingParams, prompt_param: str,
                 loop: asyncio.AbstractEventLoop, max_tokens_given: bool = False) -> None:
        self.build_prompt, self.params, self.prompt_param = build_prompt, params, prompt_param
        self.max_tokens_given = max_tokens_given  # the client set max_tokens: never clipped, 400 if it cannot fit
        self.cancelled = threading.Event()
        self.finished = False  # event-loop side: the last item was read
        self.engine_id: int | None = None  # worker side
        self._items: asyncio.Queue = asyncio.Queue()
        self._loop = loop

    def deliver(self, item: Accepted | TokenEvent | _Failed) -> None:
        """Worker side: hand an item to the event loop (dropped when the loop is already closed)."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:
            pass

    async def accepted(self) -> int:
        """The prompt's token count once the engine took the request; raises :class:`RequestFailed`."""
        item = await self._items.get()
        if isinstance(item, _Failed):
            self.finished = True
            raise item.error
        return item.prompt_tokens

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The request's token events up to and including the finished one."""
        while not self.finished:
            item = await self._items.get()
            if isinstance(item, _Failed):
                self.finished = True
                raise item.error
            self.finished = item.finished
            yield item


class AsyncEngine:
    """Owns ``engine`` on one worker thread; ``submit``/``abort`` are called from the event loop."""

    def __init__(self, engine: Engine, *, max_queue: int = 64) -> None:
        if max_queue < 0:
            raise QuantkitError(f"--max-queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.capacity = engine.max_batch + max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._active: dict[int, RequestHandle] = {}  # engine request id -> handle (worker thread only)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed_steps = 0  # consecutive failed steps: back off so a broken engine cannot spin a core
        self._ready = threading.Event()  # set once the engine is warm (requests queue in the inbox until then)
        self.warmup_report = None

    # -- event-loop side ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; call from inside the running event loop that will await the results."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def ready(self) -> bool:
        """The worker has warmed the engine up and takes requests."""
        return self._ready.is_set() and self.alive

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, build_prompt: PromptBuilder, params: SamplingParams, *, prompt_param: str = "prompt",
               max_tokens_given: bool = False):
        """Queue a request; raises :class:`QueueFull` when ``capacity`` requests are already in flight.

        ``max_tokens_given``: the client chose ``params.max_tokens``, so a prompt + max_tokens beyond the
        context fails the request (400); otherwise the engine clips max_tokens to what fits."""
        if not self.alive:
            raise RequestFailed("the engine worker is not running", client_error=False)
        with self._lock:
            if self._in_flight >= self.capacity:
                raise QueueFull(f"all {self.capacity} places are taken")
            self._in_flight += 1
        handle = RequestHandle(build_prompt, params, prompt_param, self._loop, max_tokens_given)
        self._inbox.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Drop a request (its client went away); its place is freed once the engine confirms. Idempotent: a
        stream's own cleanup and its response's background task may both ask."""
        if handle.cancelled.is_set():
            return
        handle.cancelled.set()
        self._inbox.put(("abort", handle))

    def abort_all(self, message: str, code: str = "server_shutdown") -> None:
        """Fail every request in flight (queued or running) with ``message``: streams end with an error
        event, whole answers with a 503. Used when a shutdown's grace period is over."""
        self._inbox.put(("abort_all", RequestFailed(message, client_error=False, code=code)))

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is still in flight, and end the worker."""
        if self._thread is None:
            return
        self._inbox.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine worker did not stop within %.0f s", timeout)

    # -- worker side --------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run the engine's warm-up (if it has one) before the first request; a failure is logged, not fatal."""
        warm = getattr(self.engine, "warm_up", None)
        try:
            if warm is not None:
                self.warmup_report = warm()
                log.info("%s", self.warmup_report.describe())
        except Exception:
            log.exception("engine warm-up failed; serving without it")
        finally:
            self._ready.set()

    def _run(self) -> None:
        log.info("engine worker started (%d slots, %d places in all)", self.engine.max_batch, self.capacity)
        self._warm_up()
        while True:
            try:
                if not self._handle_commands():
                    break
                if self.engine.has_work():
                    self._step()
            except Exception:  # the worker must outlive any engine failure
                log.exception("engine worker: unexpected failure; failing the requests in the engine")
                self._fail_active("the engine failed while serving this request")
                self._failed_steps += 1
                time.sleep(min(0.01 * 2**self._failed_steps, 1.0))
        self._fail_active("the server is shutting down")
        self._drain_after_stop()
        log.info("engine worker stopped")

    def _handle_commands(self) -> bool:
        """Run queued commands (waiting for one while the engine is idle); False once told to stop."""
        block = not self.engine.has_work()
        while True:
            try:
                kind, handle = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._admit(handle)
            elif kind == "abort_all":
                self._fail_active(handle.message, handle.code)
            elif handle.engine_id is not None and handle.engine_id in self._active:
                self._abort_in_engine(handle.engine_id)

    def _admit(self, handle: RequestHandle) -> None:
        if handle.cancelled.is_set():  # the client left before the request reached the engine
            self._release()
            return
        try:
            prompt_ids = handle.build_prompt(self.engine.tokenizer)
            self._check_fits(prompt_ids, handle)
            engine_id = self.engine.add_request(prompt_ids, handle.params)
        except RequestFailed as exc:
            self._fail(handle, exc)
        except QuantkitError as exc:
            self._fail(handle, RequestFailed(str(exc), client_error=True, param=handle.prompt_param))
        except Exception as exc:
            log.exception("engine refused a request")
            self._fail(handle, RequestFailed(f"the engine could not take this request: {exc}", client_error=False))
        else:
            handle.engine_id = engine_id
            self._active[engine_id] = handle
            handle.deliver(Accepted(len(prompt_ids)))

    def _check_fits(self, prompt_ids: list[int], handle: RequestHandle) -> None:
        param = handle.prompt_param
        if not prompt_ids:
            raise RequestFailed("the prompt is empty (no tokens)", client_error=True, param=param)
        limit = self.engine.max_seq_len
        if len(prompt_ids) + 1 > limit:
            raise RequestFailed(
                f"the prompt has {len(prompt_ids)} tokens; this server holds {limit} tokens per sequence "
                f"(prompt + at least one generated token), so shorten it to at most {limit - 1} tokens",
                client_error=True, param=param, code="context_length_exceeded")
        wanted = len(prompt_ids) + handle.params.max_tokens
        if handle.max_tokens_given and wanted > limit:
            raise RequestFailed(
                f"this model's maximum context length is {limit} tokens; you requested {wanted} tokens "
                f"({len(prompt_ids)} in the {param}, {handle.params.max_tokens} in the completion): lower max_tokens "
                f"to at most {limit - len(prompt_ids)}, shorten the {param}, or leave max_tokens out (then it is "
                "clipped to what fits)", client_error=True, param="max_tokens", code="context_length_exceeded")

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing the %d requests in the engine", len(self._active))
            self._fail_active("the engine failed while generating this request (see the server log)")
            self._failed_steps += 1
            time.sleep(min(0.01 * 2**self._failed_steps, 1.0))
            return
        self._failed_steps = 0
        for event in events:
            handle = self._active.get(event.request_id)
            if handle is None:  # a request already failed and aborted after an engine error
                continue
            if event.finished:  # free the place before the client can see its answer and send the next request
                del self._active[event.request_id]
                self._release()
            handle.deliver(event)

    def _abort_in_engine(self, engine_id: int) -> None:
        try:
            self.engine.abort(engine_id)
        except Exception:
            log.exception("engine abort of request %d failed", engine_id)

    def _fail_active(self, message: str, code: str | None = None) -> None:
        for engine_id, handle in list(self._active.items()):
            self._abort_in_engine(engine_id)
            self._fail(handle, RequestFailed(message, client_error=False, code=code))
        self._active.clear()

    def _fail(self, handle: RequestHandle, error: RequestFailed) -> None:
        self._release()
        handle.deliver(_Failed(error))

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _drain_after_stop(self) -> None:
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._fail(handle, RequestFailed("the server is shutting down", client_error=False))
