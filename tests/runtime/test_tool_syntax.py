"""The tool-call syntaxes (runtime.tool_syntax) on hand-written model outputs, well-formed and malformed, the
detection from template text, the forced-call grammars checked by llguidance, and tool_calls.parse's OpenAI
shape. A malformed answer must come back as plain content (never an exception)."""

from __future__ import annotations

import json
import re

import pytest

from quantkit.runtime import tool_calls
from quantkit.runtime.tool_syntax import HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, SYNTAXES, detect

WEATHER = {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                             "required": ["city"]}}
CLOCK = {"name": "clock", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}}


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "weather", "parameters": {"city": "Oslo"}}', None, [("weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}<|eom_id|>', None,
     [("weather", {"city": "Oslo"})]),
    ('  {"name": "clock", "arguments": {"zone": "utc"}}; {"name": "weather", "parameters": {}}<|eot_id|>', None,
     [("clock", {"zone": "utc"}), ("weather", {})]),
    ('{"name": "clock", "parameters": {"zone": "cet"}} and then I will tell you', "and then I will tell you",
     [("clock", {"zone": "cet"})]),
])
def test_llama3_json_parses_calls(text, content, calls):
    assert LLAMA3_JSON.parse(text) == (content, calls)


@pytest.mark.parametrize("text", [
    'The answer is {"name": "weather", "parameters": {"city": "Oslo"}}',  # prose first: not a call
    '{"name": "weather", "parameters": {"city": "Os',  # cut by max_tokens
    '{"parameters": {"city": "Oslo"}}',  # no name
    '{"name": "weather", "parameters": "Oslo"}',  # arguments not an object
    '{"name": 3, "parameters": {}}',
    '["weather"]',
    "",
    "Paris is the capital of France.",
])
def test_llama3_json_malformed_is_plain_content(text):
    assert LLAMA3_JSON.parse(text) == (text, [])
    assert tool_calls.parse(text, LLAMA3_JSON) == (text, [])


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]', None, [("weather", {"city": "Oslo"})]),
    ('Let me check.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}, '
     '{"name": "clock", "arguments": {"zone": "utc"}, "id": "abcdefghi"}]', "Let me check.",
     [("weather", {"city": "Rome"}), ("clock", {"zone": "utc"})]),
    ('[TOOL_CALLS] {"name": "clock", "arguments": {}}', None, [("clock", {})]),  # one object, no list
])
def test_mistral_parses_calls(text, content, calls):
    assert MISTRAL.parse(text) == (content, calls)


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Os',  # cut
    '[TOOL_CALLS] [{"arguments": {}}]',  # no name
    '[TOOL_CALLS] [{"name": "weather", "arguments": {}}, 7]',  # one item is not a call
    "[TOOL_CALLS] weather please",
    '[{"name": "weather", "arguments": {}}]',  # no [TOOL_CALLS]: the model did not call
    "[TOOL_CALLS] []",
])
def test_mistral_malformed_is_plain_content(text):
    assert MISTRAL.parse(text) == (text, [])


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}', None, [("weather", {"city": "Oslo"})]),
    ('Sure.[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]clock[ARGS]{"zone": "cet"}', "Sure.",
     [("weather", {"city": "Oslo"}), ("clock", {"zone": "cet"})]),
    ('[TOOL_CALLS]clock[CALL_ID]a1b2c3d4e[ARGS]{"zone": "utc"}', None, [("clock", {"zone": "utc"})]),
    ('[TOOL_CALLS]clock{"zone": "utc"}', None, [("clock", {"zone": "utc"})]),  # [ARGS] not in the text
])
def test_mistral_v11_parses_calls(text, content, calls):
    assert MISTRAL_V11.parse(text) == (content, calls)


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]weather[ARGS]{"city": "Os',
    "[TOOL_CALLS]weather[ARGS]",
    '[TOOL_CALLS]weather[ARGS]["Oslo"]',
    '[TOOL_CALLS]what is the weather[ARGS]{"city": "Oslo"}',  # not a function name
    '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]clock',  # the second call is broken: all is content
    "no calls at all",
])
def test_mistral_v11_malformed_is_plain_content(text):
    assert MISTRAL_V11.parse(text) == (text, [])


