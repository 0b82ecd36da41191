"""Constrained decoding (runtime.constrained, llguidance): the bitmask layout against a plain reference, and
the engine's JSON-schema and tool-call output on a tiny random model (greedy and sampled) validating."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from quantkit.config import QuantkitError  # noqa: E402
from quantkit.runtime.constrained import apply_bitmask, bitmask_ref, json_grammar, lark_grammar  # noqa: E402
from quantkit.runtime.types import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def test_apply_bitmask_matches_the_reference_layout():
    gen = torch.Generator().manual_seed(0)
    vocab = 77
    allowed = [set(torch.randperm(vocab, generator=gen)[:k].tolist()) for k in (1, 5, 40, 77)]
    logits = torch.randn(4, vocab, generator=gen)
    masked = logits.clone()
    apply_bitmask(masked, bitmask_ref(allowed, vocab))
    for row, tokens in enumerate(allowed):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[list(tokens)] = True
        assert torch.equal(masked[row][keep], logits[row][keep]) and torch.isinf(masked[row][~keep]).all()


def test_engine_matcher_mask_against_its_bitmask(tiny_family):
    from quantkit.runtime.loader import load_engine

    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cpu", max_batch=2, max_seq_len=128)
    masks = engine._grammar_masks()
    matcher = masks.matcher(json_grammar(SCHEMA))
    mask = masks.bitmask([matcher])
    logits = torch.zeros(1, engine.model.spec.vocab_size)
    apply_bitmask(logits, mask)
    allowed = (logits[0] == 0).nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    with pytest.raises(QuantkitError, match="grammar"):
        engine.add_request([1, 2], SamplingParams(grammar=lark_grammar("start: (")))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_json_schema_output_validates(tiny_family, temperature):
    from quantkit.runtime.loader import load_engine
    from tests.runtime.test_engine import run_schedule

    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=128)
    grammar = json_grammar(SCHEMA)
    schedule = [(0, [5 + i, 6, 7], SamplingParams(max_tokens=100, temperature=temperature, seed=i, grammar=grammar))
                for i in range(3)]
    schedule.append((0, [9, 9], SamplingParams(max_tokens=5, ignore_eos=True)))  # an unconstrained neighbour
    results = run_schedule(engine, schedule)
    for _tokens, text, reason in results[:3]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(results[3][0]) == 5


@pytest.mark.gpu
def test_engine_json_schema_with_cuda_graphs(tiny_family):
    """On the GPU the mask is applied to the logits the captured decode graph wrote (outside the graph); the
    unconstrained neighbour keeps the graph's own greedy tokens."""
    from quantkit.runtime.loader import load_engine
    from tests.runtime.test_engine import run_schedule

    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cuda", max_batch=4, max_seq_len=128, cuda_graphs=True)
    plain = load_engine(str(folder), device="cuda", max_batch=4, max_seq_len=128, cuda_graphs=True)
    grammar = json_grammar(SCHEMA)
    free = (0, [9, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    schedule = [(0, [5 + i, 6, 7], SamplingParams(max_tokens=100, temperature=t, seed=i, grammar=grammar))
                for i, t in enumerate((0.0, 1.0, 1.0))] + [free]
    results = run_schedule(engine, schedule)
    for _, text, reason in results[:3]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert results[3] == run_schedule(plain, [free])[0]
