"""The OpenAI-compatible request bodies the server accepts, and the response bodies it writes.

Requests are validated strictly (pydantic strict mode: ``"5"`` is not a number), so a client with a
typo gets a 400 naming the field instead of a silent default. Fields that OpenAI defines but this
server cannot honour (``n > 1``, ``logprobs``, penalties, ``functions``, ...) are rejected when set to
anything but their neutral value, never ignored; a field it does not know at all (``foo``) is a 400
too. ``user`` is accepted and ignored (an end-user id, with no effect on the answer). ``top_k`` and
``repetition_penalty`` are extensions (vLLM spells them the same way). Every error has a non-null code.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantkit.config import QuantkitError
from quantkit.runtime.types import SamplingParams

# OpenAI's own default for /v1/completions when max_tokens is left out.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code or _DEFAULT_CODES.get(status, "invalid_request")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_DEFAULT_CODES = {400: "invalid_value", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                  415: "unsupported_media_type", 500: "internal_error", 503: "unavailable"}

# OpenAI request fields this server does not implement, with the values that mean "not used" (accepted).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "functions": (None, []),
    "function_call": (None, "none"),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 or -1: off
    repetition_penalty: float | None = Field(default=None, gt=0)  # extension
    ignore_eos: bool | None = None  # extension (vLLM's): generate max_tokens even past end-of-sequence
    user: str | None = None  # an end-user id: accepted, no effect
    response_format: Any = None  # text, json_object or json_schema (constrained decoding)
    # OpenAI fields this server does not implement: accepted only at their neutral values (UNSUPPORTED_FIELDS).
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None

    def check_supported(self) -> None:
        """Refuse (400) what this server cannot do rather than silently ignore it."""
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request (n=1)",
                           param="n", code="unsupported_value")
        for name in type(self).model_fields:
            neutral = UNSUPPORTED_FIELDS.get(name)
            if neutral is None or name == "n":
                continue
            value = getattr(self, name)
            if not any(value == v and type(value) is not bool or value is v for v in neutral):
                hint = "; use repetition_penalty (an extension) instead" if name.endswith("_penalty") else ""
                raise APIError(400, f"{name} is not supported by this server{hint} (leave it out)", param=name,
                               code="unsupported_parameter")

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", param="stop",
                           code="too_many_stop_strings")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
        return tuple(stops)

    def sampling_params(self, requested_max_tokens: int | None, default_max_tokens: int,
                        max_tokens_limit: int, grammar: str | None = None,
                        skip_special_tokens: bool = True) -> SamplingParams:
        """The engine's :class:`SamplingParams`; ``max_tokens`` above the server's limit is a 400."""
        self.check_supported()
        max_tokens = default_max_tokens if requested_max_tokens is None else requested_max_tokens
        if max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens={max_tokens} is above this server's limit of {max_tokens_limit} "
                           "(start it with a larger --max-tokens)", param="max_tokens", code="max_tokens_exceeded")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0),
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                seed=self.seed,
                stop=self.stop_strings(),
                ignore_eos=bool(self.ignore_eos),
                grammar=grammar,
                skip_special_tokens=skip_special_tokens,
            )
        except QuantkitError as exc:
            raise APIError(400, str(exc)) from exc

    def response_grammar(self) -> str | None:
        """The grammar ``response_format`` asks for (None: free text); 400 when it cannot be honoured."""
        fmt = self.response_format
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind not in ("json_object", "json_schema"):
            raise APIError(400, "response_format.type must be text, json_object or json_schema",
                           param="response_format.type", code="invalid_value")
        from quantkit.runtime.constrained import json_grammar

        schema = None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                               param="response_format.json_schema.schema", code="invalid_value")
        try:
            return json_grammar(schema)
        except QuantkitError as exc:
            raise APIError(400, str(exc), param="response_format", code="invalid_value") from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; a batch of prompts is refused (400)."""
        self.check_supported()
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request is supported, got a batch of {len(prompt)}",
                               param="prompt", code="unsupported_value")
            prompt = prompt[0]
        return prompt

    def params(self, max_tokens_limit: int) -> SamplingParams:
        return self.sampling_params(self.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, max_tokens_limit,
                                    self.response_grammar())

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (passed to the template)
    tool_call_id: str | None = None  # a tool message: which call it answers

    def check(self, index: int) -> None:
        """A message needs content, unless it is an assistant message that made tool calls."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise APIError(400, f"messages.{index}.content is missing: every message needs content (an assistant "
                           "message may have tool_calls instead)", param=f"messages.{index}.content",
                           code="missing_required_parameter")

    def template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            from quantkit.runtime.tool_calls import template_tool_calls

            out["tool_calls"] = template_tool_calls(self.tool_calls)
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: a conversation rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def tool_plan(self, chat_template: str | None, special: dict[str, int] | None = None):
        """The request's tools (runtime.tool_calls.ToolPlan, or None); 400 when they cannot be honoured.
        ``special``: the tokenizer's special tokens (text -> id)."""
        from quantkit.runtime import tool_calls

        if self.parallel_tool_calls not in (None, True, False):
            raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls",
                           code="invalid_value")
        if self.parallel_tool_calls is not None and not self.tools:
            raise APIError(400, "parallel_tool_calls is only allowed with tools", param="parallel_tool_calls",
                           code="invalid_value")
        try:
            plan = tool_calls.plan(self.tools, self.tool_choice, chat_template, special)
        except tool_calls.ToolError as exc:
            raise APIError(400, exc.message, param=exc.param, code=exc.code) from exc
        if plan is not None and plan.grammar_lark is not None and self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "a required tool call and response_format cannot be combined", param="tool_choice",
                           code="invalid_value")
        return plan

    def template_messages(self) -> list[dict[str, Any]]:
        for i, m in enumerate(self.messages):
            m.check(i)
        return [m.template_dict() for m in self.messages]

    @property
    def max_tokens_given(self) -> bool:
        return self.max_completion_tokens is not None or self.max_tokens is not None

    def params(self, max_tokens_limit: int, grammar: str | None = None,
               skip_special_tokens: bool = True) -> SamplingParams:
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # Left out: as many as the server allows (the engine cuts it to what the cache slot holds).
        return self.sampling_params(requested, max_tokens_limit, max_tokens_limit, grammar, skip_special_tokens)