def test_hermes_parses_calls_and_skips_broken_blocks():
    text = 'ok <tool_call>\n{"name": "clock", "arguments": {"zone": "utc"}}\n</tool_call><tool_call>{bad</tool_call>'
    assert HERMES.parse(text) == ("ok", [("clock", {"zone": "utc"})])
    assert HERMES.parse("<tool_call>{bad</tool_call>") == ("<tool_call>{bad</tool_call>", [])


def test_openai_shape_and_ids():
    content, calls = tool_calls.parse('[TOOL_CALLS]weather[ARGS]{"city": "Zürich"}', MISTRAL_V11)
    assert content is None and len(calls) == 1
    (call,) = calls
    assert call["type"] == "function" and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Zürich"}
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])  # Mistral's templates accept only such ids
    _, (llama_call,) = tool_calls.parse('{"name": "clock", "parameters": {}}', LLAMA3_JSON)
    assert llama_call["id"].startswith("call_") and llama_call["function"]["arguments"] == "{}"
    ids = {tool_calls.parse('{"name": "clock", "parameters": {}}', LLAMA3_JSON)[1][0]["id"] for _ in range(5)}
    assert len(ids) == 5


LLAMA_31_LIKE = ('{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython{% if tools %}'
                 'Respond in the format {"name": function name, "parameters": dictionary}{% endif %}<|eot_id|>')


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for t in tools %}{{ t }}{% endfor %}<tool_call>{{ m }}</tool_call>", HERMES),
    (LLAMA_31_LIKE, LLAMA3_JSON),
    ("{% if tools %}<|python_tag|>{{ tools }}{% endif %}", LLAMA3_JSON),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% for c in calls %}[TOOL_CALLS] [{{ c }}]{% endfor %}", MISTRAL),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]{{ name }}[ARGS]{{ args }}", MISTRAL_V11),
])
def test_detect_from_template_text(template, expected):
    assert detect(template) is expected
    plan = tool_calls.plan([{"type": "function", "function": WEATHER}], "auto", template)
    assert plan.syntax is expected and plan.grammar_lark is None


def test_templates_without_a_known_syntax_are_refused():
    with pytest.raises(tool_calls.ToolError, match="has no tool calls") as info:
        tool_calls.plan([{"type": "function", "function": WEATHER}], "auto", "{{ messages }}")
    assert info.value.code == "tools_unsupported"
    with pytest.raises(tool_calls.ToolError, match="hermes, mistral_v11, mistral, llama3_json"):
        tool_calls.plan([{"type": "function", "function": WEATHER}], "required", "{{ tools }} <function=x>")


def test_template_tool_calls_decode_arguments():
    calls = [{"id": "abcdefghi", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}},
             {"id": "x", "type": "function", "function": {"name": "w", "arguments": "not json"}}]
    out = tool_calls.template_tool_calls(calls)
    assert out[0]["function"]["arguments"] == {"city": "Oslo"} and out[1] == calls[1]
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'  # the request itself is left as it was


@pytest.mark.parametrize("syntax", SYNTAXES, ids=lambda s: s.name)
def test_forced_grammars_compile_and_name_special_tokens(syntax):
    llguidance = pytest.importorskip("llguidance")
    special = {"[TOOL_CALLS]": 258, "[ARGS]": 260, "<|python_tag|>": 259}
    for functions in ([WEATHER], [WEATHER, CLOCK]):
        lark = syntax.grammar(functions, special)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        assert grammar and "%json" in lark
        if syntax in (MISTRAL, MISTRAL_V11):
            assert "<[258]>" in lark and '"[TOOL_CALLS]"' not in lark
            assert '"[TOOL_CALLS]"' in syntax.grammar(functions, {})  # without the special token: the text
        if syntax is MISTRAL_V11:
            assert "<[260]>" in lark and lark.count("args_") == 2 * len(functions)
