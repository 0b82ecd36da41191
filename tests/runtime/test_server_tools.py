"""Tool calls in the Llama 3.1-3.3 JSON and Mistral ([TOOL_CALLS], old and v11+) syntaxes, over HTTP with the
official ``openai`` client (loopback) on the real engine: a tiny random Llama whose tokenizer has the families'
markers as special tokens, and a short chat template per family written here that renders tools as that
family does. A random model cannot pick a tool, so ``tool_choice`` "required" / a named function make the
grammar force a call; the round trip sends the call and its result back through the template (Mistral's
templates refuse ids that are not 9 alphanumerics)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from tests.runtime.test_server import running_server  # noqa: E402
from tests.runtime.test_server_structured import CLOCK, SCHEMA, USER, WEATHER  # noqa: E402

SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
           "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

_ID_CHECK = ("{% if c.id is not string or c.id | length != 9 or not c.id.isalnum() %}"
             "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}")

# Llama 3.1-3.3: tools as JSON schemas in the system turn, calls as {"name", "parameters"}, results as ipython.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'To call a function, respond with JSON in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}'
    "{{ '}' }}{% endfor %}<|eom_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ {'output': m.content} | tojson }}"
    "<|eot_id|>{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Mistral (tokenizer v3): tools before the first [INST], calls as a JSON list after [TOOL_CALLS].
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    "{% if tools and loop.first %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}" + _ID_CHECK +
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
# Mistral v11+: [TOOL_CALLS]name[CALL_ID]id[ARGS]{...} per call.
MISTRAL_V11_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}" + _ID_CHECK +
    "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}"
    "{{ eos_token }}{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
TEMPLATES = {"llama3_json": LLAMA_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "mistral_v11": MISTRAL_V11_TEMPLATE}
# How each template writes an earlier call back into the prompt: arguments as an object, never a quoted string.
RENDERED_CALL = {"llama3_json": '{"name": "weather", "parameters": {"city": "Oslo", "days": 2}}',
                 "mistral": '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo", "days": 2}, "id": ',
                 "mistral_v11": '[ARGS]{"city": "Oslo", "days": 2}'}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny random Llama with the markers as special tokens, loaded by the runtime (1024-token context)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.loader import load_engine
    from tests.conftest import tiny_tokenizer
    from tests.runtime.conftest import tiny_config

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    config = tiny_config("llama", len(tokenizer))
    config.max_position_embeddings = 1024  # room for the tools' schemas in the prompt
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_tools")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_engine(str(folder), device="cpu", max_batch=4, max_seq_len=1024)


@pytest.fixture(scope="module")
def client(engine):
    with running_server(engine, max_tokens=120) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_call(call, syntax, name=None):
    assert call.type == "function" and call.function.name in ((name,) if name else ("weather", "clock"))
    params = (WEATHER if call.function.name == "weather" else CLOCK)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    if syntax.startswith("mistral"):
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id), call.id
    else:
        assert call.id.startswith("call_")


@pytest.mark.parametrize("syntax", list(TEMPLATES))
def test_tool_call_round_trip(engine, client, syntax):
    engine.tokenizer.chat_template = TEMPLATES[syntax]
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=USER, max_tokens=120, temperature=0,
                                           tools=[WEATHER, CLOCK], tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    check_call(call, syntax)
    named = client.chat.completions.create(model=model, messages=USER, max_tokens=120, temperature=1.0, seed=5,
                                           tools=[WEATHER, CLOCK],
                                           tool_choice={"type": "function", "function": {"name": "clock"}})
    (clock,) = named.choices[0].message.tool_calls
    check_call(clock, syntax, "clock")
    # the round trip: the call (its id too) and its result go back through the family's template
    follow = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=model, messages=follow, max_tokens=6, temperature=0,
                                           tools=[WEATHER, CLOCK])
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # streamed: the call's head (name, arguments ""), its arguments in fragments, then finish_reason tool_calls
    chunks = list(client.chat.completions.create(model=model, messages=USER, max_tokens=120, temperature=0,
                                                 tools=[WEATHER], tool_choice="required", stream=True))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "weather" and calls[0].function.arguments == "" and calls[0].id
    assert len(calls) > 2 and all(c.index == 0 and c.function.name is None and not c.id for c in calls[1:])
    jsonschema.validate(json.loads("".join(c.function.arguments for c in calls)), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("syntax", list(TEMPLATES))
def test_auto_answers_are_content_or_calls_never_errors(engine, client, syntax):
    """With tool_choice auto the random model writes what it likes (special tokens included): a 200 with
    content (or a call that parses), never a 500; streamed (same seed), the same content and finish reason."""
    engine.tokenizer.chat_template = TEMPLATES[syntax]
    for seed in range(3):
        request = dict(model=client.models.list().data[0].id, messages=USER, max_tokens=12, temperature=1.0,
                       seed=seed, tools=[WEATHER, CLOCK])
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason in ("length", "stop", "tool_calls")
        assert choice.message.tool_calls or isinstance(choice.message.content, str)
        chunks = [c.choices[0] for c in client.chat.completions.create(**request, stream=True) if c.choices]
        assert chunks[-1].finish_reason == choice.finish_reason
        assert "".join(c.delta.content or "" for c in chunks) == (choice.message.content or "")


@pytest.mark.parametrize("syntax", list(TEMPLATES))
def test_the_template_gets_arguments_as_objects(engine, syntax):
    from quantkit.runtime.openai_schema import ChatCompletionRequest, parse_request

    call = {"id": "a1b2c3d4e", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}}
    body = parse_request(ChatCompletionRequest, {"messages": USER + [
        {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "9C"}],
        "tools": [WEATHER]})
    text = engine.tokenizer.apply_chat_template(body.template_messages(), tools=[WEATHER], tokenize=False,
                                                chat_template=TEMPLATES[syntax])
    assert RENDERED_CALL[syntax] in text, text


def test_forced_markers_are_the_special_tokens(engine):
    """The grammar makes the model write [TOOL_CALLS] / [ARGS] as their single special tokens; decoded with
    special tokens kept the answer parses, decoded as usual the markers would be gone."""
    from quantkit.runtime import tool_calls
    from quantkit.runtime.constrained import lark_grammar
    from quantkit.runtime.tool_syntax import MISTRAL_V11
    from quantkit.runtime.types import SamplingParams
    from tests.runtime.test_engine import run_schedule

    tok = engine.tokenizer
    plan = tool_calls.plan([WEATHER], "required", MISTRAL_V11_TEMPLATE, tok.get_added_vocab())
    assert plan.syntax is MISTRAL_V11 and plan.keep_special_tokens
    params = [SamplingParams(max_tokens=100, grammar=lark_grammar(plan.grammar_lark), skip_special_tokens=skip)
              for skip in (False, True)]
    (kept_ids, kept, reason), (_, skipped, _) = run_schedule(engine, [(0, [5, 6, 7], p) for p in params])
    assert reason == "stop" and kept_ids[0] == tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert tok.convert_tokens_to_ids("[ARGS]") in kept_ids
    assert kept.startswith("[TOOL_CALLS]weather[ARGS]{"), kept
    _, (call,) = tool_calls.parse(kept, MISTRAL_V11)
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    assert "[TOOL_CALLS]" not in skipped and tool_calls.parse(skipped, MISTRAL_V11)[1] == []
