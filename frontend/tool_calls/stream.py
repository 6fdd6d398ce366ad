"""What every tool-call parser shares: the text around the calls, and each call's life.

A sample's answer is text with blocks of calls in it. A family's parser says where a block may
begin (`STARTS`: `<tool_call>`, `[TOOL_CALLS]`, `{`, ...) and reads a block (`_step_block`);
`CallStream` does the rest, alike for every family:

- Text outside blocks is Content, sent as soon as it cannot begin a block: held back is only a
  tail that may be the start of a marker, and whitespace just before one. Whitespace before a
  block, and at the very start or end, belongs to the block; whitespace between a block and
  the text after it stays, as the separator of the text around the block.
- A call is announced (CallStart) once the reader knows its name and its arguments have begun,
  then its arguments go out in pieces (CallArguments) that concatenate to a JSON object.
- A block that turns out not to be calls is Content again, as written, and the text after its
  first bad character is read afresh (a block may begin in it). Calls a block completed
  before that stay calls. A stream cannot take back a call it has sent part of: if that call
  turns malformed, it keeps what was sent (`_close_arguments` may end its JSON) and the text
  from the bad character on is Content.
- At the end of the text, a block's unfinished call is Content, unless a stream sent part of
  it already; wrapper syntax cut off after a whole call (a missing closing tag) is forgiven.

`parse(text)` reads a whole text: as a stream that got it in one piece, so a malformed or
cut-off call is always Content (nothing was sent that could not be taken back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.output_events import CallArguments, CallStart, Content, Event

WS = " \t\n\r"


class Malformed(Exception):
    """The block is not (or is no longer) calls: it goes back to being text."""


@dataclass
class Block:
    """The block being read. Each family adds its own reading state."""

    raw: str = ""  # its text since its last whole call: what becomes Content if it is no call
    events: list[Event] = field(default_factory=list)  # the current call's, not handed out yet
    index: int | None = None  # the current call's, once announced
    committed: bool = False  # some of the current call's events were handed out
    closable: bool = False  # the block may end here: it just read a whole call


class CallStream:
    """One sample's text in (`feed`, then `finish`), events out. Not thread-safe; one per sample."""

    STARTS: tuple[str, ...] = ()  # the markers a block begins with

    def __init__(self, tools: tuple = ()) -> None:
        """`tools`: the request's (frontend.tool_calls.tools.Tool), for the families that read
        them (qwen3_coder types its parameters by their schemas)."""
        self._buffer = ""  # text not looked at yet, or held back
        self._block: Block | None = None
        self._after_block = False  # just after a block, before any text but whitespace
        self._has_content = False  # some Content was sent
        self._num_calls = 0
        self._out: list[Event] = []

    @classmethod
    def parse(cls, text: str, tools: tuple = ()) -> list[Event]:
        """The events of a whole text."""
        parser = cls(tools)
        parser._buffer = text
        parser._run()
        return parser.finish()

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[Event]:
        """The events that the next piece of text makes certain."""
        self._buffer += text
        self._run()
        if self._block is not None and self._block.index is not None:
            self._commit()  # a stream sends what it knows of the call now
        return self._take_events()

    def finish(self) -> list[Event]:
        """The text has ended: what was held back goes out."""
        while self._block is not None:
            block = self._block
            if block.committed:  # cut off after a stream sent part of it: it keeps what it has
                self._keep_sent()
                self._buffer = ""
            elif block.closable:  # after a whole call: only closing syntax is missing
                self._block, self._buffer = None, ""
            else:
                self._to_text()
                self._run()
        self._content(self._buffer.lstrip(WS) if self._after_block else self._buffer)
        self._buffer = ""
        return self._take_events()

    # -- for each family ---------------------------------------------------------------------

    def _open(self, marker: str) -> Block:
        """A new block, begun by `marker` (one of STARTS; already read)."""
        raise NotImplementedError

    def _step_block(self, block: Block) -> bool:
        """Read on in the buffer (`_consume`); False when it needs more text. Raises Malformed."""
        raise NotImplementedError

    def _close_arguments(self, block: Block) -> str:
        """The text that ends a call's arguments when a stream sent part of them and the call
        went no further; "" where it cannot be known."""
        return ""

    # -- the family's reader moves on with these ---------------------------------------------

    def _consume(self, n: int) -> None:
        self._block.raw += self._buffer[:n]
        self._buffer = self._buffer[n:]

    def _skip_ws(self) -> bool:
        """Read past whitespace; is there more text after it?"""
        stripped = self._buffer.lstrip(WS)
        self._consume(len(self._buffer) - len(stripped))
        return bool(stripped)

    def _literal(self, options: tuple[str, ...]) -> str | None:
        """The option the buffer begins with (read past it); None while the buffer may still
        become one. Anything else is Malformed."""
        matched = leading(self._buffer, options)
        if matched is not None:
            self._consume(len(matched))
            return matched
        expect(may_begin(self._buffer, options))
        return None

    def _announce(self, name: str) -> None:
        block = self._block
        block.index = self._num_calls
        self._num_calls += 1
        block.events.append(CallStart(block.index, name))

    def _send(self, text: str) -> None:
        """The next piece of the current call's arguments."""
        if text:
            self._block.events.append(CallArguments(self._block.index, text))

    def _call_done(self) -> None:
        """The current call is whole: it goes out, and stays whatever follows."""
        self._commit()
        block = self._block
        block.index, block.committed, block.raw, block.closable = None, False, "", True

    def _end_block(self) -> None:
        self._block, self._after_block = None, True

    # -- the machinery -----------------------------------------------------------------------

    def _run(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """Move on through the buffer; False when it needs more text."""
        if self._block is None:
            return self._step_content()
        try:
            return self._step_block(self._block)
        except Malformed:
            self._to_text()
            return True

    def _step_content(self) -> bool:
        buf = self._buffer
        if self._after_block and not self._has_content:
            buf = buf.lstrip(WS)  # no text before the block: whitespace after it separates nothing
            if not buf:
                self._buffer = ""
                return False
        at, marker = first_marker(buf, self.STARTS)
        if marker is not None:
            before = buf[:at].rstrip(WS)
            self._content(before)
            self._after_block = False
            self._block = self._open(marker)
            self._block.raw = buf[len(before):at + len(marker)]
            self._buffer = buf[at + len(marker):]
            return True
        kept = len(buf) - partial_marker_len(buf, self.STARTS)
        kept = len(buf[:kept].rstrip(WS))  # and the whitespace before it: a block may follow
        self._content(buf[:kept])
        self._buffer = buf[kept:]
        self._after_block = self._after_block and not kept  # whitespace alone after a block may end the text
        return False

    def _content(self, text: str) -> None:
        if text:
            self._out.append(Content(text))
            self._has_content = True

    def _commit(self) -> None:
        block = self._block
        self._out += block.events
        block.events, block.committed = [], True

    def _to_text(self) -> None:
        """The block is no call. The current call not sent yet: the block's text since its
        last whole call is text again. Sent in part: the call keeps what was sent. Either way
        the rest of the buffer is read as text again: a block may follow."""
        if self._block.committed:
            self._keep_sent()
            return
        block, self._block = self._block, None
        if block.index is not None:
            self._num_calls -= 1
        self._content(block.raw)

    def _keep_sent(self) -> None:
        """The current call, sent in part, goes no further: it ends with what it has."""
        self._send(self._close_arguments(self._block))
        self._commit()
        self._block = None

    def _take_events(self) -> list[Event]:
        events, self._out = self._out, []
        return events


def expect(ok: bool) -> None:
    if not ok:
        raise Malformed


def leading(text: str, options: tuple[str, ...]) -> str | None:
    """The option `text` begins with, if any."""
    return next((o for o in options if text.startswith(o)), None)


def may_begin(text: str, options: tuple[str, ...]) -> bool:
    """May `text` still grow into one of the options?"""
    return any(o.startswith(text) for o in options)


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """(where, which) of the earliest marker in `text`; (-1, None) if none is there."""
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else (-1, None)


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins a marker (it may yet become one)."""
    longest = max((len(m) for m in markers), default=1)
    for n in range(min(longest - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0
