"""``quantkit serve CKPT``: an OpenAI-compatible HTTP server over the runtime's engine."""

from __future__ import annotations

from typing import Annotated

import typer

from quantkit.cli.options import Device, Dtype, Threads, TrustRemoteCode, apply_threads, say_threads


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        model: Annotated[str, typer.Argument(metavar="MODEL", help="A quantized checkpoint folder, or a 16-bit model folder, hub id or .gguf.")],
        host: Annotated[str, typer.Option("--host", help="Address to listen on; the default answers only this machine.")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
        max_batch: Annotated[int, typer.Option("--max-batch", help="Sequences decoded together at most (fewer if the KV-cache budget holds fewer).")] = 32,
        kv_cache_memory: Annotated[str | None, typer.Option("--kv-cache-memory", help="KV-cache budget, e.g. 4GiB or 512MiB (default: 1 GiB on the CPU, --kv-cache-fraction 0.8 on CUDA).")] = None,
        prefill_chunk: Annotated[int | None, typer.Option("--prefill-chunk", help="Prompt tokens prefilled per engine step (chunked prefill; default 2048 on CUDA, 256 on the CPU). Bounds the inter-token gap a long prompt causes.")] = None,
        kv_cache_fraction: Annotated[float | None, typer.Option("--kv-cache-fraction", help="KV-cache budget as a fraction of the CUDA memory free after loading the weights.")] = None,
        kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto (the model's dtype) or fp8: e4m3 codes with a scale per token and KV head, about twice the tokens in the same budget (CUDA: compute capability 8.9+).")] = "auto",
        max_seq_len: Annotated[int | None, typer.Option("--max-seq-len", help="Prompt + generated tokens per sequence (default: the model's, capped by the runtime).")] = None,
        max_queue: Annotated[int, typer.Option("--max-queue", help="Requests waiting for a slot; beyond that the server answers 503.")] = 64,
        max_tokens: Annotated[int, typer.Option("--max-tokens", help="The most tokens one request may ask for (400 beyond).")] = 1024,
        served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="The name clients put in \"model\" (default: the engine's).")] = None,
        backend: Annotated[str, typer.Option("--backend", help="auto (kernels on CUDA, reference elsewhere), kernels, reference.")] = "auto",
        cuda_graphs: Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Capture decode steps in CUDA graphs (default: on with the kernels).")] = None,
        device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
        log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
        threads: Threads = None,
        shutdown_grace: Annotated[float, typer.Option("--shutdown-grace", help="Seconds in-flight requests get to finish on Ctrl+C / SIGTERM; then open streams end with an abort event.")] = 10.0,
    ) -> None:
        """Serve MODEL over HTTP: /v1/completions, /v1/chat/completions (streaming by SSE), /v1/models, /health.

        Stops gracefully on Ctrl+C or SIGTERM: no new requests; those in flight get --shutdown-grace seconds,
        then open streams end with an error event and [DONE]. Exit status 130 after Ctrl+C, 0 after SIGTERM."""
        choice = apply_threads(threads)  # before torch is imported
        import logging

        from quantkit.config import QuantkitError
        from quantkit.runtime.server import ServerConfig
        from quantkit.runtime.server import serve as run_server

        if log_level not in ("debug", "info", "warning", "error"):
            raise QuantkitError(f"--log-level must be debug, info, warning or error, got {log_level!r}")
        # Checked before the model loads, so a typo costs no loading time.
        config = ServerConfig(host=host, port=port, max_queue=max_queue, max_tokens=max_tokens,
                              served_model_name=served_model_name, log_level=log_level, shutdown_timeout=shutdown_grace)
        from quantkit.runtime.kv_budget import check_kv_dtype, parse_memory

        if kv_cache_memory is not None:
            parse_memory(kv_cache_memory)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise QuantkitError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
        if kv_cache_memory is not None and kv_cache_fraction is not None:
            raise QuantkitError("give --kv-cache-memory or --kv-cache-fraction, not both")
        if kv_cache_fraction is not None and not 0 < kv_cache_fraction <= 1:
            raise QuantkitError(f"--kv-cache-fraction must be in (0, 1], got {kv_cache_fraction}")
        check_kv_dtype(kv_cache_dtype)
        try:
            from quantkit.runtime.loader import load_engine
        except ImportError as exc:
            raise QuantkitError(f"this quantkit has no serving runtime (quantkit.runtime.loader: {exc})") from exc
        logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(levelname)s:     %(name)s: %(message)s")
        import time

        from quantkit import preflight
        from quantkit.progress_lines import Heartbeat, LineSink

        started_at = time.time()
        preflight.check_model_spec(model)
        say_threads(choice)
        typer.secho(f"loading {model} ...", err=True)
        sink = LineSink(lambda text: typer.echo(text, err=True))
        sink.announce("loading and warm-up")
        heartbeat = Heartbeat(sink).start()  # a line every 30 s while it loads, compiles, captures graphs
        try:
            engine = load_engine(model, device=device, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len,
                                 backend=backend, cuda_graphs=cuda_graphs, trust_remote_code=trust_remote_code,
                                 kv_cache_memory=kv_cache_memory, kv_cache_fraction=kv_cache_fraction,
                                 prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype)
        finally:
            heartbeat.stop()
        typer.secho(engine.kv_plan.describe(), err=True)
        typer.secho(f"serving {config.served_model_name or engine.model_name} on http://{host}:{port} "
                    f"({engine.max_batch} slots of {engine.max_seq_len} tokens, {max_queue} queued at most; "
                    "/health answers 200 once warmed up)", err=True)
        status = run_server(engine, config, started_at=started_at)
        if status:
            raise typer.Exit(status)
