"""The reasoning parsers by name (`--reasoning-parser`). Each takes one sample's text piece by
piece (`feed`), then `finish()`, and returns Reasoning and Content events (frontend.output_events)."""

from __future__ import annotations

import re
from typing import Protocol

from frontend.output_events import Content, Reasoning
from frontend.reasoning.think_tags import CLOSE, OPEN, DeepSeekR1, Qwen3

_PARSERS: dict[str, type] = {"qwen3": Qwen3, "deepseek_r1": DeepSeekR1}
NAMES = tuple(_PARSERS)
# A Jinja string literal, single- or double-quoted.
_LITERAL = re.compile(r"""'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)\"""")


class ReasoningParser(Protocol):
    def feed(self, text: str) -> list[Reasoning | Content]: ...

    def finish(self) -> list[Reasoning | Content]: ...


def make_parser(name: str) -> ReasoningParser:
    return _PARSERS[name]()


def end_tag(name: str) -> str:
    """The text that ends the reasoning: where structured output starts (frontend/http/params.py)."""
    return _PARSERS[name].end


def choose(chat_template: str | None) -> str | None:
    """The parser for a model whose chat template is this, where that is unambiguous; else None.

    deepseek_r1: the generation prompt opens `<think>` (DeepSeek-R1, QwQ, Qwen3's thinking-only
    releases), and nothing switches that off. qwen3: the template has Qwen3's `enable_thinking`
    switch, and its generation prompt opens no `<think>` (the model writes it when it thinks).
    A template with both (thinking opened in the prompt unless enable_thinking is false) needs
    to know which a request chose, which a parser of the text alone cannot: None."""
    if not chat_template or CLOSE not in chat_template:
        return None
    at = chat_template.rfind("add_generation_prompt")
    generation = chat_template[at:] if at >= 0 else ""
    literals = (a or b for a, b in _LITERAL.findall(generation))
    opens = any(OPEN in s and CLOSE not in s for s in literals)
    switch = "enable_thinking" in chat_template
    if opens and not switch:
        return "deepseek_r1"
    if switch and not opens:
        return "qwen3"
    return None
