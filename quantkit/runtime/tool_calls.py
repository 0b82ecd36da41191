"""Tool calls (``tools`` / ``tool_choice``) for chat templates that define them.

A model can call tools only in the syntax its chat template taught it; :mod:`.tool_syntax` holds one
record per syntax this server knows (Hermes ``<tool_call>``, Llama 3.1-3.3 JSON, Mistral ``[TOOL_CALLS]``
old and v11+), detected from the template's text. A template that mentions no tools is refused with a
400 saying so; one whose syntax is none of those likewise, naming the ones it knows.

``tool_choice``: ``"none"`` renders no tools; ``"auto"`` (the default) lets the model choose and parses
any calls it wrote; ``"required"`` and ``{"type": "function", "function": {"name": ...}}`` constrain the
output with the syntax's grammar (:mod:`.constrained`) to one call of one of the tools (or the named one),
whose arguments follow that tool's ``parameters`` schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from quantkit.runtime import tool_syntax
from quantkit.runtime.tool_syntax import HERMES, Special, ToolSyntax


class ToolError(Exception):
    """A request's tools cannot be served: ``param`` names the field, ``code`` the reason."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def template_syntax(chat_template: str | None) -> ToolSyntax | str:
    """The tool-call syntax this template teaches, or a message saying why it cannot take tools."""
    if not chat_template or "tools" not in chat_template:
        return "this model's chat template has no tool calls (it never renders `tools`); send no tools"
    syntax = tool_syntax.detect(chat_template)
    if syntax is None:
        known = ", ".join(s.name for s in tool_syntax.SYNTAXES)
        return (f"this model's chat template renders tools, but not in a tool-call syntax this server parses "
                f"({known}); send no tools")
    return syntax


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for rendering, decoding and parsing."""

    tools: list[dict[str, Any]] | None  # passed to the template (None: tool_choice "none")
    grammar_lark: str | None  # set when a call is required
    syntax: ToolSyntax | None = None  # how the answer's calls are written (None: nothing to parse)

    @property
    def parse(self) -> bool:
        return self.syntax is not None

    @property
    def keep_special_tokens(self) -> bool:
        return self.syntax is not None and self.syntax.keep_special_tokens


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


def plan(tools: Any, tool_choice: Any, chat_template: str | None, special: Special | None = None) -> ToolPlan | None:
    """The plan for a request's ``tools`` / ``tool_choice`` (None: no tools in play); raises ToolError.
    ``special``: the tokenizer's special tokens (text -> id), which the forced grammars name by id."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return ToolPlan(None, None)
    syntax = template_syntax(chat_template)
    if isinstance(syntax, str):
        raise ToolError(syntax, "tools", "tools_unsupported")
    if tool_choice in (None, "auto"):
        return ToolPlan(tools, None, syntax)
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
    return ToolPlan(tools, syntax.grammar(chosen, special or {}), syntax)


def parse(text: str, syntax: ToolSyntax = HERMES) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls or None, the calls in OpenAI's ``tool_calls`` shape); a malformed answer
    is ``(text, [])``."""
    content, calls = syntax.parse(text)
    if not calls:
        return text, []
    return content, [{"id": syntax.new_id(), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                     for name, arguments in calls]


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates expect them: ``arguments`` decoded from the API's
    JSON string into an object (Llama's and Mistral's templates write it with ``tojson``), as vLLM does."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                arguments = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                arguments = None
            if isinstance(arguments, dict):
                call = dict(call, function=dict(fn, arguments=arguments))
        out.append(call)
    return out
