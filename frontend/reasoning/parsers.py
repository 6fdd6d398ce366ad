"""The reasoning parsers by name (`--reasoning-parser`). Each takes one sample's text piece by
piece (`feed`), then `finish()`, and returns Reasoning and Content events (frontend.output_events)."""

from __future__ import annotations

from typing import Protocol

from frontend.output_events import Content, Reasoning

_PARSERS: dict[str, type] = {}
NAMES = tuple(_PARSERS)


class ReasoningParser(Protocol):
    def feed(self, text: str) -> list[Reasoning | Content]: ...

    def finish(self) -> list[Reasoning | Content]: ...


def make_parser(name: str) -> ReasoningParser:
    return _PARSERS[name]()


def choose(chat_template: str | None) -> str | None:
    """The parser for a model whose chat template is this, where that is unambiguous; else None."""
    return None
