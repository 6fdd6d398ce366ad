"""An incremental JSON syntax check of one value: feed text as it arrives, and it says whether
everything so far still begins a valid JSON value, and where that value ends once complete.

The tool-call parsers of the JSON formats stream a call's arguments through it: each piece
goes out as soon as it is known to belong to the value, and a value that turns malformed is
caught at its first bad character. (`json.JSONDecoder.raw_decode` only says "not a whole value
yet", never whether more text could still make it one.)

A value json.loads could not read back is invalid too: one nested deeper than MAX_DEPTH
(frontend/tool_calls/arguments.py), or a number longer than Python's int() reads.
"""

from __future__ import annotations

import re
import sys

from frontend.tool_calls.arguments import MAX_DEPTH

INCOMPLETE, COMPLETE, INVALID = "incomplete", "complete", "invalid"
_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")
_CLOSING = {"{": "}", "[": "]"}
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class JsonScanner:
    """State of one JSON value read so far. `state` is INCOMPLETE, COMPLETE or INVALID;
    `text` is what it consumed (on COMPLETE: exactly the value). A number at the top level is
    complete only when the character after it arrives; that character is not consumed."""

    def __init__(self) -> None:
        self.state = INCOMPLETE
        self.text = ""
        self._stack: list[str] = []  # the open "{" and "["
        self._expect = "value"  # value | value_or_close | key | key_or_close | colon | comma
        self._mode = ""  # "" (between tokens) | string | number | literal
        self._token = ""  # the number so far, or the literal's letters still to come
        self._escape = -1  # in a string: -1 none, 0 after a backslash, 1-4 hex digits left
        self._in_key = False

    def feed(self, text: str) -> int:
        """Consume what belongs to the value; returns how many characters of `text` did."""
        i = 0
        while i < len(text) and self.state == INCOMPLETE:
            if self._take(text[i]) and self.state != INVALID:  # a bad character is not taken
                i += 1
        self.text += text[:i]
        return i

    def _take(self, c: str) -> bool:
        """Look at one character; False when it ends a number and must be looked at again."""
        if self._mode == "string":
            self._string_char(c)
        elif self._mode == "number":
            if c not in _NUMBER_CHARS:  # the number ends here: whole, or "-" and "1e" were all
                self._mode = ""
                self._value_done() if _NUMBER.match(self._token) else self._invalid()
                return False
            self._token += c
            if not (_NUMBER.match(self._token) or _NUMBER.match(self._token + "0")):
                self.state = INVALID  # e.g. "01", "1.e", "--"
            elif 0 < sys.get_int_max_str_digits() < len(self._token):  # 0: no limit
                self.state = INVALID
        elif self._mode == "literal":
            if c != self._token[0]:
                self.state = INVALID
            self._token = self._token[1:]
            if not self._token:
                self._mode = ""
                self._value_done()
        elif c not in _WS:
            self._structure(c)
        return True

    def _structure(self, c: str) -> None:
        expect = self._expect
        if expect in ("value", "value_or_close"):
            if c == "]" and expect == "value_or_close":
                self._close()
            else:
                self._start_value(c)
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                self._close()
            elif c == '"':
                self._mode, self._in_key = "string", True
            else:
                self.state = INVALID
        elif expect == "colon":
            self._expect = "value" if c == ":" else self._invalid()
        elif c == ",":  # expect == "comma"
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif c == _CLOSING[self._stack[-1]]:
            self._close()
        else:
            self.state = INVALID

    def _start_value(self, c: str) -> None:
        if c in _CLOSING:
            if len(self._stack) == MAX_DEPTH:
                return self._invalid()
            self._stack.append(c)
            self._expect = "key_or_close" if c == "{" else "value_or_close"
        elif c == '"':
            self._mode = "string"
        elif c == "-" or c.isdigit() and c.isascii():
            self._mode, self._token = "number", c
        elif c in _LITERALS:
            self._mode, self._token = "literal", _LITERALS[c]
        else:
            self.state = INVALID

    def _string_char(self, c: str) -> None:
        if self._escape > 0:  # \uXXXX
            self._escape = self._escape - 1 if c in _HEX else self._invalid(-1)
            if self._escape == 0:
                self._escape = -1
        elif self._escape == 0:
            self._escape = 4 if c == "u" else -1 if c in '"\\/bfnrt' else self._invalid(-1)
        elif c == "\\":
            self._escape = 0
        elif c == '"':
            self._mode = ""
            if self._in_key:
                self._in_key, self._expect = False, "colon"
            else:
                self._value_done()
        elif ord(c) < 0x20:  # JSON strings hold no raw control characters
            self.state = INVALID

    def _close(self) -> None:
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if self._stack:
            self._expect = "comma"
        else:
            self.state = COMPLETE

    def _invalid(self, result=None):
        self.state = INVALID
        return result
