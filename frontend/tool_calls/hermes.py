"""Hermes-style tool calls found in generated text while it streams:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format of Hermes 2 Pro, Qwen2.5/3 and many models trained after them, and the one our
grammar forces for tool_choice "required" or a named tool. `HermesParser.feed` takes each
new piece of text and returns events, in order:

    Content(text)              text outside the calls
    CallStart(index, name)     a call whose name is known and whose arguments have begun
    CallArguments(index, text) the next piece of that call's arguments (JSON text; a call's
                               pieces concatenate to its whole arguments object)

Argument text goes out as it arrives: once the `"arguments":` value has begun, everything
up to its end belongs to it (the JSON scanner finds the end and catches bad syntax at its
first character). Held back is only what may still turn out to be the wrapper: the tail of a
possible `<tool_call>` tag, whitespace around a block, a call whose name is not known yet.
Whitespace before a block, and at the very start or end, belongs to the blocks; whitespace
between a block and the text after it stays, as the separator of the text around the block.

A block that is not a well-formed call stays text (Content, tags and all). A stream cannot
take back a call it already announced: if its arguments turn malformed later, the call keeps
the arguments sent so far and the rest of the text is Content. Read whole (`parse`, for the
non-streamed response), a malformed or cut-off block is always Content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from frontend.output_events import CallArguments, CallStart, Content, Event
from frontend.tool_calls.json_scan import COMPLETE, INVALID, JsonScanner

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_WS = " \t\n\r"
_ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes says arguments; Llama 3 style says parameters


class _Malformed(Exception):
    """The current block is not a call: it goes back to being text."""


@dataclass
class _Call:
    """The block being read: `{"name": ..., "arguments": {...}}` after an OPEN tag."""

    raw: str  # the block's text so far, OPEN included: what becomes Content if it is no call
    stage: str = "open"  # open | key | key_or_close | colon | value | comma | close
    scanner: JsonScanner | None = None  # the key or value being read
    key: str | None = None
    keys: set[str] = field(default_factory=set)
    name: str | None = None
    arguments: str = ""  # the arguments' text so far
    index: int | None = None  # set when announced (CallStart sent)
    events: list[Event] = field(default_factory=list)  # not yet handed out: may still be taken back
    committed: bool = False  # some of its events were handed out: it can no longer become text


class HermesParser:
    """One sample's text in, events out. Not thread-safe; one per sample."""

    def __init__(self) -> None:
        self._buffer = ""  # text not looked at yet, or held back
        self._call: _Call | None = None
        self._after_call = False  # just after a block, before any text
        self._has_content = False  # some Content was sent
        self._num_calls = 0
        self._out: list[Event] = []

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[Event]:
        """The events that the next piece of text makes certain."""
        self._buffer += text
        self._run()
        if self._call is not None and self._call.index is not None:
            self._commit()  # a stream sends what it knows of the call now
        return self._take_events()

    def finish(self) -> list[Event]:
        """The text has ended: what was held back goes out."""
        while self._call is not None:
            call = self._call
            if call.stage == "close" or call.committed:
                # A whole call whose closing tag never came (eos, a stop string), or one cut
                # off mid-arguments after the stream had announced it: it keeps what it has.
                self._commit()
                self._call, self._buffer = None, ""
            else:
                self._to_text()
                self._run()
        self._content(self._buffer.lstrip(_WS) if self._after_call else self._buffer)
        self._buffer = ""
        return self._take_events()

    def _run(self) -> None:
        while self._step():
            pass

    def _take_events(self) -> list[Event]:
        events, self._out = self._out, []
        return events

    def _step(self) -> bool:
        """Move on through the buffer; False when it needs more text."""
        if self._call is None:
            return self._step_content()
        try:
            return self._step_call(self._call)
        except _Malformed:
            self._to_text()
            return True

    # -- outside a call ----------------------------------------------------------------------

    def _step_content(self) -> bool:
        buf = self._buffer
        if self._after_call and not self._has_content:
            buf = buf.lstrip(_WS)  # no text before the block: whitespace after it separates nothing
            if not buf:
                self._buffer = ""
                return False
        self._after_call = False
        at = buf.find(OPEN)
        if at >= 0:
            self._content(buf[:at].rstrip(_WS))
            self._call = _Call(raw=buf[:at][len(buf[:at].rstrip(_WS)):] + OPEN)
            self._buffer = buf[at + len(OPEN):]
            return True
        keep = _tag_prefix_len(buf)
        kept = len(buf) - keep
        kept = len(buf[:kept].rstrip(_WS))  # and the whitespace before it: a block may follow
        self._content(buf[:kept])
        self._buffer = buf[kept:]
        return False

    def _content(self, text: str) -> None:
        if text:
            self._out.append(Content(text))
            self._has_content = True

    # -- inside a call -----------------------------------------------------------------------

    def _step_call(self, call: _Call) -> bool:
        if call.scanner is not None:
            return self._scan(call)
        if call.stage == "close":
            return self._step_close(call)
        stripped = self._buffer.lstrip(_WS)
        self._consume(call, len(self._buffer) - len(stripped))
        if not stripped:
            return False
        c = stripped[0]
        stage = call.stage
        if stage == "open":
            self._expect(c == "{")
            call.stage = "key_or_close"
            self._consume(call, 1)
        elif stage in ("key", "key_or_close"):
            if c == "}" and stage == "key_or_close":
                self._consume(call, 1)
                self._end_object(call)
            else:
                self._expect(c == '"')
                call.scanner = JsonScanner()
        elif stage == "colon":
            self._expect(c == ":")
            call.stage = "value"
            self._consume(call, 1)
        elif stage == "value":
            self._expect(c == "{" or call.key not in _ARGUMENT_KEYS)
            call.scanner = JsonScanner()
        else:  # comma
            self._expect(c in ",}")
            self._consume(call, 1)
            if c == ",":
                call.stage = "key"
            else:
                self._end_object(call)
        return True

    def _scan(self, call: _Call) -> bool:
        scanner = call.scanner
        taken = scanner.feed(self._buffer)
        piece = self._buffer[:taken]
        self._consume(call, taken)
        if call.stage == "value" and call.key in _ARGUMENT_KEYS:
            call.arguments += piece
            self._announce(call) if call.index is None else self._send_arguments(call, piece)
        self._expect(scanner.state != INVALID)
        if scanner.state != COMPLETE:
            return False
        call.scanner = None
        value = json.loads(scanner.text)
        if call.stage in ("key", "key_or_close"):
            self._expect(value not in call.keys)
            call.key, call.stage = value, "colon"
            call.keys.add(value)
            return True
        if call.key == "name":
            self._expect(isinstance(value, str) and bool(value))
            call.name = value
            self._announce(call)
        elif call.key in _ARGUMENT_KEYS:
            self._expect(isinstance(value, dict) and not call.keys.issuperset(_ARGUMENT_KEYS))
        call.stage = "comma"
        return True

    def _end_object(self, call: _Call) -> None:
        self._expect(call.name is not None)
        if not call.keys.intersection(_ARGUMENT_KEYS):
            call.arguments = "{}"  # a call without arguments
        self._announce(call)
        call.stage = "close"
        self._commit()

    def _step_close(self, call: _Call) -> bool:
        """After the object: whitespace and the closing tag, or else the call ends here."""
        stripped = self._buffer.lstrip(_WS)
        if stripped.startswith(CLOSE):
            self._buffer = stripped[len(CLOSE):]
        elif CLOSE.startswith(stripped):
            return False  # it may still come
        self._call, self._after_call = None, True
        return True

    def _announce(self, call: _Call) -> None:
        """Send the call's start once both its name and the start of its arguments are known."""
        if call.index is not None or call.name is None or not call.arguments:
            return
        call.index = self._num_calls
        self._num_calls += 1
        call.events.append(CallStart(call.index, call.name))
        self._send_arguments(call, call.arguments)

    def _send_arguments(self, call: _Call, text: str) -> None:
        if text and call.index is not None:
            call.events.append(CallArguments(call.index, text))

    def _commit(self) -> None:
        call = self._call
        self._out += call.events
        call.events, call.committed = [], True

    def _consume(self, call: _Call, n: int) -> None:
        call.raw += self._buffer[:n]
        self._buffer = self._buffer[n:]

    def _to_text(self) -> None:
        """The block is no call. Not yet announced: all of it is text again. Announced: the
        call keeps what was sent; the text from the bad character on is Content."""
        call, self._call = self._call, None
        if call.committed:
            self._out += call.events  # the arguments' last good piece
            return
        if call.index is not None:
            self._num_calls -= 1
        self._content(call.raw)  # the rest of the buffer is read as text again: a block may follow

    @staticmethod
    def _expect(ok: bool) -> None:
        if not ok:
            raise _Malformed


def _tag_prefix_len(text: str) -> int:
    """The length of the longest end of `text` that begins OPEN (it may yet become one)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def tags_are_special(tokenizer) -> bool:
    """Does the tokenizer hold <tool_call> as a special token (Hermes 2 Pro's does)? Then the
    output must keep special tokens, or the parser never sees the tags."""
    backend = getattr(tokenizer, "backend", None)  # frontend.tokenizer.Tokenizer's tokenizers.Tokenizer
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return False
    return any(t.special and t.content in (OPEN, CLOSE) for t in backend.get_added_tokens_decoder().values())


def parse(text: str) -> list[Event]:
    """The events of a whole text: as a stream's, except that a block cut off or malformed
    anywhere is Content (nothing was sent that could not be taken back)."""
    parser = HermesParser()
    parser._buffer = text
    parser._run()
    return parser.finish()
