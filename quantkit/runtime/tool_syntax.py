"""How each chat-template family writes tool calls: one small record per syntax.

A model calls tools only in the syntax its chat template taught it. Each :class:`ToolSyntax` says how to
recognise that syntax in a template's text, how to read the calls out of a finished answer, and the grammar
(llguidance's Lark dialect) that forces exactly one call when ``tool_choice`` is ``"required"`` or names a
function. Adding a family is adding a record to :data:`SYNTAXES`. The formats (read from the models' chat
templates and vLLM's ``hermes``, ``llama3_json`` and ``mistral`` tool parsers):

* **hermes** (Qwen2/2.5/3, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text around them is content.
* **llama3_json** (Llama 3.1/3.2/3.3): the template renders the tools' JSON schemas into the prompt and asks
  for ``{"name": function name, "parameters": {...}}``; the answer is that object (optionally after
  ``<|python_tag|>``), several separated by ``;``, ended by ``<|eom_id|>`` / ``<|eot_id|>`` (stop tokens).
  Only an answer that *starts* with a call is one: prose that happens to hold JSON stays content.
* **mistral_v11** (Mistral Small 3.x, Ministral, Devstral: templates with ``[ARGS]``):
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (some templates put ``[CALL_ID]id`` before ``[ARGS]``).
* **mistral** (Mistral 7B v0.3, Mixtral 8x22B, Nemo: tokenizer v3):
  ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.
  Mistral's templates refuse call ids that are not 9 alphanumerics, so calls get such ids.

``<|python_tag|>``, ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens in the real tokenizers: requests
with these syntaxes are detokenized with special tokens kept (``keep_special_tokens``), and the forced
grammars name the special token by id when the tokenizer has it (``<[id]>``), so the model writes the one
token it was trained on rather than spelling the marker out. A malformed answer is plain content, never an
error.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# A parsed call before it gets an id: (function name, arguments object).
Call = tuple[str, dict[str, Any]]
# The special tokens of a tokenizer (text -> id), for the grammars' markers.
Special = Mapping[str, int]

_DECODER = json.JSONDecoder()
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True)
class ToolSyntax:
    """One family's tool-call syntax."""

    name: str
    detect: Callable[[str], bool]  # does this chat template (its source text) use this syntax?
    parse: Callable[[str], tuple[str | None, list[Call]]]  # answer -> (content or None, calls); ([], text) if none
    grammar: Callable[[list[dict[str, Any]], Special], str]  # Lark grammar of exactly one call of these functions
    new_id: Callable[[], str]  # a call id the family's template accepts back
    keep_special_tokens: bool = False  # the markers are special tokens: detokenize with them kept


def _compact(schema: dict[str, Any]) -> str:
    schema = dict(schema)
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON: no room for endless padding
    return json.dumps(schema, separators=(",", ":"))


