"""Graceful shutdown of the HTTP server on SIGINT / SIGTERM.

On the first signal the server stops accepting connections, ``/health`` answers 503 ("draining") and
new requests on open connections get 503 ``server_shutdown``. Requests in flight get
``ServerConfig.shutdown_timeout`` seconds (the grace period) to finish as usual. When the grace period
is over, every request still in the engine is aborted: an open stream ends with an error event
(``{"error": {..., "code": "server_shutdown"}}``) and ``data: [DONE]``, a whole answer is a 503. No
task is cancelled while it writes, so the log shows no traceback. A second Ctrl+C exits at once.

Exit status of ``quantkit serve`` (:func:`exit_status`): 130 after SIGINT (Ctrl+C, as every quantkit
command), 0 after SIGTERM (the orderly stop a service manager asks for; systemd and Kubernetes count
it as a success).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from contextlib import contextmanager

EXIT_SIGINT = 130
EXIT_SIGTERM = 0
_CANCEL_MARGIN_S = 5.0  # uvicorn's own cancel-everything timeout, after our abort has ended the streams


def exit_status(sig: int | None) -> int:
    """The exit status after a shutdown caused by ``sig`` (None: stopped without a signal)."""
    return EXIT_SIGINT if sig == signal.SIGINT else EXIT_SIGTERM if sig == signal.SIGTERM else 0


def graceful_server(app, config, service):
    """A ``uvicorn.Server`` serving ``app`` that drains ``service`` (a server._Service) on shutdown."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        first_signal: int | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.first_signal is None:
                self.first_signal = sig
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            service.draining = True
            grace = config.shutdown_timeout
            message = (f"the server shut down and its grace period of {grace:g} s ended before this request "
                       "finished: it was aborted")
            timer = asyncio.get_running_loop().call_later(grace, service.worker.abort_all, message)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               timeout_graceful_shutdown=config.shutdown_timeout + _CANCEL_MARGIN_S, lifespan="on")
    return GracefulServer(uv_config)


@contextmanager
def signals_absorbed():
    """uvicorn handles SIGINT/SIGTERM (graceful shutdown), then re-raises the signal to the handler it
    found. Let it find a no-op one, so the process ends with :func:`exit_status`, not killed by the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
