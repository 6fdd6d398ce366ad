"""What a sample's text is made of, as the parsers find it while it streams:

    Reasoning(text)            the model's thinking (frontend/reasoning), before the answer
    Content(text)              the answer's text outside any tool call
    CallStart(index, name)     a tool call whose name is known and whose arguments have begun
    CallArguments(index, text) the next piece of that call's arguments (JSON text; a call's
                               pieces concatenate to its whole arguments object)

Every HTTP API (chat completions, Anthropic messages, Responses) writes these in its own shape.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str


Event = Reasoning | Content | CallStart | CallArguments
