"""The incremental tool-call parser (runtime.tool_stream) against the syntaxes' own parsers: every answer is
fed whole, character by character, in token-like pieces and split in two at every position; what the stream
adds up to must be the non-streamed message (tool_calls.parse), content must never run ahead of the final
content (so no marker leaks), a call's name must come before its argument fragments, and content-only answers
must stream before the end."""

from __future__ import annotations

import json
import random
import re

import pytest

from quantkit.runtime import tool_calls
from quantkit.runtime.tool_stream import Delta, ToolStream, merge_deltas
from quantkit.runtime.tool_syntax import HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11

W = '{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}'
C = '{"name": "clock", "arguments": {"zone": "utc", "note": "a \\"}\\" {x}", "n": [1, {"k": []}]}}'
WELL_FORMED = [
    (HERMES, f"<tool_call>\n{W}\n</tool_call>"),
    (HERMES, f"Sure, let me check. <tool_call>{W}</tool_call>\n<tool_call>\n{C}\n</tool_call>"),
    (HERMES, f"<tool_call>{C}</tool_call> Done <b>now</b>.  "),
    (HERMES, '<tool_call>{"arguments": {"city": "Rome"}, "name": "weather"}</tool_call>'),  # not streamable
    (HERMES, "Paris is the capital of France. 2 < 3 and <tool_ is no tag.\n"),
    (LLAMA3_JSON, W.replace('"arguments"', '"parameters"')),
    (LLAMA3_JSON, f"<|python_tag|>{W}; {C} and then I will tell you<|eot_id|>"),
    (LLAMA3_JSON, f"  {C}{W}<|eom_id|>"),
    (LLAMA3_JSON, "The answer is {not a call}; prose stays content."),
    (LLAMA3_JSON, "<|python_tag|> not a call"),
    (LLAMA3_JSON, '{"answer": 42} is JSON, but no call'),
    (MISTRAL, f"[TOOL_CALLS] [{W}]"),
    (MISTRAL, f"Let me check.[TOOL_CALLS][{W}, {C[:-1]}, \"id\": \"abcdefghi\"}}] ok"),
    (MISTRAL, f"[TOOL_CALLS] {C}"),
    (MISTRAL, "No call: [TOOL_ is not [TOOL_CALLS"),
    (MISTRAL_V11, '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}'),
    (MISTRAL_V11, 'Sure.[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]clock[CALL_ID]a1b2c3d4e[ARGS]'
                  '{"zone": "cet", "s": "[ARGS]}"} and after'),
    (MISTRAL_V11, '[TOOL_CALLS]clock{"zone": "utc"}'),
    (MISTRAL_V11, "Just text [TOOL_CALL and [ARGS] alone."),
]
_TOKEN = re.compile(r"<tool_call>|</tool_call>|\[TOOL_CALLS\]|\[ARGS\]|\[CALL_ID\]|<\|\w+\|>|\s?\w+|\s|.")


