"""Tool calls while they are being written: an incremental parser fed a streamed answer's text deltas.

OpenAI streams a tool call as ``delta.tool_calls[i]``: first ``index``, ``id``, ``type`` and the function's
``name`` (``arguments: ""``), then fragments of ``function.arguments``, and the finish chunk says
``"tool_calls"``. :class:`ToolStream` turns the text deltas of an answer written in one
:mod:`.tool_syntax` into such :class:`Delta` records as early as it can be sure of them:

* Content goes out at once, except a suffix that could still become the syntax's opening marker
  (``<tool_call>``, ``[TOOL_CALLS]``; for Llama the answer's first ``{`` or ``<|python_tag|>``), trailing
  whitespace (the finished answer's content is stripped when it holds calls) and, after Llama calls, the
  ``<|eom_id|>`` / ``<|eot_id|>`` end markers. A marker split across tokens is never sent as content.
* A call's name goes out once it is complete (``{"name": "f", "arguments": {`` seen, or Mistral v11's
  ``f[ARGS]``), then the arguments object's raw JSON text as it arrives. A call whose object does not start
  that way (other key order, arguments not an object) is held and sent whole once it is complete.
* Mistral v11 text after a call is held to the end (a later broken call would make the whole answer content).

The final word stays with the syntax's own parser (``ToolSyntax.parse``, which the non-streamed answer
uses too): :meth:`ToolStream.finish` parses the whole text with it and sends what is still missing (the
rest of the content, calls not yet sent). For a well-formed answer the stream then adds up to exactly the
non-streamed message (arguments equal as JSON). Where that parser rejects a call whose fragments already
went out (cut by ``max_tokens``, bad JSON, a later broken call in an all-or-nothing syntax), nothing can be
taken back: the content is completed to the non-streamed content where the stream has sent a prefix of it,
the sent fragments stay, and the finish reason is the non-streamed one (``"length"``/``"stop"`` when no
call parsed: the client must not run the partial call, as with OpenAI's own cut streams).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from quantkit.runtime import tool_syntax
from quantkit.runtime.tool_syntax import ARGS, CALL_ID, HERMES_CLOSE, HERMES_OPEN, PYTHON_TAG, TOOL_CALLS, ToolSyntax

_LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")
_ARG_KEYS = ("arguments", "parameters")
# The head of a {"name": ..., "arguments": {...}} object up to the arguments' opening brace.
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{\Z')
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


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

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

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
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


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
            out.append(Delta(content=piece))
            self.content_sent += piece
            self._held_ws = ""
        self._held_ws += tail

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
            rest = self.text[len(self.content_sent):]
            if rest:
                out.append(Delta(content=rest))
                self.content_sent += rest
        else:
            self._mode = "hold"  # the stream already left the text's own order: finish sorts it out

    # -- the state machine ------------------------------------------------------------------------------

    def _step(self, out: list[Delta]) -> bool:
        """Consume what can be consumed of the buffer; False when more text is needed."""
        mode, syntax = self._mode, self.syntax
        if mode == "raw":
            out.append(Delta(content=self._buf))
            self.content_sent += self._buf
            self._buf = ""
            return False
        if mode == "hold":
            self._buf = ""
            return False
        if mode == "content":
            if syntax is tool_syntax.HERMES:
                return self._open(self._content_step(out, HERMES_OPEN), "hermes_open")
            if syntax is tool_syntax.MISTRAL_V11:
                return self._open(self._content_step(out, TOOL_CALLS, hold=self._calls_seen > 0), "v11_name")
            if syntax is tool_syntax.MISTRAL:
                return self._open(self._content_step(out, TOOL_CALLS), "mistral_open")
        if mode == "tail":  # after the calls no other can start (Mistral's one list, Llama's leading calls)
            self._content_step(out, None, _LLAMA_ENDS if syntax is tool_syntax.LLAMA3_JSON else ())
            return False
        if mode == "llama_start":
            return self._llama_start(out)
        if mode in ("hermes_open", "mistral_open", "mistral_item", "mistral_sep", "llama_next", "llama_more"):
            return self._between(out)
        if mode == "hermes_after":
            return self._hermes_after(out)
        if mode == "object":
            return self._object(out)
        if mode == "v11_name":
            return self._v11_name(out)
        if mode == "v11_args":
            return self._v11_args(out)
        if mode == "hermes_close":
            return self._hermes_close(out)
        raise AssertionError(mode)

    def _open(self, opened: bool, mode: str) -> bool:
        if opened:
            self._mode = mode
            self._calls_seen += 1
        return opened

    def _llama_start(self, out: list[Delta]) -> bool:
        body = self._buf.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
            if not body:
                return False
        elif not body or (PYTHON_TAG.startswith(body)):
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
            self._start_object()
            return True
        if mode in ("llama_next", "llama_more"):  # the calls are over: the rest is content
            self._mode = "tail"
            return True
        if mode == "hermes_open":  # not a JSON object: the block is no call
            self._buf = body
            self._hermes_broken(out)
            return True
        self._all_content(out)  # Mistral: not a list of call objects
        return False

    def _start_object(self) -> None:
        self._mode, self._obj, self._scan, self._args_depth = "object", "", _Scan(), 0
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
                    self.sent[self._call].done = True
            elif ch == "{" and self._scan.depth == 2 and self._call is None and not self._scan.in_string:
                self._begin_call(out)
            if self.syntax is tool_syntax.HERMES and ch == ">" and self._obj.endswith(HERMES_CLOSE):
                self._flush_args(fragment, out)  # the block ended inside the object: no call
                self._buf, self._mode = buf[i + 1:], "content"
                self._hermes_broken(out, closed=True)
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
        if isinstance(name, str) and name and self._room():
            self._call, self._args_depth = len(self.sent), 2
            self.sent.append(_Sent(name))
            out.append(Delta(index=self._call, id=self.syntax.new_id(), name=name))
            self._flush_args(["{"], out)

    def _room(self) -> bool:
        return not self.max_calls or len(self.sent) < self.max_calls

    def _flush_args(self, fragment: list[str], out: list[Delta]) -> None:
        if self._call is not None and fragment:
            piece = "".join(fragment)
            self.sent[self._call].arguments += piece
            out.append(Delta(index=self._call, arguments=piece))

    def _send_whole(self, name: str, arguments: dict[str, Any], out: list[Delta]) -> None:
        """A call that could not be streamed (its object does not start with name then arguments)."""
        if self._room():
            index, text = len(self.sent), json.dumps(arguments, ensure_ascii=False)
            self.sent.append(_Sent(name, text, done=True))
            out += [Delta(index=index, id=self.syntax.new_id(), name=name), Delta(index=index, arguments=text)]

    def _object_done(self, out: list[Delta]) -> None:
        """The object closed: check it; a call held back is sent whole once it counts."""
        obj = _loads(self._obj)
        arguments = next((obj[k] for k in _ARG_KEYS if k in obj), {}) if isinstance(obj, dict) else None
        valid = isinstance(arguments, dict) and isinstance(obj.get("name"), str) and bool(obj["name"])
        self._pending = (obj["name"], arguments) if valid and self._call is None else None
        if self.syntax is tool_syntax.HERMES:
            self._mode = "hermes_after" if valid else "hermes_close"
            if not valid:
                self._hermes_broken(out)
            return
        if not valid:
            self._all_content(out)  # Llama and Mistral: one bad call makes the whole answer content
            return
        if self._pending:
            self._send_whole(*self._pending, out)
        self._mode = "llama_next" if self.syntax is tool_syntax.LLAMA3_JSON else (
            "mistral_sep" if self._in_list else "tail")

    def _hermes_after(self, out: list[Delta]) -> bool:
        """After a Hermes call object only whitespace may come before ``</tool_call>``."""
        body = self._buf.lstrip()
        if body.startswith(HERMES_CLOSE):
            self._buf, self._mode = body[len(HERMES_CLOSE):], "content"
            self._good_calls += 1
            if self._pending:
                self._send_whole(*self._pending, out)
            return True
        self._buf = body
        if HERMES_CLOSE.startswith(body):
            return False
        self._mode = "hermes_close"
        self._hermes_broken(out)
        return True

    def _hermes_broken(self, out: list[Delta], closed: bool = False) -> None:
        """A Hermes block that is no call. With a good call before it, it is just cut from the content; else
        whether it is content depends on whether a good call follows: hold the rest of the answer to the end."""
        if self._good_calls:
            self._mode = "content" if closed else "hermes_close"
        else:
            self._mode, self._buf = "hold", ""

    def _hermes_close(self, out: list[Delta]) -> bool:
        at = self._buf.find(HERMES_CLOSE)
        if at < 0:
            keep = _partial_suffix(self._buf, (HERMES_CLOSE,))
            self._buf = self._buf[len(self._buf) - keep:] if keep else ""
            return False
        self._buf, self._mode = self._buf[at + len(HERMES_CLOSE):], "content"
        return True

    def _v11_name(self, out: list[Delta]) -> bool:
        """Mistral v11: ``name`` (``[CALL_ID]id``) up to ``[ARGS]`` or the arguments' brace."""
        head = self._buf
        at_args, at_brace, at_next = head.find(ARGS), head.find("{"), head.find(TOOL_CALLS)
        if at_args >= 0 and (at_brace < 0 or at_args < at_brace):
            name, rest = head[:at_args], head[at_args + len(ARGS):]
        elif at_brace >= 0:
            name, rest = head[:at_brace], head[at_brace:]
        else:
            if at_next >= 0:
                self._all_content(out)  # a [TOOL_CALLS] without arguments
            return False
        name = name.partition(CALL_ID)[0].strip()
        if TOOL_CALLS in name or not _NAME.fullmatch(name):
            self._all_content(out)
            return False
        self._call = None
        if self._room():
            self._call = len(self.sent)
            self.sent.append(_Sent(name))
            out.append(Delta(index=self._call, id=self.syntax.new_id(), name=name))
        self._buf, self._mode, self._scan, self._obj = rest, "v11_args", _Scan(), ""
        return True

    def _v11_args(self, out: list[Delta]) -> bool:
        if not self._scan.depth:
            body = self._buf.lstrip()
            if not body:
                self._buf = ""
                return False
            if body[0] != "{":
                self._all_content(out)
                return False
            self._buf = body
        fragment, buf = [], self._buf
        for i, ch in enumerate(buf):
            fragment.append(ch)
            self._obj += ch
            if self._scan.step(ch):
                self._flush_args(fragment, out)
                self._buf, self._mode = buf[i + 1:], "content"
                if not isinstance(_loads(self._obj), dict):
                    self._all_content(out)
                    return False
                if self._call is not None:
                    self.sent[self._call].done = True
                return True
        self._flush_args(fragment, out)
        self._buf = ""
        return False


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
