"""llguidance against xgrammar as the server's grammar library (issue 40): set-up and per-token mask cost.

For one tokenizer (SmolLM2's by default, from its GGUF) and one JSON schema, each library: converts the
tokenizer, compiles the schema, then follows the tokens of a valid document, filling the next-token bitmask
before each one (what the sampler does every step). Also checks that every token of the document was allowed
by both masks. Prints a table and writes JSON (card, versions, date).

    python bench/bench_grammar_mask.py [--gguf PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}


def bit(mask_row, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def run_llguidance(tok, vocab: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import torch
    from llguidance.torch import fill_next_token_bitmask

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    t2 = time.perf_counter()
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    times, allowed = [], True
    for t in tokens:
        s = time.perf_counter()
        fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - s)
        allowed &= bit(mask[0], t)
        matcher.consume_token(t)
    from importlib.metadata import version

    return {"version": version("llguidance"),
            "tokenizer_s": t1 - t0, "compile_s": t2 - t1, "mask_us_median": statistics.median(times) * 1e6,
            "mask_us_max": max(times) * 1e6, "document_allowed": allowed}


def run_xgrammar(tok, vocab: int, tokens: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, vocab)
    times, allowed = [], True
    for t in tokens:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        allowed &= bit(mask[0], t)
        matcher.accept_token(t)
    from importlib.metadata import version

    return {"version": version("xgrammar"), "tokenizer_s": t1 - t0, "compile_s": t2 - t1,
            "mask_us_median": statistics.median(times) * 1e6, "mask_us_max": max(times) * 1e6,
            "document_allowed": allowed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=str(Path.home() / ".cache/quantkit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--out", default=f"bench/results/grammar_mask_{datetime.date.today()}.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    vocab = len(tok)
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    record = {"card": f"CPU {platform.processor()} (shared machine)", "date": datetime.datetime.now().isoformat(
        timespec="seconds"), "python": platform.python_version(), "tokenizer": path.name, "vocab": vocab,
        "document_tokens": len(tokens)}
    for name, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            record[name] = fn(tok, vocab, tokens)
        except Exception as exc:  # a library missing or failing is a result too
            record[name] = {"error": f"{type(exc).__name__}: {exc}"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"{'library':10s} | tokenizer s | compile s | mask us median / max | document allowed")
    for name in ("llguidance", "xgrammar"):
        r = record[name]
        if "error" in r:
            print(f"{name:10s} | {r['error']}")
        else:
            print(f"{name:10s} | {r['tokenizer_s']:.2f} | {r['compile_s']:.3f} | {r['mask_us_median']:.0f} / "
                  f"{r['mask_us_max']:.0f} | {r['document_allowed']}")


if __name__ == "__main__":
    main()
