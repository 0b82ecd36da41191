"""Prometheus metrics of the HTTP server (``GET /metrics``, text format), through ``prometheus_client``.

Each app has its own ``CollectorRegistry`` (no process-global state, so tests can run several servers).
Names follow Prometheus' conventions (``_total`` counters, ``_seconds`` histograms):

* ``quantkit_requests_total{endpoint, status}``: HTTP requests answered, by route and status code;
* ``quantkit_prompt_tokens_total``, ``quantkit_generation_tokens_total``: tokens of finished requests;
* ``quantkit_requests_running``, ``quantkit_requests_waiting``, ``quantkit_requests_in_flight``: the engine's
  batch (prefilling or decoding), its queue, and everything admitted (queue depth = waiting);
* ``quantkit_kv_cache_usage_ratio``: tokens held in the KV cache / its capacity; ``quantkit_kv_cache_slots``;
* ``quantkit_time_to_first_token_seconds``, ``quantkit_inter_token_latency_seconds``,
  ``quantkit_request_latency_seconds``: histograms, measured where the server receives each token event.
"""

from __future__ import annotations

import time

from quantkit.runtime.server_warmup import WARMUP_SCOPE_KEY

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The registry and the instruments; ``engine_state()`` gives (running, waiting, kv used ratio, slots)."""

    def __init__(self, worker) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("quantkit_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("quantkit_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("quantkit_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("quantkit_time_to_first_token_seconds", "Request received to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("quantkit_inter_token_latency_seconds", "Gap between two tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("quantkit_request_latency_seconds", "Request received to its last token",
                             buckets=_E2E_BUCKETS, registry=r)
        engine = worker.engine

        def count(name: str) -> float:
            return float(getattr(engine, name, 0) or 0)

        Gauge("quantkit_requests_in_flight", "Requests admitted (waiting or running)", registry=r).set_function(
            lambda: worker.in_flight)
        Gauge("quantkit_requests_running", "Requests in the engine's batch (prefilling or decoding)",
              registry=r).set_function(lambda: count("num_running"))
        def waiting() -> float:
            if hasattr(engine, "num_waiting"):
                return count("num_waiting")
            return max(0, worker.in_flight - engine.max_batch)  # an engine that does not say: the excess

        Gauge("quantkit_requests_waiting", "Requests queued for a cache slot", registry=r).set_function(waiting)
        Gauge("quantkit_kv_cache_usage_ratio", "Tokens held in the KV cache / its capacity", registry=r).set_function(
            lambda: count("kv_cache_usage"))
        Gauge("quantkit_kv_cache_slots", "Sequences the KV cache holds", registry=r).set(engine.max_batch)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self, record: bool = True) -> RequestTimer:
        """A request's timer; ``record=False`` (the server's own warm-up requests) observes nothing."""
        return RequestTimer(self if record else None)


class RequestTimer:
    """Times one request's token events (TTFT, inter-token gaps, total) and counts its tokens when it ends."""

    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics, self.start, self.last = metrics, time.perf_counter(), None

    def on_event(self, event) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        if event.token_id is not None:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
        if event.finished:
            self.metrics.e2e.observe(now - self.start)
            self.metrics.prompt_tokens.inc(event.prompt_tokens)
            self.metrics.generation_tokens.inc(event.generated_tokens)


class CountRequests:
    """ASGI middleware: counts each HTTP request by route (known routes only) and status code."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get(WARMUP_SCOPE_KEY):  # the server's own warm-up is not traffic
            return await self.app(scope, receive, send)
        status = {"code": 499}  # no response started: the client went away

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(path if path in ROUTES else "other", str(status["code"])).inc()