def splits(text: str):
    yield [text]
    yield list(text)
    yield _TOKEN.findall(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def expected(syntax, text, max_calls=None):
    content, calls = tool_calls.parse(text, syntax)
    calls = calls[:max_calls] if max_calls else calls
    return content or "", [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def stream(syntax, pieces, finish_reason="stop", max_calls=None, final_content=None):
    """Feed ``pieces``; the deltas before the end, the end, and a check after every feed that the content
    sent is a prefix of ``final_content``."""
    parser, before = ToolStream(syntax, max_calls), []
    for piece in pieces:
        before += parser.feed(piece)
        if final_content is not None:
            assert final_content.startswith(parser.content_sent), (parser.content_sent, final_content)
    return before, parser.finish(finish_reason)


def accumulate(deltas):
    """What a client makes of the deltas (as the openai client's stream accumulation does)."""
    content, calls = "", {}
    for d in deltas:
        content += d.content or ""
        if d.index is not None:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.name is not None:
                assert call["name"] is None and call["arguments"] == "" and d.id, "the name comes first, once"
                call["name"] = d.name
            call["arguments"] += d.arguments
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize(("syntax", "text"), WELL_FORMED, ids=lambda v: getattr(v, "name", None))
def test_every_split_adds_up_to_the_final_answer(syntax, text):
    content, calls = expected(syntax, text)
    for pieces in splits(text):
        before, end = stream(syntax, pieces, final_content=content)
        assert accumulate(before + list(end.deltas)) == (content, calls), pieces
        assert end.consistent and end.finish_reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize(("syntax", "text"), [c for c in WELL_FORMED if expected(*c)[1]],
                         ids=lambda v: getattr(v, "name", None))
def test_calls_stream_name_first_then_fragments(syntax, text):
    """Fed a character at a time, every call's name goes out before the end, then its arguments: in several
    fragments, or in one where the object does not start with the name (held until it is complete)."""
    _, calls = expected(syntax, text)
    before, end = stream(syntax, list(text))
    heads = [d for d in before if d.name is not None]
    streamable = '{"arguments"' not in text
    assert [d.name for d in heads] == [name for name, _ in calls] and heads[0].arguments == ""
    for head in heads:
        fragments = [d.arguments for d in before if d.index == head.index and d.name is None]
        assert (len(fragments) > 3 if streamable else len(fragments) == 1)
        assert json.loads("".join(fragments)) == calls[head.index][1]
        assert before.index(head) < min(i for i, d in enumerate(before) if d.index == head.index and d.name is None)
    assert not end.deltas or all(d.content is not None for d in end.deltas)


@pytest.mark.parametrize(("syntax", "text"), [(s, t) for s, t in WELL_FORMED if not expected(s, t)[1]],
                         ids=lambda v: getattr(v, "name", None))
def test_content_only_answers_stream_before_the_end(syntax, text):
    before, _ = stream(syntax, _TOKEN.findall(text))
    sent = "".join(d.content for d in before)
    held = len(text) - len(sent)
    assert text.startswith(sent) and held <= len("[TOOL_CALLS") + 1, (sent, text)


@pytest.mark.parametrize(("syntax", "text", "content"), [
    (HERMES, f"Let me look that up for you. <tool_call>{W}</tool_call>", "Let me look that up for you."),
    (MISTRAL, f"Checking.[TOOL_CALLS][{W}]", "Checking."),
    (MISTRAL_V11, 'One moment.[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}', "One moment."),
])
def test_text_before_a_call_goes_out_before_the_call_and_no_marker_leaks(syntax, text, content):
    for pieces in splits(text):
        before, _ = stream(syntax, pieces, final_content=content)
        first_call = next(i for i, d in enumerate(before) if d.index is not None)
        assert "".join(d.content or "" for d in before[:first_call]) == content
        assert all(d.content is None for d in before[first_call:])


def test_two_parallel_calls_get_indices_0_and_1_and_max_calls_keeps_the_first():
    text = f"<tool_call>{W}</tool_call><tool_call>{C}</tool_call>"
    before, end = stream(HERMES, list(text))
    assert sorted({d.index for d in before if d.index is not None}) == [0, 1]
    ids = [d.id for d in before if d.name is not None]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    for pieces in splits(text):
        before, end = stream(HERMES, pieces, max_calls=1)
        assert accumulate(before + list(end.deltas)) == expected(HERMES, text, max_calls=1)
        assert {d.index for d in before + list(end.deltas)} == {0}


@pytest.mark.parametrize(("syntax", "text"), [
    (HERMES, '<tool_call>{"name": "weather", "arguments": {"city": "Os'),  # cut by max_tokens
    (HERMES, 'Hm. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}} extra</tool_call> then'),
    (LLAMA3_JSON, '{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "clock", "parameters": 7}'),
    (MISTRAL, 'Hm.[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}, 7]'),
    (MISTRAL_V11, '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]what now[ARGS]{}'),
])
def test_a_call_that_turns_out_malformed_ends_as_the_final_parser_says(syntax, text):
    """Fragments already sent stay; the content is completed to the non-streamed content (the whole text);
    the finish reason is the engine's, so the client knows the partial call is not to be run."""
    assert tool_calls.parse(text, syntax) == (text, [])
    for pieces in (list(text), _TOKEN.findall(text), [text]):
        before, end = stream(syntax, pieces, "length", final_content=text)
        deltas = before + list(end.deltas)
        assert "".join(d.content or "" for d in deltas) == text and end.finish_reason == "length"
        assert end.consistent == (not any(d.index is not None for d in deltas))


def test_a_broken_hermes_block_before_a_good_one_holds_the_rest_and_stays_consistent():
    text = 'Hi <tool_call>{bad json</tool_call> there <tool_call>{"name": "clock", "arguments": {}}</tool_call>'
    content, calls = expected(HERMES, text)
    assert (content, calls) == ("Hi  there", [("clock", {})])
    for pieces in splits(text):
        before, end = stream(HERMES, pieces, final_content=content)
        assert accumulate(before + list(end.deltas)) == (content, calls) and end.consistent


def test_leading_whitespace_before_text_and_a_call_is_kept_by_the_stream():
    """The one well-formed difference: the non-streamed content is stripped, but whitespace at the very start
    of an answer goes out with the text after it, before it is known that a call follows."""
    text = f"\n Sure. <tool_call>{W}</tool_call>"
    before, end = stream(HERMES, [text[:3], text[3:]])
    content, calls = accumulate(before + list(end.deltas))
    assert (content.lstrip(), calls) == expected(HERMES, text) and not end.consistent


def random_answer(rng, syntax):
    """A well-formed answer with 1-3 calls in ``syntax`` (pretty-printed or compact arguments, text around)."""
    def call():
        name = rng.choice(["weather", "clock", "get.x-y_z"])
        args = json.dumps(rng.choice([{}, {"a": 1}, {"s": 'x}"{', "l": [1, {"b": None}]}, {"c": "Zürich"}]),
                          ensure_ascii=False, indent=rng.choice([None, 1]))
        if syntax is MISTRAL_V11:
            return f"[TOOL_CALLS]{name}" + rng.choice(["", "[CALL_ID]abcdefghi"]) + rng.choice(["[ARGS]", ""]) + args
        return f'{{"name": "{name}", "{rng.choice(["arguments", "parameters"])}": {args}}}'
    text = lambda: rng.choice(["", "Sure.", "ok ", "\n", "a < b", "[TOOL", "done."])  # noqa: E731
    calls = [call() for _ in range(rng.randint(1, 3))]
    if syntax is HERMES:
        return text() + "".join(f"<tool_call>{rng.choice(['', chr(10)])}{c}</tool_call>{text()}" for c in calls)
    if syntax is LLAMA3_JSON:
        return rng.choice(["", "<|python_tag|>"]) + rng.choice(["; ", ""]).join(calls) + text() + "<|eot_id|>"
    if syntax is MISTRAL:
        return text() + "[TOOL_CALLS] [" + ", ".join(calls) + "]" + text()
    return text() + "".join(c + text() for c in calls)


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11], ids=lambda s: s.name)
def test_random_answers_and_their_truncations(syntax):
    """Well-formed answers add up to the final parse at random splits; any prefix of one (a cut answer) never
    raises, and whenever the stream says it is consistent it is, and its content is the final content."""
    rng = random.Random(syntax.name)
    for _ in range(60):
        text = random_answer(rng, syntax)
        for cut in (len(text), rng.randint(0, len(text))):
            content, calls = expected(syntax, text[:cut])
            cuts = sorted(rng.sample(range(1, cut), min(cut - 1, 8))) if cut > 1 else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, cut])]
            before, end = stream(syntax, pieces)
            deltas = before + list(end.deltas)
            assert "".join(d.content or "" for d in deltas) == content, (text[:cut], pieces)
            if end.consistent or cut == len(text):
                assert end.consistent and accumulate(deltas) == (content, calls), (text[:cut], pieces)


def test_merge_deltas_joins_neighbours_and_keeps_heads_apart():
    deltas = [Delta(content="a"), Delta(content="b"), Delta(index=0, id="x", name="f"), Delta(index=0, arguments="{"),
              Delta(index=0, arguments="}"), Delta(index=1, id="y", name="g"), Delta(index=1, arguments="{}")]
    assert merge_deltas(deltas) == [Delta(content="ab"), deltas[2], Delta(index=0, arguments="{}"), *deltas[5:]]
