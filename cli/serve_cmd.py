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
        max_batch: Annotated[int, typer.Option("--max-batch", help="Sequences decoded together at most (cache slots).")] = 32,
        max_seq_len: Annotated[int | None, typer.Option("--max-seq-len", help="Prompt + generated tokens per sequence (default: the model's, capped by the runtime).")] = None,
        max_queue: Annotated[int, typer.Option("--max-queue", help="Requests waiting for a slot; beyond that the server answers 503.")] = 64,
        max_tokens: Annotated[int, typer.Option("--max-tokens", help="The most tokens one request may ask for (400 beyond).")] = 1024,
        served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="The name clients put in \"model\" (default: the engine's).")] = None,
        backend: Annotated[str, typer.Option("--backend", help="auto (kernels on CUDA, reference elsewhere), kernels, reference.")] = "auto",
        cuda_graphs: Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Capture decode steps in CUDA graphs (default: on with the kernels).")] = None,
        device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False,
        log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
        threads: Threads = None,
    ) -> None:
        """Serve MODEL over HTTP: /v1/completions, /v1/chat/completions (streaming by SSE), /v1/models, /health.

        Stops gracefully on Ctrl+C or SIGTERM (in-flight requests get 10 s to finish)."""
        choice = apply_threads(threads)  # before torch is imported
        import logging

        from quantkit.config import QuantkitError
        from quantkit.runtime.server import ServerConfig
        from quantkit.runtime.server import serve as run_server

        if log_level not in ("debug", "info", "warning", "error"):
            raise QuantkitError(f"--log-level must be debug, info, warning or error, got {log_level!r}")
        # Checked before the model loads, so a typo costs no loading time.
        config = ServerConfig(host=host, port=port, max_queue=max_queue, max_tokens=max_tokens,
                              served_model_name=served_model_name, log_level=log_level)
        try:
            from quantkit.runtime.loader import load_engine
        except ImportError as exc:
            raise QuantkitError(f"this quantkit has no serving runtime (quantkit.runtime.loader: {exc})") from exc
        logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(levelname)s:     %(name)s: %(message)s")
        from quantkit import preflight
        from quantkit.progress_lines import Heartbeat, LineSink

        preflight.check_model_spec(model)
        say_threads(choice)
        typer.secho(f"loading {model} ...", err=True)
        sink = LineSink(lambda text: typer.echo(text, err=True))
        sink.announce("loading and warm-up")
        heartbeat = Heartbeat(sink).start()  # a line every 30 s while it loads, compiles, captures graphs
        try:
            engine = load_engine(model, device=device, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len,
                                 backend=backend, cuda_graphs=cuda_graphs, trust_remote_code=trust_remote_code)
        finally:
            heartbeat.stop()
        typer.secho(f"serving {config.served_model_name or engine.model_name} on http://{host}:{port} "
                    f"({engine.max_batch} slots of {engine.max_seq_len} tokens, {max_queue} queued at most)", err=True)
        run_server(engine, config)
