"""Llama 3.1/3.2/3.3 tool calls (and Llama 4's with a JSON template):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

as Meta's templates ask for them ('Respond in the format {"name": function name, "parameters":
dictionary of argument name and its value}'), often after the `<|python_tag|>` token, and
several in a row separated by `;` as vLLM's llama3_json parser reads them:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

`arguments` is taken for `parameters` too. The model writes no tags around a call, so any `{`
may begin one; but the object may hold only `name` and its arguments, and must hold both, so
other JSON in an answer (`{"a": 1}`) is text again as soon as its first key is read. What
follows `<|python_tag|>` and is no JSON call (Llama 3.1's built-in `brave_search.call(...)`)
stays text, tag and all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.tool_calls.json_call import CallKeys, JsonCall
from frontend.tool_calls.stream import WS, Block, CallStream

PYTHON_TAG = "<|python_tag|>"
_KEYS = CallKeys(arguments=("parameters", "arguments"), others=False, required=True)


@dataclass
class _Block(Block):
    call: JsonCall = field(default_factory=lambda: JsonCall(_KEYS))


class Llama3JsonParser(CallStream):
    STARTS = (PYTHON_TAG, "{")

    def _open(self, marker: str) -> Block:
        # After the tag, whitespace and then the object; a `{` has begun the object itself.
        return _Block(call=JsonCall(_KEYS, stage="key_or_close" if marker == "{" else "open"))

    def _step_block(self, block: _Block) -> bool:
        if not block.call.done:
            return block.call.step(self)
        # After a call: `;` and the next one, or else the block ends here.
        stripped = self._buffer.lstrip(WS)
        if not stripped:
            return False
        if stripped[0] == ";":
            self._consume(len(self._buffer) - len(stripped) + 1)
            block.call, block.closable = JsonCall(_KEYS), False
        else:
            self._end_block()
        return True
