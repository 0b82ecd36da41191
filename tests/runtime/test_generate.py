"""`quantkit generate` and `quantkit bench` from the command line, and the generate API (tiny random models)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from quantkit.config import QuantkitError
from quantkit.runtime.generate import generate, prompt_ids
from quantkit.runtime.loader import load_engine
from quantkit.runtime.types import SamplingParams


def quantkit(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "quantkit.cli.app", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def test_cli_generate_streams_the_engines_greedy_tokens(tiny_quantized):
    folder = tiny_quantized("rtn")
    done = quantkit("generate", folder, "the quick brown fox", "--device", "cpu", "--max-tokens", "6", "--ignore-eos",
                    "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=64)
    ids = prompt_ids(engine.tokenizer, "the quick brown fox", chat=False)
    expected = generate(engine, ids, SamplingParams(max_tokens=6, ignore_eos=True))
    assert result["token_ids"] == list(expected.token_ids) and result["text"] == expected.text
    assert result["finish_reason"] == "length" and result["decode_tps"] > 0
    human = quantkit("generate", folder, "the quick", "--device", "cpu", "--max-tokens", "3")
    assert human.returncode == 0 and "tok/s" in human.stderr


def test_cli_errors_exit_2(tmp_path):
    missing = quantkit("generate", tmp_path / "nowhere", "hi", "--device", "cpu")
    assert missing.returncode == 2 and "error:" in missing.stderr
    if not torch.cuda.is_available():
        bench = quantkit("bench", "--shape", "llama3-8b")
        assert bench.returncode == 2 and "CUDA" in bench.stderr
    bench = quantkit("bench", "--shape", "llama3-8b", "--formats", "int4,gguf")
    assert bench.returncode == 2 and "--formats takes" in bench.stderr and "Traceback" not in bench.stderr
    for args, message in ((["--kv-cache-dtype", "int8"], "--kv-cache-dtype"), (["--context", "0"], "--context")):
        bench = quantkit("bench", "--shape", "llama3-8b", *args)
        assert bench.returncode == 2 and message in bench.stderr and "Traceback" not in bench.stderr
    bad = quantkit("generate", tmp_path, "hi", "--device", "cpu", "--kv-cache-dtype", "int8")
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_with_an_fp8_kv_cache(tiny_family):
    """--kv-cache-dtype fp8: the same first token as the 16-bit cache (the prompt attends in 16 bits), then the
    decode steps read the cache's e4m3 entries; the engine holds an FP8 cache."""
    folder, _ = tiny_family("llama")
    outs = {}
    for kv in ("auto", "fp8"):
        engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=64, kv_cache_dtype=kv)
        assert engine.cache.fp8 == (kv == "fp8")
        outs[kv] = generate(engine, [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    assert len(outs["fp8"]) == 8 and outs["fp8"][0] == outs["auto"][0]


def test_generate_streams_what_it_returns(tiny_family):
    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=64)
    pieces = []
    result = generate(engine, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), pieces.append)
    assert "".join(pieces) == result.text and len(result.token_ids) == 8
    assert result.text == engine.tokenizer.decode(list(result.token_ids), skip_special_tokens=True)


def test_chat_needs_a_template(tiny_family):
    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cpu", max_batch=1, max_seq_len=64)
    with pytest.raises(QuantkitError, match="chat template"):
        prompt_ids(engine.tokenizer, "hi", chat=True)
