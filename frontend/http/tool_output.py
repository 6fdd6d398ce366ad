"""Tool calls in the HTTP APIs' answers: the Hermes parser's events in OpenAI's and
Anthropic's shapes, streamed or whole."""

from __future__ import annotations

import json
import uuid

from frontend.tool_calls.hermes import CallArguments, CallStart, Content, Event, HermesParser, parse


def call_id(prefix: str) -> str:
    """OpenAI's `call_...` and Anthropic's `toolu_...`: 24 random hex characters."""
    return prefix + uuid.uuid4().hex[:24]


class StreamedCalls:
    """One sample's text through the parser, delta by delta; remembers each call's id."""

    def __init__(self) -> None:
        self.parser = HermesParser()
        self.ids: dict[int, str] = {}

    def events(self, text: str, final: bool) -> list[Event]:
        events = self.parser.feed(text) if text else []
        return events + self.parser.finish() if final else events

    @property
    def num_calls(self) -> int:
        return self.parser.num_calls


def openai_delta(events: list[Event], ids: dict[int, str]) -> tuple[str, list[dict]]:
    """(content, delta.tool_calls): one entry per call that moved; a call's first entry has
    its id, type and name, and every entry the next piece of its arguments."""
    content, entries = [], {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            ids[e.index] = call_id("call_")
            entries[e.index] = {"index": e.index, "id": ids[e.index], "type": "function",
                                "function": {"name": e.name, "arguments": ""}}
        else:
            entry = entries.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    return "".join(content), list(entries.values())


def openai_message(text: str) -> tuple[str | None, list[dict]]:
    """A whole sample's (message.content, message.tool_calls); content None when empty."""
    content, entries = openai_delta(parse(text), {})
    calls = [{"id": e["id"], "type": "function", "function": e["function"]} for e in entries]
    return content or None, calls


def anthropic_blocks(text: str) -> list[dict]:
    """A whole sample's content blocks: text and tool_use, in order."""
    blocks, arguments = [], {}
    for e in parse(text):
        if isinstance(e, Content):
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += e.text
            else:
                blocks.append({"type": "text", "text": e.text})
        elif isinstance(e, CallStart):
            blocks.append({"type": "tool_use", "id": call_id("toolu_"), "name": e.name, "input": {}})
            arguments[len(blocks) - 1] = ""
        else:
            arguments[len(blocks) - 1] += e.text
    for i, args in arguments.items():
        blocks[i]["input"] = json.loads(args)  # whole: parse() leaves no call cut off
    return blocks


class AnthropicBlocks:
    """A stream's content blocks, opened as the events need them: text_delta for content,
    a tool_use block (input {}) then input_json_delta pieces for each call."""

    def __init__(self, event) -> None:
        self.event = event  # (kind, data) -> one SSE event
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def send(self, events: list[Event]) -> list[str]:
        out = []
        for e in events:
            if isinstance(e, Content):
                if self.kind != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                out += self._open({"type": "tool_use", "id": call_id("toolu_"), "name": e.name, "input": {}})
            elif isinstance(e, CallArguments):
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def close(self) -> list[str]:
        """The last block's stop; an answer with no content at all still gets an empty text block."""
        out = self._open({"type": "text", "text": ""}) if self.kind is None else []
        return out + [self.event("content_block_stop", {"index": self.index})]

    def _open(self, block: dict) -> list[str]:
        out = [] if self.kind is None else [self.event("content_block_stop", {"index": self.index})]
        self.index += 1
        self.kind = block["type"]
        return out + [self.event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return self.event("content_block_delta", {"index": self.index, "delta": delta})
