"""A sample's reasoning, content and tool calls (frontend.output_events, found by
frontend.sample_parser) in OpenAI's and Anthropic's shapes, streamed or whole."""

from __future__ import annotations

import json
import uuid

from frontend.output_events import CallArguments, CallStart, Content, Event, Reasoning
from frontend.sample_parser import SampleParser


def call_id(prefix: str) -> str:
    """OpenAI's `call_...` and Anthropic's `toolu_...`: 24 random hex characters."""
    return prefix + uuid.uuid4().hex[:24]


class OpenAIDeltas:
    """One chat sample's stream: each piece of text -> its `delta` (reasoning_content, content,
    tool_calls: only what moved); remembers each call's id."""

    def __init__(self, parser: SampleParser) -> None:
        self.parser = parser
        self.ids: dict[int, str] = {}

    def delta(self, text: str, final: bool, token_ids=()) -> dict:
        return openai_fields(self.parser.feed(text, final, token_ids), self.ids)


def openai_fields(events: list[Event], ids: dict[int, str]) -> dict:
    """{reasoning_content, content, tool_calls}, the empty ones left out. tool_calls: one
    entry per call that moved; a call's first entry has its id, type and name, and every
    entry the next piece of its arguments."""
    reasoning, content, entries = [], [], {}
    for e in events:
        if isinstance(e, Reasoning):
            reasoning.append(e.text)
        elif isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            ids[e.index] = call_id("call_")
            entries[e.index] = {"index": e.index, "id": ids[e.index], "type": "function",
                                "function": {"name": e.name, "arguments": ""}}
        else:
            entry = entries.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    fields = {"reasoning_content": "".join(reasoning), "content": "".join(content),
              "tool_calls": list(entries.values())}
    return {k: v for k, v in fields.items() if v}


def openai_message(events: list[Event], reasoning: bool, tools: bool) -> dict:
    """A whole chat sample's message fields: content (None when there are calls and no text),
    reasoning_content where a reasoning parser ran, tool_calls where a tool parser did."""
    fields = openai_fields(events, {})
    message = {"content": fields.get("content", "")}
    if reasoning:
        message["reasoning_content"] = fields.get("reasoning_content")
    if tools:
        message["tool_calls"] = [{"id": e["id"], "type": "function", "function": e["function"]}
                                 for e in fields.get("tool_calls", [])]
        message["content"] = message["content"] or None
    return message


def anthropic_blocks(events: list[Event], omit_thinking: bool = False) -> list[dict]:
    """A whole sample's content blocks: thinking, text and tool_use, in order. `omit_thinking`
    (Anthropic's thinking.display "omitted"): thinking blocks without their text."""
    blocks, arguments = [], {}
    for e in events:
        if isinstance(e, (Content, Reasoning)):
            kind, key = ("text", "text") if isinstance(e, Content) else ("thinking", "thinking")
            text = "" if omit_thinking and kind == "thinking" else e.text
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][key] += text
            else:
                blocks.append(_block(kind) | {key: text})
        elif isinstance(e, CallStart):
            blocks.append(_block("tool_use", e.name))
            arguments[len(blocks) - 1] = ""
        else:
            arguments[len(blocks) - 1] += e.text
    for i, args in arguments.items():
        # Whole: a parse leaves no call cut off; and readable: the parsers take no call whose
        # arguments json.loads could not read back (frontend/tool_calls/arguments.py).
        blocks[i]["input"] = json.loads(args)
    return blocks


def _block(kind: str, name: str = "") -> dict:
    """A content block as it opens: empty. Anthropic signs its thinking blocks; ours are
    unsigned (empty signature), and are not checked when a client sends them back."""
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if kind == "tool_use":
        return {"type": "tool_use", "id": call_id("toolu_"), "name": name, "input": {}}
    return {"type": "text", "text": ""}


class AnthropicBlocks:
    """A stream's content blocks, opened as the events need them: thinking_delta for
    reasoning, text_delta for content, a tool_use block (input {}) then input_json_delta
    pieces for each call. `omit_thinking`: thinking blocks open and close with no text."""

    def __init__(self, event, omit_thinking: bool = False) -> None:
        self.event = event  # (kind, data) -> one SSE event
        self.omit_thinking = omit_thinking
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def send(self, events: list[Event]) -> list[str]:
        out = []
        for e in events:
            if isinstance(e, Reasoning):
                if self.kind != "thinking":
                    out += self._open(_block("thinking"))
                if not self.omit_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, Content):
                if self.kind != "text":
                    out += self._open(_block("text"))
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                out += self._open(_block("tool_use", e.name))
            elif isinstance(e, CallArguments):
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def close(self) -> list[str]:
        """The last block's stop; an answer with no content at all still gets an empty text block."""
        out = self._open(_block("text")) if self.kind is None else []
        return out + self._stop()

    def _open(self, block: dict) -> list[str]:
        out = [] if self.kind is None else self._stop()
        self.index += 1
        self.kind = block["type"]
        return out + [self.event("content_block_start", {"index": self.index, "content_block": block})]

    def _stop(self) -> list[str]:
        # Anthropic ends a thinking block with its signature; ours is empty (see _block).
        signature = [self._delta({"type": "signature_delta", "signature": ""})] if self.kind == "thinking" else []
        return signature + [self.event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict) -> str:
        return self.event("content_block_delta", {"index": self.index, "delta": delta})