def _marker(text: str, special: Special) -> str:
    """A Lark term for ``text``: its special token by id where the tokenizer has one, else the string."""
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def _call_schema(functions: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one ``{"name": ..., arguments_key: {...}}`` object over ``functions``."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, arguments_key: f["parameters"]},
              "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}


def as_call(obj: Any, keys: tuple[str, ...]) -> Call | None:
    """``(name, arguments)`` of a decoded ``{"name": ..., <one of keys>: {...}}`` object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in keys if k in obj), {})
    return (obj["name"], arguments) if isinstance(arguments, dict) else None


def _openai_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _content(*parts: str) -> str | None:
    text = "".join(parts).strip()
    return text or None


# -- hermes -----------------------------------------------------------------------------------------------

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)


def _hermes_parse(text: str) -> tuple[str | None, list[Call]]:
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            call = as_call(json.loads(block), ("arguments", "parameters"))
        except json.JSONDecodeError:
            continue
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    return _content(_HERMES_BLOCK.sub("", text)), calls


def _hermes_grammar(functions: list[dict[str, Any]], special: Special) -> str:
    schema = _compact(_call_schema(functions, "arguments"))
    return f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\ncall: %json {schema}\n'


# -- llama3_json --------------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")


def _llama_detect(template: str) -> bool:
    return PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template)


def _llama_parse(text: str) -> tuple[str | None, list[Call]]:
    body = text.strip()
    for end in LLAMA_ENDS:
        body = body.removesuffix(end).rstrip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    calls, pos = [], 0
    while pos < len(body) and body[pos] == "{":
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = as_call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):  # several calls: {...}; {...}
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
    return _content(body[pos:]), calls


def _llama_grammar(functions: list[dict[str, Any]], special: Special) -> str:
    return f"start: call\ncall: %json {_compact(_call_schema(functions, 'parameters'))}\n"


# -- mistral (tokenizer v3: a JSON list after [TOOL_CALLS]) and mistral_v11 (name[ARGS]{...}) -------------

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral_parse(text: str) -> tuple[str | None, list[Call]]:
    head, marker, rest = text.partition(TOOL_CALLS)
    if not marker:
        return text, []
    rest = rest.lstrip()
    try:
        obj, end = _DECODER.raw_decode(rest)
    except json.JSONDecodeError:
        return text, []
    calls = [as_call(item, ("arguments", "parameters")) for item in (obj if isinstance(obj, list) else [obj])]
    if not calls or any(c is None for c in calls):
        return text, []
    return _content(head, rest[end:]), calls


def _mistral_v11_parse(text: str) -> tuple[str | None, list[Call]]:
    head, *pieces = text.split(TOOL_CALLS)
    if not pieces:
        return text, []
    calls, tail = [], ""
    for piece in pieces:
        name, marker, args = piece.partition(ARGS)
        if not marker:  # decoded without the [ARGS] token: the arguments start at the first brace
            brace = piece.find("{")
            name, args = (piece[:brace], piece[brace:]) if brace >= 0 else (piece, "")
        name = name.partition(CALL_ID)[0].strip()
        try:
            arguments, end = _DECODER.raw_decode(args.lstrip())
        except json.JSONDecodeError:
            return text, []
        if not FUNCTION_NAME.fullmatch(name) or not isinstance(arguments, dict):
            return text, []
        calls.append((name, arguments))
        tail += args.lstrip()[end:]
    return _content(head, tail), calls


def _mistral_grammar(functions: list[dict[str, Any]], special: Special) -> str:
    return (f'start: {_marker(TOOL_CALLS, special)} " [" call "]"\n'
            f"call: %json {_compact(_call_schema(functions, 'arguments'))}\n")


def _mistral_v11_grammar(functions: list[dict[str, Any]], special: Special) -> str:
    rules = [f"start: {_marker(TOOL_CALLS, special)} call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        rules.append(f"call_{i}: {json.dumps(f['name'])} {_marker(ARGS, special)} args_{i}")
        rules.append(f"args_{i}: %json {_compact(f['parameters'])}")
    return "\n".join(rules) + "\n"


HERMES = ToolSyntax("hermes", lambda t: HERMES_OPEN in t, _hermes_parse, _hermes_grammar, _openai_id)
MISTRAL_V11 = ToolSyntax("mistral_v11", lambda t: TOOL_CALLS in t and ARGS in t, _mistral_v11_parse,
                         _mistral_v11_grammar, _mistral_id, keep_special_tokens=True)
MISTRAL = ToolSyntax("mistral", lambda t: TOOL_CALLS in t, _mistral_parse, _mistral_grammar, _mistral_id,
                     keep_special_tokens=True)
LLAMA3_JSON = ToolSyntax("llama3_json", _llama_detect, _llama_parse, _llama_grammar, _openai_id,
                         keep_special_tokens=True)

# Tried in this order; the first whose detect matches the template wins.
SYNTAXES: tuple[ToolSyntax, ...] = (HERMES, MISTRAL_V11, MISTRAL, LLAMA3_JSON)


def detect(chat_template: str) -> ToolSyntax | None:
    """The syntax ``chat_template`` teaches, or None when it is none of :data:`SYNTAXES`."""
    return next((s for s in SYNTAXES if s.detect(chat_template)), None)
