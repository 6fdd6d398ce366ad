"""Hermes-style tool calls found in generated text while it streams:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format of Hermes 2 Pro, Qwen2.5/3 and many models trained after them, and the one our
grammar forces for tool_choice "required" or a named tool. Several calls are several blocks.
The body is a JSON object (frontend/tool_calls/json_call.py) whose arguments are under
`arguments` or `parameters` (Llama 3 style), in either order with the name; other keys are
ignored, and a call without arguments gets {}. A missing closing tag is forgiven; a block
that is not a well-formed call stays text, tags and all (frontend/tool_calls/stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.output_events import CallArguments, CallStart, Content, Event
from frontend.tool_calls.json_call import CallKeys, JsonCall
from frontend.tool_calls.stream import WS, Block, CallStream

__all__ = ["CallArguments", "CallStart", "Content", "HermesParser", "parse", "tags_are_special"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_KEYS = CallKeys(arguments=("arguments", "parameters"), others=True, required=False)


@dataclass
class _Block(Block):
    call: JsonCall = field(default_factory=lambda: JsonCall(_KEYS))


class HermesParser(CallStream):
    STARTS = (OPEN,)

    def _open(self, marker: str) -> Block:
        return _Block()

    def _step_block(self, block: _Block) -> bool:
        if not block.call.done:
            return block.call.step(self)
        # After the object: whitespace and the closing tag, or else the block ends here.
        stripped = self._buffer.lstrip(WS)
        if stripped.startswith(CLOSE):
            self._buffer = stripped[len(CLOSE):]
        elif CLOSE.startswith(stripped):
            return False  # it may still come
        self._end_block()
        return True


def tags_are_special(tokenizer, tags: tuple[str, ...] = (OPEN, CLOSE)) -> bool:
    """Does the tokenizer hold one of `tags` as a special token (Hermes 2 Pro's holds
    <tool_call>)? Then the output must keep special tokens, or the parser never sees them."""
    backend = getattr(tokenizer, "backend", None)  # frontend.tokenizer.Tokenizer's tokenizers.Tokenizer
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return False
    return any(t.special and t.content in tags for t in backend.get_added_tokens_decoder().values())


def parse(text: str) -> list[Event]:
    """The events of a whole text: as a stream's, except that a block cut off or malformed
    anywhere is Content (nothing was sent that could not be taken back)."""
    return HermesParser.parse(text)
