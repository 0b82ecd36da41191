"""Tool calls (``tools`` / ``tool_choice``) for chat templates that define them.

A model can call tools only in the syntax its chat template taught it. This server knows one: the
Hermes convention (Qwen2/2.5/3, Hermes, many fine-tunes), where the template renders the tools' JSON
schemas into the system prompt and the model answers ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(one block per call). A template that mentions no tools is refused with a 400 saying so; one with another
syntax (Llama 3.1's, Mistral's) likewise, naming what is missing.

``tool_choice``: ``"none"`` renders no tools; ``"auto"`` (the default) lets the model choose and parses
any blocks it wrote; ``"required"`` and ``{"type": "function", "function": {"name": ...}}`` constrain the
output with a grammar (:mod:`.constrained`) to one call of one of the tools (or the named one), whose
arguments follow that tool's ``parameters`` schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


class ToolError(Exception):
    """A request's tools cannot be served: ``param`` names the field, ``code`` the reason."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def template_syntax(chat_template: str | None) -> str:
    """Why this template cannot take tools (a message), or "" when it can (the Hermes syntax)."""
    if not chat_template or "tools" not in chat_template:
        return "this model's chat template has no tool calls (it never renders `tools`); send no tools"
    if OPEN not in chat_template:
        return ("this model's chat template renders tools, but not in the <tool_call> syntax this server parses; "
                "send no tools")
    return ""


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for rendering, decoding and parsing."""

    tools: list[dict[str, Any]] | None  # passed to the template (None: tool_choice "none")
    grammar_lark: str | None  # set when a call is required

    @property
    def parse(self) -> bool:
        return self.tools is not None


def _functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                        "tools", "invalid_value")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"parameters\": {...}}}}", f"tools.{i}", "invalid_value")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolError(f"tools.{i}.function.parameters must be a JSON schema object",
                            f"tools.{i}.function.parameters", "invalid_value")
        out.append({"name": fn["name"], "parameters": params})
    return out


def plan(tools: Any, tool_choice: Any, chat_template: str | None) -> ToolPlan | None:
    """The plan for a request's ``tools`` / ``tool_choice`` (None: no tools in play); raises ToolError."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return ToolPlan(None, None)
    problem = template_syntax(chat_template)
    if problem:
        raise ToolError(problem, "tools", "tools_unsupported")
    if tool_choice in (None, "auto"):
        return ToolPlan(tools, None)
    if tool_choice == "required":
        chosen = functions
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice",
                            "invalid_value")
    else:
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice", "invalid_value")
    return ToolPlan(tools, call_grammar(chosen))


def call_grammar(functions: list[dict[str, Any]]) -> str:
    """A Lark grammar (llguidance's dialect, with %json) of exactly one call of one of ``functions``."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON: no room for endless padding
    return (f'start: "{OPEN}\\n" call "\\n{CLOSE}"\n'
            f'call: %json {json.dumps(schema, separators=(",", ":"))}\n')


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the call blocks or None, the calls in OpenAI's ``tool_calls`` shape)."""
    calls = []
    for block in _BLOCK.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls
