"""Tool calls while they are being written: an incremental parser fed a streamed answer's text deltas.

OpenAI streams a call as ``delta.tool_calls[i]``: ``index``, ``id``, ``type`` and ``function.name`` (with
``arguments: ""``) first, then ``function.arguments`` fragments; the finish chunk says ``"tool_calls"``.
:class:`ToolStream` turns the deltas of an answer in one :mod:`.tool_syntax` into such :class:`Delta` records
as soon as it can be sure of them:

* Content goes out at once, less a suffix that could still become the opening marker (``<tool_call>``,
  ``[TOOL_CALLS]``; Llama: a leading ``{`` or ``<|python_tag|>``), trailing whitespace and (after Llama
  calls) the end markers. A marker split across tokens is never sent as content.
* A call's head goes out once its name is complete (``{"name": "f", "arguments": {``, or v11's ``f[ARGS]``),
  then the arguments object's raw JSON text as it comes. An object in another order is sent whole once read.
* Mistral v11 text after a call is held to the end (a later broken call voids all calls).

The last word is the syntax's own parser (``ToolSyntax.parse``, the non-streamed answer's too):
:meth:`ToolStream.finish` parses the whole text and sends what is missing (the rest of the content, calls
not yet sent). A well-formed answer's stream adds up to the non-streamed message (arguments equal as JSON);
one difference: whitespace at the very start of text before a call went out before the call was known.
When that parser rejects a call already (partly) sent (cut by ``max_tokens``, bad JSON, a later broken call
in an all-or-nothing syntax), nothing is taken back: the content is completed to the non-streamed content
where the stream sent a prefix of it, and the finish reason is the non-streamed one (``"length"``/``"stop"``
when no call parsed: the partial call is not to be run, as in OpenAI's own cut streams).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from quantkit.runtime import tool_syntax
from quantkit.runtime.tool_syntax import HERMES_CLOSE, HERMES_OPEN, TOOL_CALLS, ToolSyntax

_KEYS = ("arguments", "parameters")  # where a call object's arguments may be, first found first
# The head of a {"name": ..., "arguments": {...}} object up to the arguments' opening brace.
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{\Z')
# States that skip whitespace, separators and brackets up to the next call object.
_BETWEEN = frozenset({"hermes_open", "mistral_open", "mistral_item", "mistral_sep", "llama_next", "llama_more",
                      "v11_open"})


@dataclass(frozen=True)
class Delta:
    """One piece of a streamed answer: content text, or a tool call's head (``name`` and ``id`` set) or an
    arguments fragment of the call at ``index``."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamEnd:
    """What :meth:`ToolStream.finish` leaves to send: the last deltas and the finish reason."""

    deltas: tuple[Delta, ...]
    finish_reason: str | None
    consistent: bool  # the stream adds up to the non-streamed message


@dataclass
class _Sent:
    """A call the stream has begun to send."""

    name: str
    arguments: str = ""
    done: bool = False


