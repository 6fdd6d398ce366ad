"""The tool-call parsers, one per model family's output format, by name (`--tool-call-parser`).

Each parser takes one sample's text piece by piece (`feed`), then `finish()`, and returns
frontend.output_events; `num_calls` counts the calls announced so far. `parse(name, text)`
reads a whole text, where a malformed or cut-off call is always plain content.
"""

from __future__ import annotations

from typing import Protocol

from frontend.output_events import Event
from frontend.tool_calls import hermes

# The format our grammar writes when it forces calls (tool_choice required or named).
FORCED = "hermes"


class ToolParser(Protocol):
    num_calls: int

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


_PARSERS = {"hermes": (hermes.HermesParser, hermes.parse)}
NAMES = tuple(_PARSERS)


def make_parser(name: str) -> ToolParser:
    return _PARSERS[name][0]()


def parse(name: str, text: str) -> list[Event]:
    return _PARSERS[name][1](text)


def choose(chat_template: str | None) -> str:
    """The parser for a model whose chat template is this: the format its template teaches."""
    return "hermes"
