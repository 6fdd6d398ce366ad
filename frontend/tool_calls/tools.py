"""A request's tools and tool choice, as both HTTP APIs (OpenAI's and Anthropic's) give them.

Each API's route turns its own shapes into these (`frontend/http/params.py`); from here on
the prompt, the grammar and the parser see one form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import InvalidRequest
from common.structured_output.params import StructuredOutputsParams
from frontend.tool_calls.grammar import forced_calls_grammar, harmony_call_grammar

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128
MODES = ("none", "auto", "required", "named")


@dataclass(frozen=True)
class Tool:
    """One function the model may call; `parameters` is the JSON schema of its arguments."""

    name: str
    description: str | None
    parameters: dict

    def template_entry(self) -> dict:
        """The shape chat templates read (transformers' convention: OpenAI's)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """none: no call (the text is content); auto: the model decides and the parser finds its
    calls; required: one or more calls; named: exactly one call of `name`. The last two are
    enforced by a grammar. `parallel` false: at most one call where the grammar decides."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[Tool, ...]
    choice: ToolChoice

    @property
    def parses(self) -> bool:
        """Does the output go through the tool-call parser?"""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def forced(self) -> bool:
        """Are the calls forced by a grammar (required, named)?"""
        return self.choice.mode in ("required", "named")

    def constraint(self, harmony: bool = False) -> StructuredOutputsParams | None:
        """The grammar that forces the calls (required, named), or None; `harmony`: in
        harmony's call messages (gpt-oss), which hold one call each."""
        if not self.forced:
            return None
        tools = self.tools if self.choice.mode == "required" else [t for t in self.tools if t.name == self.choice.name]
        if harmony:
            return StructuredOutputsParams(grammar=harmony_call_grammar(tools))
        one = self.choice.mode == "named" or not self.choice.parallel
        return StructuredOutputsParams(grammar=forced_calls_grammar(tools, one=one))


def tool_use(tools: list[Tool], choice: ToolChoice, field: str = "tools") -> ToolUse | None:
    """The checked pair, or None when the request has no tools. `field` names the request's
    tool list in messages (each API spells it its own way)."""
    if not tools:
        if choice.mode in ("required", "named"):
            wanted = f"a call of {choice.name!r}" if choice.mode == "named" else "a tool call"
            raise InvalidRequest(f"tool_choice: asks for {wanted}, but no tools were given")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{field}: at most {MAX_TOOLS} tools, got {len(tools)}")
    seen = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool.name, str) or not NAME.fullmatch(tool.name):
            raise InvalidRequest(f"{field}[{i}].name: {tool.name!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if tool.name in seen:
            raise InvalidRequest(f"{field}[{i}].name: {tool.name!r} is given twice; tool names must be unique")
        seen.add(tool.name)
        if tool.parameters.get("type", "object") != "object":
            raise InvalidRequest(f"{field}[{i}].parameters: must be a JSON schema of type \"object\" "
                                 f"(the arguments are an object), got type {tool.parameters.get('type')!r}")
    if choice.mode == "named" and choice.name not in seen:
        raise InvalidRequest(f"tool_choice: no tool is named {choice.name!r}; the tools are "
                             f"{', '.join(sorted(seen))}")
    return ToolUse(tuple(tools), choice)
