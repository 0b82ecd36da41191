"""Streamed tool calls over HTTP (loopback), the way OpenAI streams them: content at once, a call's head
(``index``, ``id``, ``type``, ``function.name``, ``arguments: ""``), then ``function.arguments`` fragments,
then ``finish_reason: "tool_calls"``. The engine is test_server.py's fake, scripted to write a given answer
token by token; the official ``openai`` client's accumulated stream must equal the non-streamed answer."""

from __future__ import annotations

import json
import threading

import pytest

from quantkit.runtime.types import FINISH_LENGTH, FINISH_STOP, TokenEvent

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from tests.runtime.test_server import FakeEngine, running_server, sse_events  # noqa: E402

TEMPLATES = {  # the two families' markers are all the server needs to detect their syntax
    "hermes": "{% if tools %}tools, one per <tool_call></tool_call> block\n{% endif %}"
              "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
    "mistral_v11": "{% if tools %}[AVAILABLE_TOOLS] [TOOL_CALLS]name[ARGS]{}{% endif %}"
                   "{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}",
}
ANSWERS = {
    "hermes": ['Let', ' me', ' check', '.', ' <', 'tool', '_call', '>\n{"', 'name', '":', ' "', 'weather', '",',
               ' "arguments', '":', ' {"', 'city', '":', ' "', 'Os', 'lo', '",', ' "days', '":', ' 2', '}}', '\n</',
               'tool_call', '>\n<tool_call>', '{"name": "clock", ', '"arguments": {"zone"', ': "utc"}}', '</tool_call>'],
    "mistral_v11": ['Let', ' me', ' check', '.', '[TOOL_CALLS]', 'weather', '[ARGS]', '{"', 'city', '":', ' "Os',
                    'lo', '", "days": 2', '}', '[TOOL_CALLS]', 'clock', '[ARGS]', '{"zone"', ': "utc"}'],
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("weather", "clock")]
USER = [{"role": "user", "content": "the quick brown fox"}]
CUT = {"hermes": 20, "mistral_v11": 11}  # max_tokens that cut the first call's arguments ("Os")


class ScriptedEngine(FakeEngine):
    """test_server.FakeEngine writing ``script`` (one text piece per token) and stopping after it; at token
    ``hold_at`` it waits for ``release`` (so a test can see what was streamed before the answer ended)."""

    script: list[str] = []
    hold_at: int | None = None

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, max_batch=2, max_seq_len=512)
        self.release = threading.Event()

    def _advance(self, rid: int, state: dict) -> TokenEvent:
        k, params = state["k"], self.params[rid]
        if k == self.hold_at:
            self.release.wait(20)
        state["k"] += 1
        finish = FINISH_STOP if state["k"] == len(self.script) else (
            FINISH_LENGTH if state["k"] >= params.max_tokens else None)
        if finish:
            del self.running[rid]
        return TokenEvent(rid, 100 + k, self.script[k], finish is not None, finish, len(self.prompts[rid]),
                          state["k"])


@pytest.fixture(scope="module")
def served():
    from tests.conftest import tiny_tokenizer

    engine = ScriptedEngine(tiny_tokenizer())
    with running_server(engine, max_tokens=64) as (url, _):
        yield url, engine


def chat(engine, syntax, answer, **extra):
    engine.tokenizer.chat_template = TEMPLATES[syntax]
    engine.script, engine.hold_at = answer, None
    return {"messages": USER, "tools": TOOLS, "max_tokens": 64, **extra}


@pytest.mark.parametrize("syntax", list(TEMPLATES))
def test_the_chunks_come_as_openai_streams_them(served, syntax):
    url, engine = served
    with httpx.Client(base_url=url, timeout=20) as client:
        body = chat(engine, syntax, ANSWERS[syntax], stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            events = sse_events(response.iter_lines())
        whole = client.post("/v1/chat/completions", json=dict(body, stream=False)).json()["choices"][0]
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert "".join(d["content"] for d in deltas[:first_call]) == "Let me check." == whole["message"]["content"]
    assert all("content" not in d for d in deltas[first_call:])  # no marker leaked as content
    calls = [d["tool_calls"][0] for d in deltas[first_call:]]
    assert all(len(d["tool_calls"]) == 1 for d in deltas[first_call:])
    for index, expected in enumerate(whole["message"]["tool_calls"]):
        mine = [c for c in calls if c["index"] == index]
        head, fragments = mine[0], mine[1:]
        assert head == {"index": index, "id": head["id"], "type": "function",
                        "function": {"name": expected["function"]["name"], "arguments": ""}}
        assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
        assert len(fragments) >= (3 if index == 0 else 1)
        arguments = "".join(f["function"]["arguments"] for f in fragments)
        assert json.loads(arguments) == json.loads(expected["function"]["arguments"])
    assert max(c["index"] for c in calls) == len(whole["message"]["tool_calls"]) - 1 == 1


def test_a_plain_answer_streams_before_it_ends(served):
    """With tools offered, a plain-text answer's content goes out while the engine is still writing."""
    url, engine = served
    answer = ["Paris", " is", " the", " capital", " <", "b", ">of</b>", " France", "."]
    body = chat(engine, "hermes", answer, stream=True)
    engine.hold_at = 6
    seen = []
    try:
        with httpx.Client(base_url=url, timeout=20) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        seen.append(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                    if "".join(c or "" for c in seen) == "Paris is the capital":  # " <" held: could be a tag
                        engine.release.set()
                        break
                rest = sse_events(lines)
    finally:
        engine.release.set()
    assert rest[-2]["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(c or "" for c in seen) + "".join(e["choices"][0]["delta"].get("content", "")
                                                       for e in rest[:-1] if e["choices"])
    assert streamed == "".join(answer)


def test_the_openai_client_accumulates_what_the_non_streamed_answer_says(served):
    openai = pytest.importorskip("openai")
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
    for syntax, answer in ANSWERS.items():
        for cut in (len(answer), CUT[syntax]):
            body = chat(engine, syntax, answer[:cut] + ["."] * (cut < len(answer)), max_tokens=cut)
            whole = client.chat.completions.create(model="fake-model", **body).choices[0]
            with client.chat.completions.stream(model="fake-model", **body) as stream:
                for _ in stream:  # the client's own accumulation (get_final_completion refuses "length")
                    pass
                streamed = stream.current_completion_snapshot.choices[0]
            assert streamed.finish_reason == whole.finish_reason == ("tool_calls" if cut == len(answer) else "length")
            assert streamed.message.content == whole.message.content
            if cut == len(answer):
                got = [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls]
                assert got == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
                assert len({c.id for c in streamed.message.tool_calls}) == 2
            else:  # the partial call stays in the stream; finish_reason "length" says it is not to be run
                assert not whole.message.tool_calls and streamed.message.tool_calls[0].function.name == "weather"
