"""Mistral tool calls, after the `[TOOL_CALLS]` token. Tokenizers up to v7 (Mistral 7B
Instruct v0.3, Mixtral 8x22B, Mistral Nemo, Mistral Large 2407) write one JSON list:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]

(an item may carry an `"id"` too: ignored, the API makes its own). v11 and later (Mistral
Small 3.1+, Magistral, Devstral) write each call after its own token, the name bare and the
arguments after `[ARGS]`, with the call's id after `[CALL_ID]` in some:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}

A name followed straight by `{` is read too: that is the text when a decoder dropped the
`[ARGS]` token. Arguments stream as they arrive, as in the other JSON formats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from frontend.tool_calls.json_call import CallKeys, JsonCall
from frontend.tool_calls.json_scan import COMPLETE, INVALID, JsonScanner
from frontend.tool_calls.stream import Block, CallStream, expect

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_KEYS = CallKeys(arguments=("arguments",), others=True, required=True)
_NAME = re.compile(r"[A-Za-z0-9_-]*")
_CALL_ID = re.compile(r"[A-Za-z0-9]*")


@dataclass
class _Block(Block):
    stage: str = "start"  # start | list (up to v7) | name | call_id | arguments (v11 on)
    call: JsonCall | None = None  # the list's item being read
    name: str = ""
    scanner: JsonScanner | None = None  # v11's arguments


class MistralParser(CallStream):
    STARTS = (TOOL_CALLS,)

    def _open(self, marker: str) -> Block:
        return _Block()

    def _step_block(self, block: _Block) -> bool:
        if block.call is not None and not block.call.done:
            return block.call.step(self)
        if block.stage == "start":
            if not self._skip_ws():
                return False
            if self._buffer[0] == "[":
                self._consume(1)
                block.stage, block.call = "list", JsonCall(_KEYS)
            else:
                block.stage = "name"
            return True
        if block.stage == "list":
            return self._step_list(block)
        if block.stage == "name":
            return self._step_name(block)
        if block.stage == "call_id":
            return self._step_call_id(block)
        return self._step_arguments(block)

    def _step_list(self, block: _Block) -> bool:
        """After an item: `,` and the next one, or `]`."""
        if not self._skip_ws():
            return False
        c = self._buffer[0]
        expect(c in ",]")
        self._consume(1)
        if c == ",":
            block.call, block.closable = JsonCall(_KEYS), False
        else:
            self._end_block()
        return True

    def _step_name(self, block: _Block) -> bool:
        n = _NAME.match(self._buffer).end()
        block.name += self._buffer[:n]
        self._consume(n)
        if not self._buffer:
            return False
        expect(bool(block.name))
        if self._buffer[0] == "{":
            block.stage = "arguments"
            return True
        after = self._literal((ARGS, CALL_ID))
        if after is not None:
            block.stage = "call_id" if after == CALL_ID else "arguments"
        return after is not None

    def _step_call_id(self, block: _Block) -> bool:
        """The model's id for the call, up to `[ARGS]`: the API gives calls ids of its own."""
        self._consume(_CALL_ID.match(self._buffer).end())
        if not self._buffer or self._literal((ARGS,)) is None:
            return False
        block.stage = "arguments"
        return True

    def _step_arguments(self, block: _Block) -> bool:
        if block.scanner is None:
            if not self._skip_ws():
                return False
            expect(self._buffer[0] == "{")
            block.scanner = JsonScanner()
            self._announce(block.name)
        scanner = block.scanner
        taken = scanner.feed(self._buffer)
        self._send(self._buffer[:taken])
        self._consume(taken)
        expect(scanner.state != INVALID)
        if scanner.state != COMPLETE:
            return False
        self._call_done()
        self._end_block()
        return True