def parse_request(model_type: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_type")
    try:
        return model_type.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [e for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]  # top-level fields
        first = unknown[0] if unknown else errors[0]
        field = ".".join(str(part) for part in first["loc"] if not _is_union_branch(part))
        if unknown:
            raise APIError(400, f"unknown field {field!r}: this server does not implement it (leave it out)",
                           param=field, code="unknown_parameter") from exc
        raise APIError(400, f"{field or 'body'}: {first['msg']} ({exc.error_count()} problem(s) in the request)",
                       param=field or None, code="invalid_value") from exc


def _is_union_branch(part: Any) -> bool:
    """pydantic names union members in error locations (``str``, ``list[int]``): not part of the field path."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class ResponseFormat:
    """Writes one request's response bodies: the whole answer, or the chunks of a stream. ``tool_syntax``
    (a runtime.tool_syntax.ToolSyntax): the answer may hold tool calls written that way (parsed from the
    whole text; a stream sends them as they are written, runtime.tool_stream; ``max_calls`` 1 when
    parallel_tool_calls is false)."""

    chat: bool
    model: str
    request_id: str
    created: int
    tool_syntax: Any = None
    max_calls: int | None = None

    @classmethod
    def new(cls, chat: bool, model: str, tool_syntax: Any = None, max_calls: int | None = None) -> ResponseFormat:
        return cls(chat=chat, model=model, request_id=new_id("chatcmpl" if chat else "cmpl"), created=int(time.time()),
                   tool_syntax=tool_syntax, max_calls=max_calls)

    @property
    def tools(self) -> bool:
        return self.tool_syntax is not None

    def tool_message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message (content and tool_calls) of ``text``, and the finish reason it gives."""
        from quantkit.runtime import tool_calls

        content, calls = tool_calls.parse(text, self.tool_syntax)
        calls = calls[: self.max_calls] if self.max_calls else calls
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def tool_stream(self):
        """The incremental parser (runtime.tool_stream.ToolStream) of one streamed answer's tool calls."""
        from quantkit.runtime.tool_stream import ToolStream

        return ToolStream(self.tool_syntax, self.max_calls)

    def delta_chunk(self, delta) -> dict:
        """The stream chunk of a runtime.tool_stream.Delta: content, a call's head (``index``, ``id``, ``type``,
        ``function.name``, ``arguments: ""``) or a fragment of its ``function.arguments``."""
        if delta.index is None:
            return self.chunk(delta.content)
        call: dict[str, Any] = {"index": delta.index, "function": {"arguments": delta.arguments}}
        if delta.name is not None:
            call.update(id=delta.id, type="function", function={"name": delta.name, "arguments": delta.arguments})
        return self._envelope("chat.completion.chunk", [{"index": 0, "delta": {"tool_calls": [call]},
                                                         "logprobs": None, "finish_reason": None}])

    def _envelope(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.tools:
                message, finish_reason = self.tool_message(text, finish_reason)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        """One streamed chunk: a text delta, or (``text=None``) the closing chunk with the finish reason."""
        if self.chat:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
            if text is not None and not role:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
