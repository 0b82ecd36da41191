"""`quantkit serve` as a client meets it (issue 40): cold start, structured output, a long prompt among streams.

Starts `quantkit serve MODEL` as a subprocess and drives it with the official `openai` client (loopback):

1. start-up: seconds from launch to `/health` 200 (model load + warm-up);
2. right after `/health` turns ready ("cold") and again afterwards ("warm"): streaming load at 1, 8 and 32
   concurrent streams (2 x streams requests each, --prompt-tokens token ids, --max-tokens with ignore_eos):
   TTFT p50/p95 and aggregate tok/s; the ratio cold/warm (issue 40 asks for within 2x);
3. structured output: chat requests with a json_schema response_format against the same requests
   unconstrained, at batch 1 and 32 (--structured-batches): per-stream decode tok/s (tokens after the first / time after the first);
4. mixed: 8 streams decoding, then one --long-prompt-tokens prompt: the worst inter-token gap of the 8 while
   it is prefilled (chunked prefill bounds it) against their median gap;
5. shutdown: SIGTERM with a stream in flight: exit status, seconds to exit, whether the stream ended with an
   event (its text or the abort error) and [DONE].

The server starts from an empty Triton cache of its own (--triton-cache, default a new temporary folder), so
its start is as cold as on a fresh machine, and after each phase the kernels compiled since the previous one
are listed by name (new cache entries): anything compiled after `/health` said ready is what the warm-up
missed, and what the first clients paid for.

    python bench/bench_serve_coldstart.py MODEL [--serve-arg=--kv-cache-fraction=0.8 ...] [--out PATH]

Writes JSON (card, versions, date, every number) and prints a summary table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 24, "maxItems": 24, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 16}},
    "required": ["id", "name"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] if ordered else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compiled_kernels(cache_dir: str | Path) -> set[tuple[str, str]]:
    """``(entry, kernel name)`` of every compiled kernel in a Triton cache folder (one entry per compilation;
    the name is the stem of its ``.cubin``)."""
    return {(f.parent.name, f.stem) for f in Path(cache_dir).glob("*/*.cubin")}


def new_kernels(before: set[tuple[str, str]], after: set[tuple[str, str]]) -> dict[str, int]:
    """Kernel name -> compilations in ``after`` and not in ``before``."""
    return dict(Counter(name for _, name in sorted(after - before)))


def start_server(args, port: int) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-c", "from quantkit.cli.app import main; main()", "serve", args.model,
           "--port", str(port), "--max-tokens", str(max(args.max_tokens, 1024)), "--shutdown-grace",
           str(args.shutdown_grace), *args.serve_arg]
    print("launching:", " ".join(cmd[3:]), flush=True)
    started = time.perf_counter()
    log = open(args.server_log, "w")  # noqa: SIM115 (the process writes it until the end)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, TRITON_CACHE_DIR=str(args.triton_cache)))
    import httpx

    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {args.server_log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.perf_counter() - started
        except httpx.TransportError:
            pass
        if time.perf_counter() - started > args.start_timeout:
            proc.kill()
            raise SystemExit(f"/health not ready after {args.start_timeout} s")
        time.sleep(0.05)


async def one_stream(client, model: str, prompt, max_tokens: int, *, chat_format=None, sink=None) -> dict:
    """One streamed request; arrival times of its content chunks."""
    sent = time.perf_counter()
    times, usage = [], None
    common = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "extra_body": {"ignore_eos": True},
              "stream_options": {"include_usage": True}}
    if chat_format is None:
        stream = await client.completions.create(model=model, prompt=prompt, **common)
    else:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], **common,
            **({"response_format": chat_format} if chat_format else {}))
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and ((getattr(chunk.choices[0], "text", None)) or
                              (getattr(getattr(chunk.choices[0], "delta", None), "content", None))):
            times.append(time.perf_counter())
            if sink is not None:
                sink.append(times[-1])
    ttft = times[0] - sent if times else float("nan")
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else float("nan")
    if usage and len(times) > 2:  # tokens, not text chunks (a chunk may hold several tokens' text, or none)
        decode = (usage - 1) / (times[-1] - times[0])
    return {"ttft": ttft, "chunks": len(times), "tokens": usage or len(times), "decode_tps": decode,
            "end": times[-1] if times else sent}


def token_prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(1000 + 7919 * (i + 1) * (j + 3)) % (vocab - 1000) + 500 for j in range(n)]


async def load(client, model: str, streams: int, args, vocab: int) -> dict:
    n = max(2 * streams, 8)  # at 1 stream, 2 requests made "p50" and "p95" both the first request's TTFT
    sem = asyncio.Semaphore(streams)
    start = time.perf_counter()

    async def run(i):
        async with sem:
            return await one_stream(client, model, token_prompt(i, args.prompt_tokens, vocab), args.max_tokens)

    results = await asyncio.gather(*(run(i) for i in range(n)))
    wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"streams": streams, "requests": n, "ttft_p50_s": pct(ttfts, 0.5), "ttft_p95_s": pct(ttfts, 0.95),
            "tok_per_s": tokens / wall, "wall_s": wall}


async def structured(client, model: str, batch: int, args) -> dict:
    prompt = "List 24 items as JSON objects with an id and a short name."
    out = {}
    for name, fmt in (("unconstrained", False), ("json_schema", {"type": "json_schema", "json_schema": {
            "name": "items", "schema": SCHEMA}})):
        results = await asyncio.gather(*(one_stream(client, model, prompt, args.structured_tokens, chat_format=fmt)
                                         for _ in range(batch)))
        out[name] = {"decode_tok_per_s_per_stream": statistics.median(r["decode_tps"] for r in results),
                     "ttft_p50_s": pct([r["ttft"] for r in results], 0.5),
                     "tokens_median": statistics.median(r["tokens"] for r in results)}
    out["ratio"] = out["json_schema"]["decode_tok_per_s_per_stream"] / out["unconstrained"]["decode_tok_per_s_per_stream"]
    return out


async def mixed(client, model: str, args, vocab: int) -> dict:
    sinks = [[] for _ in range(8)]
    tasks = [asyncio.ensure_future(one_stream(client, model, token_prompt(i, 64, vocab), args.mixed_tokens,
                                              sink=sinks[i])) for i in range(8)]
    while min(len(s) for s in sinks) < 16 and not any(t.done() for t in tasks):
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    long = await one_stream(client, model, token_prompt(99, args.long_prompt_tokens, vocab), 4)
    first = sent + long["ttft"]
    await asyncio.gather(*tasks)

    def gaps(lo: float, hi: float) -> list[float]:
        return [b - a for s in sinks for a, b in zip(s, s[1:]) if lo <= b and a <= hi]

    before = gaps(0, sent)
    during = gaps(sent, first)
    return {"long_prompt_tokens": args.long_prompt_tokens, "long_ttft_s": long["ttft"],
            "median_gap_before_s": statistics.median(before), "worst_gap_during_prefill_s": max(during, default=0.0),
            "gaps_during_prefill": len(during)}


async def shutdown(client, model: str, proc, args, vocab: int, context: int) -> dict:
    import httpx

    events = []

    async def stream():
        async with httpx.AsyncClient(timeout=120) as h:
            body = {"prompt": token_prompt(5, 32, vocab), "max_tokens": min(1024, context - 32), "stream": True,
                    "ignore_eos": True}
            async with h.stream("POST", f"{client.base_url}completions", json=body) as r:
                if r.status_code != 200:
                    raise SystemExit(f"the shutdown phase's stream was refused: {(await r.aread()).decode()}")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

    task = asyncio.ensure_future(stream())
    while len(events) < 8 and not task.done():
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(task, 120)
    code = await asyncio.to_thread(proc.wait, 120)
    last = json.loads(events[-2]) if len(events) > 1 and events[-1] == "[DONE]" else None
    return {"exit_status": code, "seconds_to_exit": time.perf_counter() - sent, "ended_with_done": events[-1] == "[DONE]",
            "abort_event": bool(last and "error" in last)}


async def main_async(args) -> dict:
    import openai

    port = free_port()
    proc, ready_s = start_server(args, port)
    record = {"startup_to_ready_s": ready_s, "triton_cache": str(args.triton_cache), "compiled_after_ready": {}}
    seen = compiled_kernels(args.triton_cache)
    record["kernels_compiled_by_ready"] = len(seen)

    def compiled_since(phase: str) -> None:
        nonlocal seen
        now = compiled_kernels(args.triton_cache)
        record["compiled_after_ready"][phase] = new_kernels(seen, now)
        seen = now
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        model_info = (await client.models.list()).data[0]
        model, vocab = model_info.id, args.vocab
        context = int(getattr(model_info, "max_model_len", None) or 2048)
        for phase in ("cold", "warm"):
            record[phase] = [await load(client, model, c, args, vocab) for c in args.streams]
            compiled_since(phase)
            print(phase, json.dumps(record[phase]), flush=True)
        record["cold_over_warm"] = [{"streams": c["streams"], "ttft_p95": c["ttft_p95_s"] / w["ttft_p95_s"],
                                     "tok_per_s": w["tok_per_s"] / c["tok_per_s"]}
                                    for c, w in zip(record["cold"], record["warm"])]
        if args.load_only:
            return record
        record["structured"] = {b: await structured(client, model, b, args) for b in args.structured_batches}
        compiled_since("structured")
        print("structured", json.dumps(record["structured"]), flush=True)
        record["mixed"] = await mixed(client, model, args, vocab)
        compiled_since("mixed")
        print("mixed", json.dumps(record["mixed"]), flush=True)
        record["shutdown"] = await shutdown(client, model, proc, args, vocab, context)
    finally:
        if proc.poll() is None:
            proc.kill()
    return record


def environment() -> dict:
    import torch

    import quantkit

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "quantkit": getattr(quantkit, "__version__", "?")}
    for name in ("triton", "transformers", "fastapi", "uvicorn", "openai", "llguidance", "prometheus_client"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU {platform.processor()}"
    return {"card": card, "versions": versions, "date": datetime.datetime.now().isoformat(timespec="seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("model", help="what `quantkit serve` takes: a checkpoint folder, a model folder or a .gguf")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra `quantkit serve` argument, e.g. --serve-arg=--kv-cache-fraction=0.8 (repeat)")
    parser.add_argument("--streams", default="1,8,32", help="concurrency levels of the load phases")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--structured-tokens", type=int, default=400)
    parser.add_argument("--structured-batches", default="1,32", help="batch sizes of the structured-output phase")
    parser.add_argument("--mixed-tokens", type=int, default=400, help="tokens each of the 8 mixed streams decodes")
    parser.add_argument("--long-prompt-tokens", type=int, default=3000)
    parser.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--shutdown-grace", type=float, default=2.0, help="the server's --shutdown-grace")
    parser.add_argument("--server-log", default="serve_coldstart_server.log")
    parser.add_argument("--out", help="JSON path (default bench/results/serve_coldstart_<model>_<date>.json)")
    parser.add_argument("--load-only", action="store_true", help="stop after the cold and warm load phases "
                        "(no structured output, mixed load or shutdown): the cold-start check alone")
    parser.add_argument("--triton-cache", help="the server's TRITON_CACHE_DIR (default: a new empty temporary "
                        "folder, so the start is cold and what compiles after ready can be listed)")
    args = parser.parse_args()
    if args.triton_cache is None:
        import tempfile

        args.triton_cache = tempfile.mkdtemp(prefix="triton_coldstart_")
    args.streams = [int(s) for s in args.streams.split(",")]
    args.structured_batches = [int(s) for s in args.structured_batches.split(",")]
    out = Path(args.out or f"bench/results/serve_coldstart_{Path(args.model).stem}_{datetime.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": args.model, "serve_args": args.serve_arg, **environment(), "settings": {
        k: getattr(args, k) for k in ("streams", "prompt_tokens", "max_tokens", "structured_tokens",
                                      "structured_batches", "mixed_tokens", "long_prompt_tokens")}}
    record.update(asyncio.run(main_async(args)))
    out.write_text(json.dumps(record, indent=2))
    print(f"\nready after {record['startup_to_ready_s']:.1f} s")
    print("streams | cold TTFT p50/p95 s | warm TTFT p50/p95 s | cold / warm tok/s")
    for c, w in zip(record["cold"], record["warm"]):
        print(f"{c['streams']:7d} | {c['ttft_p50_s']:.3f} / {c['ttft_p95_s']:.3f} | {w['ttft_p50_s']:.3f} / "
              f"{w['ttft_p95_s']:.3f} | {c['tok_per_s']:.0f} / {w['tok_per_s']:.0f}")
    print(f"kernels compiled by ready: {record['kernels_compiled_by_ready']}; after ready, by phase:",
          record["compiled_after_ready"])
    if not args.load_only:
        for b, s in record["structured"].items():
            print(f"batch {b}: json_schema {s['json_schema']['decode_tok_per_s_per_stream']:.1f} tok/s/stream vs "
                  f"unconstrained {s['unconstrained']['decode_tok_per_s_per_stream']:.1f} (ratio {s['ratio']:.2f})")
        m = record["mixed"]
        print(f"mixed: {m['long_prompt_tokens']}-token prompt, TTFT {m['long_ttft_s']:.2f} s; 8 streams' worst gap "
              f"during its prefill {m['worst_gap_during_prefill_s'] * 1e3:.0f} ms (median gap before "
              f"{m['median_gap_before_s'] * 1e3:.1f} ms)")
        print("shutdown:", record["shutdown"])
    print("wrote", out)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
