"""``quantkit generate MODEL PROMPT``: stream a completion from the serving runtime."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from quantkit.cli.options import Device, Dtype, Json, Threads, TrustRemoteCode, apply_threads, say_threads


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        model: Annotated[str, typer.Argument(metavar="MODEL", help="A quantized checkpoint folder, a 16-bit model folder, hub id or .gguf.")],
        prompt: Annotated[str, typer.Argument(metavar="PROMPT", help="The prompt text.")],
        chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
        system: Annotated[str | None, typer.Option("--system", help="System message (with --chat).")] = None,
        max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate at most.")] = 128,
        temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
        top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k likeliest (0: off).")] = 0,
        top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")] = 1.0,
        repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", help="1 = off.")] = 1.0,
        seed: Annotated[int | None, typer.Option("--seed", help="Seed of the sampler.")] = None,
        stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
        ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-sequence.")] = False,
        backend: Annotated[str, typer.Option("--backend", help="auto, kernels (CUDA) or reference (plain PyTorch).")] = "auto",
        max_seq_len: Annotated[int, typer.Option("--max-seq-len", help="Prompt + generated tokens at most.")] = 2048,
        kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto (the model's dtype) or fp8 (e4m3 codes with a scale per token and KV head).")] = "auto",
        device: Device = "auto", dtype: Dtype = "auto", trust_remote_code: TrustRemoteCode = False, json_: Json = False,
        threads: Threads = None,
    ) -> None:
        """Generate text; prints prefill and decode tokens/s at the end."""
        choice = apply_threads(threads)  # before torch is imported
        from quantkit import preflight

        preflight.check_model_spec(model)
        say_threads(choice)
        from quantkit.cli.display import console
        from quantkit.runtime.generate import generate as run_generate
        from quantkit.runtime.generate import prompt_ids
        from quantkit.runtime.loader import load_engine
        from quantkit.runtime.types import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop or ()),
                                ignore_eos=ignore_eos)
        engine = load_engine(model, device=device, dtype=dtype, max_batch=1, max_seq_len=max_seq_len, backend=backend,
                             trust_remote_code=trust_remote_code, kv_cache_dtype=kv_cache_dtype)
        ids = prompt_ids(engine.tokenizer, prompt, chat, system)
        on_text = None if json_ else (lambda text: typer.echo(text, nl=False))
        result = run_generate(engine, ids, params, on_text)
        if json_:
            typer.echo(json.dumps({"text": result.text, "token_ids": list(result.token_ids),
                                   "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
                                   "prefill_tps": result.prefill_tps, "decode_tps": result.decode_tps}))
            return
        typer.echo("")
        console(stderr=True).print(
            f"[dim]{result.prompt_tokens} prompt tokens at {result.prefill_tps:.1f} tok/s, {len(result.token_ids)} "
            f"generated at {result.decode_tps:.1f} tok/s ({engine.model.backend} backend, {engine.model.device}, "
            f"finish: {result.finish_reason})[/dim]")
