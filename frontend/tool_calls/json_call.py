"""One call written as a JSON object, read while it streams:

    {"name": "get_weather", "arguments": {"city": "Paris"}}

the body of a Hermes block, a Llama 3 JSON call, an item of Mistral's `[TOOL_CALLS]` list.
The families differ in which key holds the arguments, whether other keys may appear, and
whether a call may leave its arguments out (`CallKeys`). The keys may come in any order;
once the arguments' value has begun, its text goes out as it arrives (the JSON scanner finds
its end and catches bad syntax at its first character).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from frontend.tool_calls.json_scan import COMPLETE, INVALID, JsonScanner
from frontend.tool_calls.stream import CallStream, expect


@dataclass(frozen=True)
class CallKeys:
    arguments: tuple[str, ...]  # the keys that may hold the arguments object (one of them per call)
    others: bool  # may other keys appear (and be ignored)?
    required: bool  # must the arguments be there (else a call without them gets {})?


@dataclass
class JsonCall:
    keys: CallKeys
    stage: str = "open"  # open | key | key_or_close | colon | value | comma | done
    scanner: JsonScanner | None = None  # the key or value being read
    key: str | None = None
    seen: set[str] = field(default_factory=set)
    name: str | None = None
    arguments: str = ""  # the arguments' text so far
    announced: bool = False

    @property
    def done(self) -> bool:
        return self.stage == "done"

    def step(self, stream: CallStream) -> bool:
        """Read on in the stream's buffer; False when it needs more text. Raises Malformed."""
        if self.scanner is not None:
            return self._scan(stream)
        if not stream._skip_ws():
            return False
        c = stream._buffer[0]
        stage = self.stage
        if stage == "open":
            expect(c == "{")
            self.stage = "key_or_close"
            stream._consume(1)
        elif stage in ("key", "key_or_close"):
            if c == "}" and stage == "key_or_close":
                stream._consume(1)
                self._end(stream)
            else:
                expect(c == '"')
                self.scanner = JsonScanner()
        elif stage == "colon":
            expect(c == ":")
            self.stage = "value"
            stream._consume(1)
        elif stage == "value":
            expect(c == "{" or self.key not in self.keys.arguments)
            self.scanner = JsonScanner()
        else:  # comma
            expect(c in ",}")
            stream._consume(1)
            if c == ",":
                self.stage = "key"
            else:
                self._end(stream)
        return True

    def _scan(self, stream: CallStream) -> bool:
        scanner = self.scanner
        taken = scanner.feed(stream._buffer)
        piece = stream._buffer[:taken]
        stream._consume(taken)
        if self.stage == "value" and self.key in self.keys.arguments:
            self.arguments += piece
            stream._send(piece) if self.announced else self._announce(stream)
        expect(scanner.state != INVALID)
        if scanner.state != COMPLETE:
            return False
        self.scanner = None
        # Only strings are decoded (keys, the name): the scanner checked the rest, and a value
        # nested deep enough would overflow json.loads's recursion.
        if self.stage in ("key", "key_or_close"):
            key = json.loads(scanner.text)
            known = key == "name" or key in self.keys.arguments
            expect(key not in self.seen and (known or self.keys.others))
            # One object of arguments per call: a second would mix into the first's text.
            expect(key not in self.keys.arguments or not self.seen.intersection(self.keys.arguments))
            self.key, self.stage = key, "colon"
            self.seen.add(key)
            return True
        if self.key == "name":
            expect(scanner.text.startswith('"') and scanner.text != '""')
            self.name = json.loads(scanner.text)
            self._announce(stream)
        self.stage = "comma"
        return True

    def _end(self, stream: CallStream) -> None:
        expect(self.name is not None)
        if not self.seen.intersection(self.keys.arguments):
            expect(not self.keys.required)
            self.arguments = "{}"  # a call without arguments
        self._announce(stream)
        self.stage = "done"
        stream._call_done()

    def _announce(self, stream: CallStream) -> None:
        """Announce the call once both its name and the start of its arguments are known."""
        if self.announced or self.name is None or not self.arguments:
            return
        self.announced = True
        stream._announce(self.name)
        stream._send(self.arguments)
