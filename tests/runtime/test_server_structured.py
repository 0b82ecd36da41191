"""Structured output and tool calls over HTTP with the official ``openai`` client (loopback), on the real
engine: a tiny random Llama with the tiny tokenizer (a Hermes-style template with tools), and SmolLM2
(``slow``). Outputs are parsed and validated with ``jsonschema``; greedy and sampled."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from tests.runtime.test_server import FakeEngine, running_server  # noqa: E402
from tests.runtime.test_server_openai import refused  # noqa: E402

# A minimal template in the Hermes convention (tools in the system turn, calls as <tool_call> blocks).
TOOL_TEMPLATE = (
    "{% if tools %}<s>system: you may call these tools, one JSON per <tool_call></tool_call> block:"
    "{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}</tool_call>"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the forecast",
                                            "parameters": SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def tiny_served(tiny_family):
    from quantkit.runtime.loader import load_engine

    folder, _ = tiny_family("llama")
    engine = load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=256)
    engine.tokenizer.chat_template = TOOL_TEMPLATE
    with running_server(engine, max_tokens=120) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(tiny_served, temperature):
    for seed in range(2):
        answer = tiny_served.chat.completions.create(
            messages=USER, model=tiny_served.models.list().data[0].id, max_tokens=100, temperature=temperature,
            seed=seed, response_format=schema_format(SCHEMA))
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_json_object_and_bad_formats(tiny_served):
    model = tiny_served.models.list().data[0].id
    answer = tiny_served.chat.completions.create(model=model, messages=USER, max_tokens=100, temperature=0,
                                                 response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    refused(lambda: tiny_served.chat.completions.create(model=model, messages=USER,
                                                        response_format={"type": "yaml"}), "response_format.type")
    refused(lambda: tiny_served.chat.completions.create(model=model, messages=USER,
                                                        response_format={"type": "json_schema", "json_schema": {}}),
            "response_format.json_schema.schema")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_take_response_format_too(tiny_served, temperature):
    """/v1/completions: the same constrained decoding (the openai client passes it in extra_body), streamed
    or not, and the same 400s."""
    model = tiny_served.models.list().data[0].id
    answer = tiny_served.completions.create(model=model, prompt="the quick brown fox", max_tokens=100,
                                            temperature=temperature, seed=1,
                                            extra_body={"response_format": schema_format(SCHEMA)})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)
    chunks = list(tiny_served.completions.create(model=model, prompt="the lazy dog", max_tokens=100,
                                                 temperature=temperature, seed=2, stream=True,
                                                 extra_body={"response_format": schema_format(SCHEMA)}))
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"
    # any object (unbounded: a random model may write one long string until max_tokens cuts it)
    anything = tiny_served.completions.create(model=model, prompt="the", max_tokens=40, temperature=temperature,
                                              seed=3, extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].text.startswith("{")
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)
    refused(lambda: tiny_served.completions.create(model=model, prompt="x",
                                                   extra_body={"response_format": {"type": "yaml"}}),
            "response_format.type")
    refused(lambda: tiny_served.completions.create(
        model=model, prompt="x", extra_body={"response_format": {"type": "json_schema", "json_schema": {}}}),
        "response_format.json_schema.schema")
    text = tiny_served.completions.create(model=model, prompt="the", max_tokens=3, temperature=0,
                                          extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].finish_reason == "length"


def test_tool_call_round_trip(tiny_served):
    model = tiny_served.models.list().data[0].id
    first = tiny_served.chat.completions.create(model=model, messages=USER, max_tokens=120, temperature=0,
                                                tools=[WEATHER, CLOCK], tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in ("weather", "clock")
    params = (WEATHER if call.function.name == "weather" else CLOCK)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    named = tiny_served.chat.completions.create(
        model=model, messages=USER, max_tokens=120, temperature=1.0, seed=3, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "clock"}})
    (clock,) = named.choices[0].message.tool_calls
    assert clock.function.name == "clock" and json.loads(clock.function.arguments)["zone"] in ("utc", "cet")
    # the round trip: the call and its result go back to the model, which answers (free text here)
    follow = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = tiny_served.chat.completions.create(model=model, messages=follow, max_tokens=5, temperature=0,
                                                tools=[WEATHER])
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # streamed: the call's head (name, arguments ""), its arguments in fragments, then finish_reason tool_calls
    chunks = list(tiny_served.chat.completions.create(model=model, messages=USER, max_tokens=120, temperature=0,
                                                      tools=[WEATHER], tool_choice="required", stream=True))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "weather" and calls[0].function.arguments == "" and calls[0].id
    assert len(calls) > 2 and all(c.index == 0 and c.function.name is None and not c.id for c in calls[1:])
    jsonschema.validate(json.loads("".join(c.function.arguments for c in calls)), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_refused_where_the_template_has_none(tokenizer):
    with running_server(FakeEngine(tokenizer)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
        error = refused(lambda: client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER]),
                        "tools")
        assert error["code"] == "tools_unsupported" and "template has no tool calls" in error["message"]
        refused(lambda: client.chat.completions.create(model="fake-model", messages=USER, tool_choice="required"),
                "tool_choice")
        # tool_choice "none": no tools rendered, nothing to refuse
        assert client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER],
                                              tool_choice="none", max_tokens=2).choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import tiny_tokenizer
    from tests.runtime.test_server import CHAT_TEMPLATE

    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Berlin", "Rome"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.mark.slow
def test_smollm2_json_schema_greedy_and_sampled(smollm2_gguf):
    from quantkit.runtime.loader import load_engine

    engine = load_engine(str(smollm2_gguf), device="cpu", max_batch=4, max_seq_len=512)
    messages = [{"role": "user", "content": "Describe a person who lives in a European capital, as JSON."}]
    with running_server(engine, max_tokens=120) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        for temperature, seed in ((0.0, 0), (0.8, 1), (0.8, 2)):
            answer = client.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=120,
                                                    temperature=temperature, seed=seed,
                                                    response_format=schema_format(PERSON))
            assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
            jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
        refused(lambda: client.chat.completions.create(model=engine.model_name, messages=messages, tools=[WEATHER]),
                "tools")  # SmolLM2's template has no tools
