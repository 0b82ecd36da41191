"""The OpenAI-compatible request bodies the server accepts, and the response bodies it writes.

Requests are validated strictly (pydantic strict mode: ``"5"`` is not a number), so a client with a
typo gets a 400 naming the field instead of a silent default. Fields that OpenAI defines but this
server cannot honour (``n > 1``, ``logprobs``, penalties, ...) are rejected when set, never ignored;
fields it does not know (``user``, vendor extras) are ignored, as OpenAI clients send them freely.
``top_k`` and ``repetition_penalty`` are extensions (vLLM spells them the same way).
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
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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
    # OpenAI fields this server does not implement: accepted only at their neutral values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        """Refuse (400) what this server cannot do rather than silently ignore it."""
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request (n=1)",
                           param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported; use repetition_penalty (an extension) instead",
                               param=name, code="unsupported_value")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_value")
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return tuple(stops)

    def sampling_params(self, requested_max_tokens: int | None, default_max_tokens: int,
                        max_tokens_limit: int) -> SamplingParams:
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
            )
        except QuantkitError as exc:
            raise APIError(400, str(exc)) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; a batch of prompts is refused (400)."""
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported (one choice per request)", param="best_of",
                           code="unsupported_value")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request is supported, got a batch of {len(prompt)}",
                               param="prompt", code="unsupported_value")
            prompt = prompt[0]
        return prompt

    def params(self, max_tokens_limit: int) -> SamplingParams:
        return self.sampling_params(self.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, max_tokens_limit)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: a conversation rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def params(self, max_tokens_limit: int) -> SamplingParams:
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # Left out: as many as the server allows (the engine cuts it to what the cache slot holds).
        return self.sampling_params(requested, max_tokens_limit, max_tokens_limit)


def parse_request(model_type: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_type.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"] if not _is_union_branch(part))
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
    """Writes one request's response bodies: the whole answer, or the chunks of a stream."""

    chat: bool
    model: str
    request_id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> ResponseFormat:
        return cls(chat=chat, model=model, request_id=new_id("chatcmpl" if chat else "cmpl"), created=int(time.time()))

    def _envelope(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
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