class _Scan:
    """Where a JSON value fed piece by piece ends: bracket depth outside strings."""

    depth, in_string, escaped = 0, False, False

    def step(self, ch: str) -> bool:
        """Take one character; True when it closes the top-level value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    return max((n for m in markers for n in range(1, min(len(m), len(text) + 1)) if text.endswith(m[:n])),
               default=0)


def _held_from(text: str, markers: tuple[str, ...], ends: tuple[str, ...] = ()) -> int:
    """Where the part of ``text`` to hold back starts: a possible marker's start, then trailing whitespace
    and complete end markers before it."""
    cut = len(text) - _partial_suffix(text, markers + ends)
    while True:
        cut = len(text[:cut].rstrip())
        end = next((e for e in ends if text[:cut].endswith(e)), None)
        if end is None:
            return cut
        cut -= len(end)


class ToolStream:
    """The incremental parser of one answer: :meth:`feed` each text delta, :meth:`finish` at the end.
    ``max_calls``: calls beyond it are read but not sent (``parallel_tool_calls: false``: 1)."""

    def __init__(self, syntax: ToolSyntax, max_calls: int | None = None) -> None:
        self.syntax, self.max_calls = syntax, max_calls
        self.text = ""  # the whole answer so far
        self.sent: list[_Sent] = []  # the calls begun on the stream
        self.content_sent = ""
        self._buf = ""  # text the state machine has not consumed yet
        self._mode = "llama_start" if syntax is tool_syntax.LLAMA3_JSON else "content"
        self._held_ws = ""  # whitespace before a call: sent only if content follows the call
        self._calls_seen = 0  # call markers (or Llama objects) met
        self._obj = ""  # the call object (Mistral v11: the arguments object) being read
        self._scan = _Scan()
        self._call: int | None = None  # the index in sent of the call being read (None: not streamed)
        self._args_depth = 0  # the scanner's depth inside the arguments object (0: outside)
        self._pending: tuple[str, dict[str, Any]] | None = None  # a call read whole, sent once it counts
        self._in_list = False  # Mistral: the calls are a JSON list
        self._good_calls = 0  # Hermes blocks closed with a good call in them

    # -- the public side --------------------------------------------------------------------------------

    def feed(self, delta: str) -> list[Delta]:
        """The deltas that can be sent now that ``delta`` was written."""
        self.text += delta
        self._buf += delta
        out: list[Delta] = []
        while self._buf and self._step(out):
            pass
        return out

    def finish(self, finish_reason: str | None) -> StreamEnd:
        """Parse the whole answer with the syntax's parser and send what the stream still owes."""
        content, calls = self.syntax.parse(self.text)
        if not calls:
            content = self.text
        calls = calls[: self.max_calls] if self.max_calls else calls
        calls_ok = len(self.sent) <= len(calls) and all(
            s.done and s.name == name and _loads(s.arguments) == arguments
            for s, (name, arguments) in zip(self.sent, calls))
        final, sent = content or "", self.content_sent
        if final.startswith(sent):
            rest, content_ok = final[len(sent):], True
        elif calls and final.startswith(sent.lstrip()):  # whitespace at the start went out before the call came
            rest, content_ok = final[len(sent.lstrip()):], False
        else:
            rest, content_ok = "", False
        out = [Delta(content=rest)] if rest else []
        if calls_ok:
            for index, (name, arguments) in enumerate(calls[len(self.sent):], len(self.sent)):
                out.append(Delta(index=index, id=self.syntax.new_id(), name=name))
                out.append(Delta(index=index, arguments=json.dumps(arguments, ensure_ascii=False)))
        consistent = calls_ok and content_ok
        return StreamEnd(tuple(out), "tool_calls" if calls else finish_reason, consistent)

    # -- content ----------------------------------------------------------------------------------------

    def _emit_content(self, piece: str, out: list[Delta], before_call: bool = False) -> None:
        tail = ""
        if before_call:
            kept = len(piece.rstrip())
            piece, tail = piece[:kept], piece[kept:]
        if piece and self.content_sent:
            piece = self._held_ws + piece
        elif self._calls_seen:
            piece = piece.lstrip()
        if piece:
            self._send(piece, out)
            self._held_ws = ""
        self._held_ws += tail

    def _send(self, piece: str, out: list[Delta]) -> None:
        if piece:
            out.append(Delta(content=piece))
            self.content_sent += piece

    def _content_step(self, out: list[Delta], opener: str | None, ends: tuple[str, ...] = (),
                      hold: bool = False) -> bool:
        """Content up to ``opener`` (None: none can follow); True when the opener was consumed."""
        at = self._buf.find(opener) if opener else -1
        if at >= 0:
            if not hold:
                self._emit_content(self._buf[:at], out, before_call=True)
            self._buf = self._buf[at + len(opener):]
            return True
        if not hold:
            cut = _held_from(self._buf, (opener,) if opener else (), ends)
            self._emit_content(self._buf[:cut], out)
            self._buf = self._buf[cut:]
        return False

    def _all_content(self, out: list[Delta]) -> None:
        """The answer turned out to hold no call: everything is content, sent as written from here."""
        self._mode, self._buf = "raw", ""
        if self.text.startswith(self.content_sent):
            self._send(self.text[len(self.content_sent):], out)
        else:
            self._mode = "hold"  # the stream already left the text's own order: finish sorts it out

    # -- the state machine ------------------------------------------------------------------------------

    def _step(self, out: list[Delta]) -> bool:
        """Consume what can be consumed of the buffer; False when more text is needed."""
        if self._mode in _BETWEEN:
            return self._between(out)
        return {"raw": self._drain, "hold": self._drain, "content": self._content, "tail": self._tail,
                "llama_start": self._llama_start, "object": self._object, "hermes_after": self._hermes_after,
                "hermes_close": self._hermes_close, "v11_name": self._v11_name}[self._mode](out)

    def _drain(self, out: list[Delta]) -> bool:
        """"raw": all is content, sent as written; "hold": finish() sends what is owed."""
        if self._mode == "raw":
            self._send(self._buf, out)
        self._buf = ""
        return False

    def _content(self, out: list[Delta]) -> bool:
        syntax = self.syntax
        if syntax is tool_syntax.HERMES:
            return self._open(self._content_step(out, HERMES_OPEN), "hermes_open")
        if syntax is tool_syntax.MISTRAL_V11:  # text after a call is held: a later broken call voids them all
            return self._open(self._content_step(out, TOOL_CALLS, hold=self._calls_seen > 0), "v11_name")
        return self._open(self._content_step(out, TOOL_CALLS), "mistral_open")

    def _tail(self, out: list[Delta]) -> bool:
        """After the calls, where no other can start (Mistral's one list, Llama's leading calls)."""
        self._content_step(out, None, tool_syntax.LLAMA_ENDS if self.syntax is tool_syntax.LLAMA3_JSON else ())
        return False

    def _open(self, opened: bool, mode: str) -> bool:
        if opened:
            self._mode = mode
            self._calls_seen += 1
        return opened

    def _llama_start(self, out: list[Delta]) -> bool:
        body = self._buf.lstrip()
        if body.startswith(tool_syntax.PYTHON_TAG):
            body = body[len(tool_syntax.PYTHON_TAG):].lstrip()
            if not body:
                return False
        elif tool_syntax.PYTHON_TAG.startswith(body):  # (also when empty)
            return False
        if not body.startswith("{"):
            self._all_content(out)
            return False
        self._buf, self._calls_seen = body, 1
        self._start_object()
        return True

    def _between(self, out: list[Delta]) -> bool:
        """Whitespace, separators and brackets between a marker and a call object, or between calls."""
        body = self._buf.lstrip()
        if not body:
            self._buf = ""
            return False
        mode, ch = self._mode, body[0]
        nxt = {("mistral_open", "["): "mistral_item", ("mistral_sep", ","): "mistral_item",
               ("mistral_sep", "]"): "tail", ("llama_next", ";"): "llama_more"}.get((mode, ch))
        if nxt is not None:
            self._buf, self._mode = body[1:], nxt
            self._in_list = self._in_list or nxt == "mistral_item"
            return True
        if ch == "{" and mode != "mistral_sep":
            self._buf = body
            self._start_object(arguments_only=mode == "v11_open")
            return True
        if mode in ("llama_next", "llama_more"):  # the calls are over: the rest is content
            self._mode = "tail"
            return True
        if mode == "hermes_open":  # not a JSON object: the block is no call
            self._buf = body
            self._hermes_broken()
            return True
        self._all_content(out)  # Mistral: no list of call objects; v11: arguments that are no object
        return False

    def _start_object(self, arguments_only: bool = False) -> None:
        """Read a call object; ``arguments_only``: Mistral v11's, whose name came before it."""
        self._mode, self._obj, self._scan = "object", "", _Scan()
        self._args_depth = 1 if arguments_only else 0
        if not arguments_only:
            self._call = None

    def _object(self, out: list[Delta]) -> bool:
        """A ``{"name": ..., "arguments": {...}}`` call object, one character at a time."""
        fragment, buf = [], self._buf
        for i, ch in enumerate(buf):
            self._obj += ch
            closed = self._scan.step(ch)
            if self._args_depth:
                fragment.append(ch)
                if self._scan.depth < self._args_depth:
                    self._args_depth = 0
                    if self._call is not None:
                        self.sent[self._call].done = True
            elif ch == "{" and self._scan.depth == 2 and self._call is None and not self._scan.in_string:
                self._begin_call(out)
            if self.syntax is tool_syntax.HERMES and ch == ">" and self._obj.endswith(HERMES_CLOSE):
                self._flush_args(fragment, out)  # the block ended inside the object: no call
                self._buf, self._mode = buf[i + 1:], "content"
                self._hermes_broken(closed=True)
                return True
            if closed:
                self._flush_args(fragment, out)
                self._buf = buf[i + 1:]
                self._object_done(out)
                return True
        self._flush_args(fragment, out)
        self._buf = ""
        return False

    def _begin_call(self, out: list[Delta]) -> None:
        match = _HEADER.match(self._obj)
        name = _loads(match.group(1)) if match else None
        if isinstance(name, str) and name:
            self._call = self._new_call(name, out)
            if self._call is not None:
                self._args_depth = 2
                self._flush_args(["{"], out)

    def _new_call(self, name: str, out: list[Delta]) -> int | None:
        """Send a call's head; its index, or None past ``max_calls`` (the call is read, not sent)."""
        if self.max_calls and len(self.sent) >= self.max_calls:
            return None
        self.sent.append(_Sent(name))
        out.append(Delta(index=len(self.sent) - 1, id=self.syntax.new_id(), name=name))
        return len(self.sent) - 1

    def _flush_args(self, fragment: list[str], out: list[Delta]) -> None:
        if self._call is not None and fragment:
            piece = "".join(fragment)
            self.sent[self._call].arguments += piece
            out.append(Delta(index=self._call, arguments=piece))

    def _send_whole(self, name: str, arguments: dict[str, Any], out: list[Delta]) -> None:
        """A call that could not be streamed (its object does not start with name then arguments)."""
        self._call = self._new_call(name, out)
        self._flush_args([json.dumps(arguments, ensure_ascii=False)], out)
        if self._call is not None:
            self.sent[self._call].done = True

    def _object_done(self, out: list[Delta]) -> None:
        """The object closed: check it; a call held back is sent whole once it counts."""
        syntax, obj = self.syntax, _loads(self._obj)
        if syntax is tool_syntax.MISTRAL_V11:  # the arguments object
            self._mode = "content"
            if not isinstance(obj, dict):
                self._all_content(out)
            return
        call = tool_syntax.as_call(obj, ("parameters", "arguments") if syntax is tool_syntax.LLAMA3_JSON else _KEYS)
        self._pending = call if self._call is None else None
        if syntax is tool_syntax.HERMES:
            self._mode = "hermes_after"
            if call is None:
                self._hermes_broken()
        elif call is None:
            self._all_content(out)  # Llama and Mistral: one bad call makes the whole answer content
        else:
            if self._pending:
                self._send_whole(*self._pending, out)
            self._mode = "llama_next" if syntax is tool_syntax.LLAMA3_JSON else (
                "mistral_sep" if self._in_list else "tail")

    def _hermes_after(self, out: list[Delta]) -> bool:
        """After a Hermes call object only whitespace may come before ``</tool_call>``."""
        body = self._buf.lstrip()
        self._buf = body
        if body.startswith(HERMES_CLOSE):
            self._buf, self._mode = body[len(HERMES_CLOSE):], "content"
            self._good_calls += 1
            if self._pending:
                self._send_whole(*self._pending, out)
            return True
        if HERMES_CLOSE.startswith(body):
            return False
        self._hermes_broken()
        return True

    def _hermes_broken(self, closed: bool = False) -> None:
        """A Hermes block with no call in it. After a good call it is just cut from the content; before one,
        whether it is content depends on whether a good call follows: hold the rest to the end."""
        if self._good_calls:
            self._mode = "content" if closed else "hermes_close"
        else:
            self._mode, self._buf = "hold", ""

    def _hermes_close(self, out: list[Delta]) -> bool:
        """Skip to the end of a block with no call in it."""
        at = self._buf.find(HERMES_CLOSE)
        if at >= 0:
            self._buf, self._mode = self._buf[at + len(HERMES_CLOSE):], "content"
            return True
        self._buf = self._buf[len(self._buf) - _partial_suffix(self._buf, (HERMES_CLOSE,)):]
        return False

    def _v11_name(self, out: list[Delta]) -> bool:
        """Mistral v11: ``name`` (``[CALL_ID]id``) up to ``[ARGS]`` or the arguments' brace."""
        head = self._buf
        at_args, at_brace, at_next = head.find(tool_syntax.ARGS), head.find("{"), head.find(TOOL_CALLS)
        if at_args >= 0 and (at_brace < 0 or at_args < at_brace):
            name, rest = head[:at_args], head[at_args + len(tool_syntax.ARGS):]
        elif at_brace >= 0:
            name, rest = head[:at_brace], head[at_brace:]
        else:
            if at_next >= 0:
                self._all_content(out)  # a [TOOL_CALLS] without arguments
            return False
        name = name.partition(tool_syntax.CALL_ID)[0].strip()
        if TOOL_CALLS in name or not tool_syntax.FUNCTION_NAME.fullmatch(name):
            self._all_content(out)
            return False
        self._call = self._new_call(name, out)
        self._buf, self._mode = rest, "v11_open"
        return True


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def merge_deltas(deltas) -> list[Delta]:
    """Adjacent content deltas, and adjacent argument fragments of one call, joined (a call's head stays
    its own delta): fewer chunks, the same sum."""
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and d.content is not None and last.content is not None:
            out[-1] = Delta(content=last.content + d.content)
        elif (last is not None and d.index is not None and d.name is None and last.index == d.index
              and last.name is None):
            out[-1] = Delta(index=d.index, arguments=last.arguments + d.arguments)
        else:
            out.append(d)
    return out
